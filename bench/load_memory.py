#!/usr/bin/env python3
"""Host memory of loading a Hugging Face checkpoint into the tiered runtime: `from_pretrained`
(the whole model in fp32 before the runtime sees it) against the streamed loader
(tierlm.models.load: a meta-device skeleton whose segments are read tensor by tensor).

A Llama checkpoint of a few hundred MB is written once in bf16 as shards. Each row then runs in
a fresh process and reports its RSS after the imports and its peak RSS (VmHWM) while loading:

- `from_pretrained fp32`: the load alone;
- `from_pretrained -> engine`: what `tierlm train --model DIR --offload-policy P` did before
  the streamed loader (load, then the engine packs its segments and empties the parameters);
- `streamed -> engine`: what it does now.

Every process fixes glibc's mmap threshold, so freed buffers return to the system the same way
in every row. Prints a table (added = peak - RSS after imports; ratios against the first row):

    python bench/load_memory.py --layers 12 --policy disk
    python bench/load_memory.py --policy tiered --device-budget 1GiB --host-budget 1GiB

Results: none recorded yet; a run goes in docs/results/memory-and-rss.md.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import tempfile
from pathlib import Path

MIB = 2**20


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _row(kind: str, path: str, args: argparse.Namespace, offload_dir: str, queue) -> None:
    try:
        queue.put(_load(kind, path, args, offload_dir))
    except BaseException as exc:
        queue.put(exc)
        raise


def _load(kind: str, path: str, args: argparse.Namespace, offload_dir: str) -> tuple:
    import torch
    from transformers import AutoModelForCausalLM

    from tierlm.config import OptimConfig, parse_bytes
    from tierlm.models import hf_model_skeleton
    from tierlm.models.load import CheckpointWeights
    from tierlm.runtime import EngineOptions, build_engine

    libc = ctypes.CDLL("libc.so.6")
    # M_MMAP_THRESHOLD fixed for both rows (a run keeps glibc's defaults): large frees go back
    # to the system, so each row's peak is what its path holds, not what glibc's heap kept
    libc.mallopt(-3, 128 * 1024)
    torch.set_num_threads(1)
    gc.collect()
    libc.malloc_trim(0)
    start = _status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM restarts from the current RSS
    options = EngineOptions(
        policy=args.policy, offload_dir=offload_dir,
        device_budget_bytes=parse_bytes(args.device_budget) if args.device_budget else None,
        host_budget_bytes=parse_bytes(args.host_budget) if args.host_budget else None,
    )
    report = None
    if kind == "from_pretrained fp32":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    elif kind == "from_pretrained -> engine":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine = build_engine(model, OptimConfig(), options, device=torch.device("cpu"))
        report = engine.report
    else:
        model = hf_model_skeleton(path)
        engine = build_engine(model, OptimConfig(), options, device=torch.device("cpu"),
                              initial_weights=CheckpointWeights(path, model))
        report = engine.report
    peak = _status_bytes("VmHWM:")
    managed = None if report is None else (report.device_bytes, report.host_bytes)
    return kind, start, peak, managed


def _measure(kind: str, path: Path, args: argparse.Namespace) -> tuple:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=args.dir) as offload_dir:
        proc = ctx.Process(target=_row, args=(kind, str(path), args, offload_dir, queue))
        proc.start()
        out = queue.get(timeout=1800)
        proc.join()
    if isinstance(out, BaseException):
        raise SystemExit(f"{kind}: {out}")
    return out


def _write_checkpoint(path: Path, args: argparse.Namespace) -> tuple[int, int]:
    """The checkpoint, and (parameters, fp32 bytes of the largest segment)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")
    params = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    return params, 4 * max(block, args.vocab * args.hidden)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--policy", default="disk", help="the engine's --offload-policy")
    p.add_argument("--device-budget", default=None)
    p.add_argument("--host-budget", default="768MiB",
                   help="the disk tier stages two segments' state through host RAM")
    p.add_argument("--dir", default=None, help="where the checkpoint and disk tier go")
    args = p.parse_args()
    kinds = ("from_pretrained fp32", "from_pretrained -> engine", "streamed -> engine")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "ckpt"
        params, segment_bytes = _write_checkpoint(path, args)
        on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        rows = [_measure(kind, path, args) for kind in kinds]
    print(f"Llama, {params / 1e6:.0f}M params: {on_disk / MIB:.0f} MiB of bf16 shards, "
          f"{params * 4 / MIB:.0f} MiB in fp32; largest segment {segment_bytes / MIB:.0f} MiB "
          f"in fp32; engine --offload-policy {args.policy}, device budget "
          f"{args.device_budget or '-'}, host budget {args.host_budget or '-'}")
    print()
    print("| load | RSS after imports MiB | peak RSS MiB | added MiB | added vs from_pretrained "
          "| engine's managed device + host MiB |")
    print("|---|---|---|---|---|---|")
    base = rows[0][2] - rows[0][1]
    for kind, start, peak, managed in rows:
        added = peak - start
        managed_s = "-" if managed is None else f"{managed[0] / MIB:.0f} + {managed[1] / MIB:.0f}"
        print(f"| {kind} | {start / MIB:.0f} | {peak / MIB:.0f} | {added / MIB:.0f} "
              f"| {added / base:.2f}x | {managed_s} |")


if __name__ == "__main__":
    main()
