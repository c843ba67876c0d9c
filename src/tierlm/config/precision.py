"""Section `precision`: compute precision and fp8 scaling, and which of its flags only mean
something under some compute precisions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tierlm.config.errors import ConfigError


@dataclass(kw_only=True)
class PrecisionConfig:
    mode: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Compute precision, master weights always fp32: fp32; bf16 (autocast, with embeddings,
    norms and the output head kept in fp32); fp8 (as bf16, plus fp8 matmuls for the attention
    and MLP projections); auto (the default) takes fp8 where the device has fp8 units (CUDA
    sm_89+, or with --fp8-emulate; bf16 at most under --backend fsdp or --finetune
    lora/qlora), else bf16 where it computes bf16 natively, else fp32 (a CPU); `tierlm plan`
    resolves it against the --hardware profile. The run logs and saves what auto resolved to
    (--precision)."""
    fp8_scaling: Literal["dynamic", "delayed", "fixed"] = "dynamic"
    """How fp8 activations and gradients are scaled before the cast: dynamic (by the tensor's
    current amax), delayed (by the largest amax of the last fp8_history steps) or fixed
    (fp8_input_scale, fp8_grad_scale: the troubleshooting switch); weights are always scaled
    by their current amax (--fp8-scaling)."""
    fp8_history: int = 16
    """Delayed scaling: optimizer steps of amax history (--fp8-history)."""
    fp8_input_scale: float = 1.0
    """Fixed scaling: multiplier applied to activations before the E4M3 cast (max 448)."""
    fp8_grad_scale: float = 65536.0
    """Fixed scaling: multiplier applied to output gradients before the E5M2 cast (max 57344);
    gradients of a mean token loss are small, hence the large default."""
    fp8_layers: str | None = None
    """Regex of linear layer names to compute in fp8 besides the default (every linear layer
    in the blocks), e.g. 'lm_head' (--fp8-layers)."""
    bf16_layers: str | None = None
    """Regex of linear layer names to keep in bf16 under --precision fp8, e.g. 'down_proj'
    (--bf16-layers)."""
    fp32_layers: str | None = None
    """Regex of linear layer names to compute in fp32, e.g. 'layers\\.0\\.' (--fp32-layers);
    embeddings, norms and the output head are fp32 anyway."""
    fp8_overflow_steps: int = 16
    """An fp8 layer whose tensors saturate more than fp8_overflow_fraction of their values for
    this many steps in a row is switched to bf16 (logged); 0: never switch."""
    fp8_overflow_fraction: float = 0.001
    """Share of a tensor's values that may saturate in a step before the step counts as an
    overflow step for its layer."""
    fp8_emulate: bool = False
    """Compute fp8 matmuls by dequantising to fp32 and multiplying (same numerics, no speed-up)
    instead of torch._scaled_mm; also lets --precision auto choose fp8 on hardware without fp8
    units (--fp8-emulate)."""
    tf32: bool = False
    """On CUDA, compute fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulate) instead of torch's default IEEE fp32; `tierlm plan` plans fp32 compute at the
    TF32 rate (half the bf16 rate) with it, at the card's IEEE fp32 rate without it, which on
    A100/H100 is 8x slower. No effect on a CPU (--tf32)."""



_FP8 = ("fp8",)
_LOW = ("bf16", "fp8")


def mode_only_flags(p: PrecisionConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The precision flags `p` sets that only mean something under some compute precisions:
    (the flag as the user gave it, those precisions)."""
    d = PrecisionConfig()
    table = (
        ("--fp8-layers", p.fp8_layers, d.fp8_layers, _FP8),
        ("--bf16-layers", p.bf16_layers, d.bf16_layers, _LOW),
        ("--fp32-layers", p.fp32_layers, d.fp32_layers, _LOW),
        ("--fp8-scaling " + p.fp8_scaling, p.fp8_scaling, d.fp8_scaling, _FP8),
        ("--fp8-history", p.fp8_history, d.fp8_history, _FP8),
        ("--precision.fp8_input_scale", p.fp8_input_scale, d.fp8_input_scale, _FP8),
        ("--precision.fp8_grad_scale", p.fp8_grad_scale, d.fp8_grad_scale, _FP8),
        ("--precision.fp8_overflow_steps", p.fp8_overflow_steps, d.fp8_overflow_steps, _FP8),
        ("--precision.fp8_overflow_fraction", p.fp8_overflow_fraction,
         d.fp8_overflow_fraction, _FP8),
        ("--fp8-emulate", p.fp8_emulate, d.fp8_emulate, _FP8),
    )
    return [(flag, modes) for flag, value, default, modes in table if value != default]


def check_precision_flags(p: PrecisionConfig, mode: str, auto_why: str | None = None) -> None:
    """Refuse a flag that the compute precision `mode` would silently ignore. `auto_why`: `mode`
    is what --precision auto resolved to, and why (the error says so)."""
    for flag, modes in mode_only_flags(p):
        if mode in modes:
            continue
        wanted = " or ".join(modes)
        if auto_why is None:
            raise ConfigError(f"{flag} has no effect with --precision {mode}; use --precision "
                              f"{wanted}")
        raise ConfigError(f"{flag} has no effect: --precision auto resolved to {mode} here "
                          f"({auto_why}); add --precision {wanted}, or drop {flag.split()[0]}")

