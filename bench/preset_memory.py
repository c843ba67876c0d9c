#!/usr/bin/env python3
"""Host memory and time of building the tiered runtime from a preset: `build_model` (the whole
model in fp32, then the engine packs its segments) against the segment-by-segment source
(tierlm.models.init: a meta skeleton, each segment initialised as the engine asks for it).

Each row runs in a fresh process and reports RSS after the imports, peak RSS (VmHWM) while the
engine is built, and the seconds it took; both rows must give the same weights (checked by a
checksum of every segment's master). glibc's mmap threshold is fixed in every process so freed
buffers return to the system the same way, as in bench/load_memory.py.

    python bench/preset_memory.py --model-size 125m --policy disk

Results: docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import tempfile
import time

from load_memory import _status_bytes  # bench/, this script's folder

MIB = 2**20


def _row(kind: str, args: argparse.Namespace, offload_dir: str, queue) -> None:
    try:
        queue.put(_build(kind, args, offload_dir))
    except BaseException as exc:
        queue.put(exc)
        raise


def _build(kind: str, args: argparse.Namespace, offload_dir: str) -> tuple:
    import torch

    from tierlm.config import OptimConfig
    from tierlm.models import build_model, preset_config
    from tierlm.models.init import preset_skeleton
    from tierlm.runtime import EngineOptions, build_engine

    libc = ctypes.CDLL("libc.so.6")
    # M_MMAP_THRESHOLD fixed for both rows (a run keeps glibc's defaults): large frees go back
    # to the system, so each row's peak is what its path holds, not what glibc's heap kept
    libc.mallopt(-3, 128 * 1024)
    gc.collect()
    libc.malloc_trim(0)
    start = _status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    config = preset_config(args.model_size)
    options = EngineOptions(policy=args.policy, offload_dir=offload_dir)
    t0 = time.perf_counter()
    if kind == "build_model -> engine":
        engine = build_engine(build_model(config, seed=0), OptimConfig(), options,
                              device=torch.device("cpu"))
    else:
        model, source = preset_skeleton(config, seed=0)
        engine = build_engine(model, OptimConfig(), options, device=torch.device("cpu"),
                              initial_weights=source)
    seconds = time.perf_counter() - t0
    peak = _status_bytes("VmHWM:")
    checksum = sum(float(w.double().sum()) for w in engine.weights().values())
    engine.close()
    return kind, start, peak, seconds, checksum


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-size", default="125m")
    p.add_argument("--policy", default="disk")
    p.add_argument("--dir", default=None, help="where the disk tier's files go")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for kind in ("build_model -> engine", "segment by segment -> engine"):
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory(dir=args.dir) as offload_dir:
            proc = ctx.Process(target=_row, args=(kind, args, offload_dir, queue))
            proc.start()
            out = queue.get(timeout=3600)
            proc.join()
        if isinstance(out, BaseException):
            raise SystemExit(f"{kind}: {out}")
        rows.append(out)
    base_added = rows[0][2] - rows[0][1]
    print(f"preset {args.model_size}, --offload-policy {args.policy}")
    print("| build | RSS after imports MiB | peak MiB | added MiB | added vs build_model | s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind, start, peak, seconds, _ in rows:
        added = peak - start
        print(f"| {kind} | {start / MIB:.0f} | {peak / MIB:.0f} | {added / MIB:.0f} | "
              f"{added / base_added:.2f}x | {seconds:.1f} |")
    same = rows[0][4] == rows[1][4]
    print(f"same weights (checksum of every master): {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
