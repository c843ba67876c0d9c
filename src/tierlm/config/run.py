"""Sections `monitor` and `run`: metrics and traces; the run directory, resume, seed, device,
compilation and export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# --device values that name a real device; anything else names a simulated GPU (sim:PROFILE)
PLAIN_DEVICES = ("auto", "cpu", "cuda")


@dataclass(kw_only=True)
class MonitorConfig:
    tensorboard: bool = False
    """Also write every metric to TensorBoard event files under RUN_DIR/tensorboard; needs the
    optional dependency: pip install 'tierlm[tensorboard]' (--tensorboard)."""
    log_every: int = 10
    """Steps between progress lines when stdout is not a terminal (CI, files); a terminal gets
    a live view redrawn in place."""
    trace_step: int = 0
    """Record a timeline of this optimizer step (1-based): every action, wait, copy, disk
    request and optimizer update with its start and end, beside the planner's predicted
    timeline of the same step, to RUN_DIR/trace.json (Chrome trace format: open it in
    ui.perfetto.dev; `tierlm report` draws it). 0: off. Tiered runtime only
    (--monitor.trace_step)."""


@dataclass(kw_only=True)
class RunConfig:
    out: str | None = None
    """Run directory; empty means runs/<model>-<date>-<time> (--out)."""
    resume: str | None = None
    """Run directory whose newest valid checkpoint to continue from; `auto`: the newest valid
    checkpoint under --out, or a fresh start when there is none, so the same command line can
    be rerun after any crash (--resume)."""
    overwrite: bool = False
    """Start over in a run directory that already holds a run: its config, metrics,
    checkpoints, report, exports and disk-tier files are deleted first (other files are left
    alone). Without it (or --resume) such a directory is refused, so a rerun never mixes two
    runs (--overwrite)."""
    keep_checkpoints: int = 3
    """Keep only the newest N checkpoints (older ones are deleted after each save); 0 keeps
    all (--keep-checkpoints)."""
    seed: int = 0
    """Seed for weights, data order, dropout and sampling (--seed)."""
    device: str = "auto"
    """Device to train on: auto (CUDA when present), cpu, cuda, or sim:PROFILE (e.g.
    sim:rtx4090), the tiered runtime on this machine's CPU with a GPU of that hardware profile
    simulated in virtual time: exact numbers, the simulated step time and its split per lane
    (--device)."""
    compile: Literal["off", "segments"] = "off"
    """segments: torch.compile one block's forward (every block of the model runs the same
    compiled code, its weights passed in, so streaming never recompiles) and the head's chunk
    loss; the first step compiles, later runs read the kernels from the inductor cache under
    tierlm's cache dir. fp32 or bf16 (`auto` stops at bf16), not fp8, not with selective or
    dynamic checkpointing, --backend fsdp or --context-parallel; LoRA, QLoRA and data parallel
    compile (--compile)."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the weights in the Hugging Face export (RUN_DIR/hf at the end of a run, and
    `tierlm export`); auto: the dtype of the weights the run started from (the --model
    checkpoint's, e.g. bfloat16; float32 for a --model-size preset) (--export-dtype)."""

