"""Section `distributed`: processes, data-parallel gradient sync, FSDP and context parallel.
Its combinations are checked by `tierlm.distributed.checks`, which knows the strategies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DistributedConfig:
    nproc: int = 1
    """Processes to train with on this machine: `tierlm train --nproc N` re-runs itself under
    torchrun (gloo on CPU, NCCL on CUDA, one GPU per process); under torchrun the world comes
    from torchrun (--nproc)."""
    backend: Literal["engine", "fsdp"] = "engine"
    """engine: data parallel, every rank runs the tiered runtime on its slice of each batch and
    gradients are synced per segment by --grad-sync; fsdp: PyTorch FSDP2 shards weights,
    gradients and optimizer state over the ranks (--backend)."""
    grad_sync: Literal["dense", "topk", "delayed"] | None = None
    """Gradient sync between ranks: dense all-reduce; topk sends the largest
    --sparse-grad-ratio of each gradient, with error feedback; delayed steps locally and
    averages weights every --sync-every steps; empty: topk when --sparse-grad-ratio is given,
    delayed when --sync-every > 1, else dense (--grad-sync)."""
    grad_sync_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of dense gradient reduction (all-reduce, or FSDP's reduce-scatter): bf16
    halves the bytes and sums in bf16."""
    sparse_grad_ratio: float | None = None
    """Fraction of each gradient's entries that top-k sync sends, as values + indices, e.g.
    0.05 (--sparse-grad-ratio)."""
    sparse_grad_ratio_overrides: str = "embed|wte|wpe|lm_head|norm|ln_=1.0"
    """Top-k ratios per parameter: PATTERN=RATIO pairs separated by commas, the first regex
    found in a parameter's name wins, 1.0 means dense; the default keeps embeddings, the output
    head and norms dense; '' sends every parameter at --sparse-grad-ratio
    (--sparse-grad-ratio-overrides)."""
    error_feedback: bool = True
    """Top-k: keep what was not sent in a per-rank residual that joins the next step's gradient
    (saved in checkpoints)."""
    topk_feedback: Literal["residual", "ef21"] = "residual"
    """Top-k with error feedback: `residual` adds what was not sent to the next step's gradient;
    `ef21` keeps per rank a running estimate of its gradient and sends the top-k of the change,
    and every rank steps with the average of the estimates (dense, so Adam never sees an entry
    that was held back for many steps arrive at once)."""
    sparse_warmup_steps: int = 0
    """Top-k: steps over which the ratio falls geometrically from 1.0 (dense) to its target."""
    sync_every: int = 1
    """Delayed sync: average the ranks' weights every k steps and at the last step
    (--sync-every)."""
    sync_moments: Literal["local", "average"] = "local"
    """Delayed sync: what happens to the optimizer's state (AdamW's moments, Lion's moment,
    Adafactor's statistics) when the weights are averaged: local (each rank keeps its own; no
    extra bytes) or average (averaged too, sent in bf16: with AdamW twice the bytes of a sync)
    (--sync-moments)."""
    context_parallel: int = 1
    """Ranks that share every sequence (--context-parallel N, with --nproc = dp x N): each holds
    a zig-zag share of each row (chunks r and 2N-1-r of 2N) and attention runs as a ring over
    them, so activations per rank fall about as 1/N. Llama family (no sliding windows), the
    reference step or the tiered runtime, dense fp32 gradient sync, fp32 or bf16; --seq-len a
    multiple of 2N."""
    fsdp_cpu_offload: bool = False
    """--backend fsdp: keep the shards of weights, gradients and optimizer state in host RAM
    and update them there (FSDP2 CPUOffloadPolicy)."""
    timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before the run fails (a rank that died
    leaves the others waiting this long)."""

