#!/usr/bin/env python3
"""A real-shaped Hugging Face checkpoint whose training state is several times the budgets, run
through every phase of `tierlm train`: load, steps, evaluation, checkpoint, export, sample.

The checkpoint has the exact shapes of a public model (default: Qwen2.5-1.5B: tied 151,936-token
embeddings, GQA 12/2 heads, q/k/v biases) with random bf16 weights, written shard by shard so
the bench itself never holds the model. The run uses `--offload-policy auto` with device + host
budgets at most a third of the training state (16 B/param: fp32 master, gradient, two AdamW
moments), so the disk tier holds the rest. On a CPU-only machine the device tier is RAM too, so
the process is held to the sum of both budgets.

Per phase: wall time, peak RSS (VmHWM, reset at the phase's start) against the budgets, and
bytes read from and written to storage (/proc/self/io). `dd` with O_DIRECT measures the disk
in the same run, for the load-time target (1.5x the time to read the shards and write the
disk tier at dd's rates).

    python bench/scale.py --shape qwen2.5-1.5b --device-budget 3GiB --host-budget 5GiB \\
        --dir /var/tmp/tierlm-scale

Results: docs/results/scale.md (the 135M shape with and without the old mmap threshold:
docs/results/allocator.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

GiB = 2**30

SHAPES = {  # from the models' published config.json files (Qwen2 unless "arch" says)
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "smollm-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536,
                        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        vocab_size=49152, max_position_embeddings=2048, rope_theta=10000.0,
                        rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def io_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def write_checkpoint(out: Path, shape: dict, shard_bytes: int = 2 * GiB) -> int:
    """Random bf16 weights with the model's names and shapes, shard by shard; returns params."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from tierlm.data import train_bpe_tokenizer
    from tierlm.data.corpus import load_corpus

    shape = dict(shape)
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.pop("arch", "qwen2")]
    cfg = config_class(**shape, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # ties listed once
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, weight_map, total = 0, {}, 0
    files: list[str] = []

    def flush() -> None:
        if shards[-1]:
            name = f"shard-{len(files):05d}.safetensors"
            save_file(shards[-1], str(out / name), metadata={"format": "pt"})
            files.append(name)
            for t in shards[-1]:
                weight_map[t] = name
            shards[-1] = {}

    for name, shp in names:
        numel = int(torch.Size(shp).numel())
        if size + 2 * numel > shard_bytes:
            flush()
            size = 0
        if name.endswith("norm.weight"):
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = torch.randn(shp, generator=g).mul_(0.02).to(torch.bfloat16)
        shards[-1][name] = t
        size += 2 * numel
        total += numel
    flush()
    n = len(files)
    renamed = {}
    for i, f in enumerate(files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / f).rename(out / final)
        renamed[f] = final
    index = {"metadata": {"total_size": 2 * total},
             "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg.save_pretrained(out)
    text = " ".join(d.text for d in load_corpus(None, None).train[:4])
    train_bpe_tokenizer([text], vocab_size=4096).save_pretrained(out)
    return total


def dd_rates(directory: Path, nbytes: int = 2 * GiB) -> tuple[float, float]:
    """Sequential O_DIRECT write and read rates (bytes/s) of `directory`'s disk, as dd reports."""
    f = directory / "dd.bin"
    count = nbytes // (64 * 2**20)
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}",
                    "oflag=direct", "status=none"], check=True)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct", "status=none"],
                   check=True)
    read_s = time.perf_counter() - t0
    f.unlink()
    return count * 64 * 2**20 / write_s, count * 64 * 2**20 / read_s


