#!/usr/bin/env python3
"""Checkpointing a disk-tier run needs a segment of RAM, not the model: peak RSS of one save.

A model whose master weights and AdamW moments live on the disk tier is checkpointed twice, each
in a fresh subprocess so the peaks do not mix:

- baseline: the whole state gathered in RAM first (`weights()` + `optimizer_state()`, as the
  checkpoint code did before streaming), written with `safetensors.torch.save_file`, fsynced
  and checksummed by reading the files back (as that code did);
- streamed: `save_checkpoint(shards=engine.state_shards())`, one segment staged at a time.

Both are measured as the rise of the process's peak RSS (VmHWM, reset before the save) over its
RSS right before it. Also printed: the save time and the checkpoint size.

    python bench/checkpoint_memory.py --model-size 125m

Results: none recorded yet; a run goes in docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, ctypes, gc
from pathlib import Path
import torch
from tierlm.config import OptimConfig
from tierlm.models import build_model, preset_config
from tierlm.runtime import EngineOptions, build_engine
from tierlm.checkpoint import TrainState, save_checkpoint

# glibc's defaults, as the trainer runs: the store's buffers are mappings of their own
mode, size, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

cfg = preset_config(size, max_seq_len=128)
model = build_model(cfg, device="cpu", seed=0)
n_params = sum(p.numel() for p in model.parameters())
eng = build_engine(model, OptimConfig(lr=1e-4), EngineOptions(
    policy="disk", offload_dir=str(work / "offload"), batch_size=1, seq_len=128),
    device=torch.device("cpu"))
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
t0 = time.perf_counter()
state = TrainState(step=1, sampler={"epoch": 0, "index": 0}, run_config={})
if mode == "baseline":
    from safetensors.torch import save_file
    out = work / "whole"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in eng.weights().items()}, str(out / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in eng.optimizer_state().items()},
              str(out / "optimizer.safetensors"))
    import hashlib, os
    for f in out.iterdir():  # fsync and checksum, as a checkpoint must
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
            h = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
else:
    out = save_checkpoint(work / "run", shards=eng.state_shards(), model_config=model.config,
                          tokenizer=None, state=state)
seconds = time.perf_counter() - t0
size_bytes = sum(f.stat().st_size for f in out.iterdir())
largest = max(st.numel for st in eng.states) * 4
print(json.dumps({"rise": status("VmHWM") - before, "seconds": seconds, "size": size_bytes,
                  "params": n_params, "largest_segment_bytes": largest}))
eng.close()
"""


def run(mode: str, size: str, work: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, size, str(work)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="125m")
    p.add_argument("--dir", default=".", help="where the offload files and checkpoints go")
    args = p.parse_args()
    rows = {}
    for mode in ("baseline", "streamed"):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix=".bench-ckpt-") as d:
            rows[mode] = run(mode, args.model_size, Path(d))
    base = rows["baseline"]
    mib = 2**20
    print(f"\n{args.model_size}: {base['params'] / 1e6:.0f}M params, state on the disk tier; "
          f"largest segment {base['largest_segment_bytes'] / mib:.0f} MiB of fp32\n")
    print("| save | peak RSS rise | vs baseline | time | checkpoint size |")
    print("| --- | --- | --- | --- | --- |")
    for mode, r in rows.items():
        print(f"| {mode} | {r['rise'] / mib:.0f} MiB | {r['rise'] / base['rise']:.2f}x | "
              f"{r['seconds']:.1f} s | {r['size'] / mib:.0f} MiB |")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n(bench took {time.perf_counter() - start:.0f} s)")
