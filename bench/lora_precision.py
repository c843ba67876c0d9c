#!/usr/bin/env python3
"""LoRA and QLoRA in fp32 and bf16 on the tiered runtime: what the frozen base costs.

One random-initialised Llama (`--hidden`, `--layers`; no download), wrapped with the same
adapters, trained for `--steps` steps on the same random batches with its base streamed from
`--offload-policy` (host by default), four ways: lora and qlora, each in fp32 and bf16. Per
run: the base's bytes on its tier (the ledger: LoRA fp32 holds an fp32 master, bf16 its bf16
compute copy, QLoRA NF4 bytes in either), bytes moved host-to-device per step, the ledger's
device peak, and the median step time after the first; every figure also as a ratio to lora
fp32, measured in the same run, interleaved.

QLoRA's decode (outside the ledger) gets a second table: the buffer the engine reserves for it
now (one matmul's weight, tierlm.precision.nf4.NF4Linear) against the whole-segment decode it
replaced (the largest NF4 segment decoded into fp32, or into its bf16 compute copy), the largest
decoded weight measured alive and how many were alive at once (a hook on the decode), and the
device peak with the decode added both ways (on CUDA also `max_memory_allocated`).

    python bench/lora_precision.py                   # ~1 minute on the 2-core dev CPU
    python bench/lora_precision.py --device cuda     # a GPU's bf16

Results: docs/results/lora-qlora.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tierlm.config import LoraConfig, OptimConfig, PrecisionConfig  # noqa: E402
from tierlm.finetune.lora import apply_lora  # noqa: E402
from tierlm.memory.tiers import Link, Tier  # noqa: E402
from tierlm.precision import nf4, prepare_precision  # noqa: E402
from tierlm.runtime import EngineOptions, build_engine  # noqa: E402

RUNS = [("lora", "fp32"), ("lora", "bf16"), ("qlora", "fp32"), ("qlora", "bf16")]


def build(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def run(model, method: str, precision: str, args, batches, offload: Path) -> dict:
    device = torch.device(args.device)
    model = copy.deepcopy(model)
    if precision == "bf16":
        prepare_precision(model, PrecisionConfig(mode="bf16"), "bf16", device,
                          log=lambda _m: None)
    base_format = "nf4" if method == "qlora" else precision
    autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16))
                if precision == "bf16" else None)
    opts = EngineOptions(policy=args.offload_policy, batch_size=args.batch_size,
                         seq_len=args.seq_len, offload_dir=str(offload),
                         base_format=base_format, **({"autocast": autocast} if autocast else {}))
    eng = build_engine(model, OptimConfig(lr=1e-3), opts, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    live = _LiveDecodes()
    tier = Tier(args.offload_policy) if args.offload_policy in ("host", "disk") else Tier.DEVICE
    base_bytes = sum(st.device_nbytes() for st in eng.states)
    held = eng.ledger.tier_bytes(tier)
    times, losses, h2d = [], [], 0
    for k, b in enumerate(batches):
        before = eng.ledger.total_moved_bytes.get(Link.H2D, 0)
        t0 = time.perf_counter()
        with live:
            rec = eng.step([b], 1e-3)
        times.append(time.perf_counter() - t0)
        losses.append(rec["loss"])
        if k == len(batches) - 1:
            h2d = eng.ledger.total_moved_bytes.get(Link.H2D, 0) - before
    peak = eng.ledger.peak_tier_bytes[Tier.DEVICE]
    decode = {}
    if method == "qlora":
        decode = {"reserved": max(st.compute_format.decoded_nbytes for st in eng.states
                                  if st.compute_format is not None),
                  "whole": max(_whole_segment_decode(st, precision) for st in eng.states
                               if st.compute_format is not None),
                  "alive": live.largest_bytes, "at_once": live.most_alive}
    eng.close()
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"base": base_bytes, "held": held, "h2d": h2d, "peak": peak, "cuda_peak": cuda_peak,
            "step_s": statistics.median(times[1:]), "loss": losses[-1], **decode}


def _whole_segment_decode(st, precision: str) -> int:
    """The buffer an action of NF4 segment `st` decoded its weights into before NF4Linear:
    the flat fp32 layout, or under bf16 a compute copy (the blocks' linear weights bf16, the
    rest fp32, each entry 16-byte aligned)."""
    from tierlm.precision.streaming import ComputeFormat

    if precision != "bf16":
        return 4 * st.layout.numel
    kinds = [k if k == "fp32" else "bf16" for k in st.compute_format.compute_kinds]
    return ComputeFormat(st.layout, kinds).nbytes


class _LiveDecodes:
    """Counts NF4Linear's decoded weights alive at once (a hook on nf4._decode_weight)."""

    def __init__(self) -> None:
        self.alive: list[weakref.ref] = []
        self.most_alive = self.largest_bytes = 0

    def __enter__(self):
        self.decode = nf4._decode_weight

        def counted(*args):
            self.alive = [r for r in self.alive if r() is not None]
            w = self.decode(*args)
            self.alive.append(weakref.ref(w))
            self.most_alive = max(self.most_alive, len(self.alive))
            self.largest_bytes = max(self.largest_bytes, w.numel() * w.element_size())
            return w

        nf4._decode_weight = counted
        return self

    def __exit__(self, *exc) -> None:
        nf4._decode_weight = self.decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--offload-policy", default="host")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    base = build(args.hidden, args.layers, args.vocab)
    apply_lora(base, LoraConfig(rank=args.rank, alpha=2.0 * args.rank), seed=0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
               for _ in range(args.steps)]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method, precision in RUNS:
            out[(method, precision)] = run(base, method, precision, args, batches,
                                           Path(tmp) / f"{method}-{precision}")
            print(f"{method} {precision}: done", flush=True)
    ref = out[("lora", "fp32")]
    kib = 1024
    print(f"\nLlama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, rank "
          f"{args.rank}; {args.steps} steps of {args.batch_size} x {args.seq_len} on "
          f"{args.device}, --offload-policy {args.offload_policy}; ratios to lora fp32\n")
    print("| method | precision | base weights KiB | on its tier KiB | H2D/step KiB "
          "| device peak KiB | step s (median) | last loss |")
    print("|---|---|---|---|---|---|---|---|")
    for (method, precision), r in out.items():
        def cell(key: str, r=r) -> str:
            return f"{r[key] / kib:,.0f} ({r[key] / ref[key]:.2f}x)"

        print(f"| {method} | {precision} | {cell('base')} | {cell('held')} | {cell('h2d')} "
              f"| {cell('peak')} | {r['step_s']:.3f} ({r['step_s'] / ref['step_s']:.2f}x) "
              f"| {r['loss']:.4f} |")
    print("\nQLoRA's NF4 decode (outside the ledger): whole segment (before) against per matmul "
          "(now)\n")
    print("| precision | decode buffer KiB before | now | now/before | largest decoded weight "
          "alive KiB (measured) | decoded weights alive at once | device peak + decode KiB "
          "before | now | now/before | CUDA max allocated KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (method, precision), r in out.items():
        if method != "qlora":
            continue
        before, now = r["peak"] + r["whole"], r["peak"] + r["reserved"]
        cuda = "-" if r["cuda_peak"] is None else f"{r['cuda_peak'] / kib:,.0f}"
        print(f"| {precision} | {r['whole'] / kib:,.0f} | {r['reserved'] / kib:,.0f} "
              f"| {r['reserved'] / r['whole']:.2f}x | {r['alive'] / kib:,.0f} | {r['at_once']} "
              f"| {before / kib:,.0f} | {now / kib:,.0f} | {now / before:.2f}x | {cuda} |")


if __name__ == "__main__":
    main()