class Phases:
    def __init__(self) -> None:
        self.rows: list[tuple[str, float, int, int, int]] = []

    def run(self, name: str, fn):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        r0, w0 = io_bytes()
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        r1, w1 = io_bytes()
        self.rows.append((name, wall, status("VmHWM:"), r1 - r0, w1 - w0))
        print(f"  {name}: {wall:.1f} s, peak RSS {status('VmHWM:') / GiB:.2f} GiB", flush=True)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    p.add_argument("--dir", default="/var/tmp/tierlm-scale")
    p.add_argument("--device-budget", default="3GiB")
    p.add_argument("--host-budget", default="5GiB")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and run directory")
    args = p.parse_args()

    from tierlm.checkpoint import export_hf_from_checkpoint
    from tierlm.config import from_dict, parse_bytes
    from tierlm.memory.tiers import Tier
    from tierlm.train.safety import malloc_trim
    from tierlm.train.trainer import Trainer

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    src, run_dir = root / "model", root / "run"
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    n = write_checkpoint(src, SHAPES[args.shape])
    shard_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"{args.shape}: {n / 1e9:.2f}B params, {shard_bytes / GiB:.2f} GiB of bf16 shards "
          f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    write_Bps, read_Bps = dd_rates(root)
    state = 16 * n
    budgets = parse_bytes(args.device_budget) + parse_bytes(args.host_budget)
    print(f"training state {state / GiB:.1f} GiB; budgets device {args.device_budget} + host "
          f"{args.host_budget} = {budgets / GiB:.1f} GiB ({budgets / state:.2f} of the state); "
          f"dd O_DIRECT write {write_Bps / 1e9:.2f} GB/s, read {read_Bps / 1e9:.2f} GB/s",
          flush=True)

    cfg = from_dict({
        "model": {"path": str(src)},
        "data": {"seq_len": args.seq_len},
        "train": {"max_steps": args.steps, "batch_size": args.batch_size, "eval_every": 0,
                  "eval_batches": 1, "sample_tokens": 8},
        "memory": {"offload_policy": "auto", "device_budget": args.device_budget,
                   "host_budget": args.host_budget},
        "run": {"out": str(run_dir), "device": "cpu", "seed": 0},
    })
    phases = Phases()
    gc.collect()
    malloc_trim()  # what writing the checkpoint left in glibc's heap: a run starts without it
    base_rss = status("VmRSS:")
    trainer = phases.run("load", lambda: Trainer(cfg, log=lambda m: None))
    disk_state = trainer.stepper.ledger.tier_bytes(Tier.DISK)

    def steps():
        recs = [trainer.train_step() for _ in range(args.steps)]
        trainer.stepper.synchronize()
        return recs

    recs = phases.run("steps", steps)
    phases.run("eval", trainer.evaluate)
    ckpt = phases.run("checkpoint", trainer.save)
    phases.run("export", lambda: export_hf_from_checkpoint(ckpt, run_dir / "hf"))
    phases.run("sample", lambda: trainer.sample(8))
    trainer.stepper.close()

    limit = budgets + GiB  # the whole process: imports and runtime overhead within the 1 GiB
    losses = ", ".join(f"{r['loss']:.3f}" for r in recs)
    print()
    print(f"{args.shape}, {n / 1e9:.2f}B params, training state {state / GiB:.1f} GiB, "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens (losses "
          f"{losses}); disk tier {disk_state / GiB:.1f} GiB; "
          f"budgets {budgets / GiB:.1f} GiB ({budgets / state:.2f} of the state); RSS before "
          f"loading {base_rss / GiB:.2f} GiB (imports)")
    print()
    print("| phase | wall s | peak RSS GiB | peak RSS - start GiB | within budgets + 1 GiB "
          "| read from storage GiB | written to storage GiB |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, wall, peak, rd, wr in phases.rows:
        print(f"| {name} | {wall:.1f} | {peak / GiB:.2f} | {(peak - base_rss) / GiB:.2f} | "
              f"{'yes' if peak <= limit else 'NO'} | {rd / GiB:.2f} | {wr / GiB:.2f} |")
    load_s = phases.rows[0][1]
    bound_s = shard_bytes / read_Bps + disk_state / write_Bps
    print()
    print(f"load: {load_s:.1f} s against {bound_s:.1f} s to read the shards and write the disk "
          f"tier at dd's rates: {load_s / bound_s:.2f}x (target <= 1.5x)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"(free space left at {root.parent}: "
          f"{shutil.disk_usage(root.parent).free / GiB:.0f} GiB)")
    os.sync()


if __name__ == "__main__":
    main()
