"""Precision: the per-layer policy, fp8 linear layers with their scaling, and the watch; the
choice of a run's precision (choice.py: `--precision auto` resolved); NF4, the format of a
qlora base, and its linear layer (nf4.py).

`prepare_precision` is the one entry point the trainer calls at setup (before the runtime is
built, so the tiered runtime's `functional_call` runs the swapped modules too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tierlm.config import PrecisionConfig
from tierlm.precision.linear import (
    Bf16Linear,
    Fp8LayerScalers,
    Fp8Linear,
    Fp32Linear,
    PrecisionLinear,
    probe_fp32_out_mm,
)
from tierlm.precision.matmul import Emulated, emulation_note, select_matmul
from tierlm.precision.policy import LayerChoice, classify, linear_dims, scaling_label, table
from tierlm.precision.scaling import DelayedScaling, DynamicScaling, FixedScaling
from tierlm.precision.watch import Fp8ScaleError, Fp8Watch, NoFp8Watch

__all__ = [
    "Fp8ScaleError", "Fp8Watch", "LayerChoice", "NoFp8Watch", "PrecisionLinear", "classify",
    "prepare_precision", "scaling_rules", "set_tf32", "table",
]


def scaling_rules(cfg: PrecisionConfig):
    """(input rule, gradient rule) for fp8 layers; weights are always dynamic."""
    if cfg.fp8_scaling == "delayed":
        rule = DelayedScaling(cfg.fp8_history)
        return rule, rule
    if cfg.fp8_scaling == "fixed":
        return FixedScaling(cfg.fp8_input_scale), FixedScaling(cfg.fp8_grad_scale)
    return DynamicScaling(), DynamicScaling()


def set_tf32(enabled: bool, device: torch.device, *, log: Callable[[str], None] = print) -> None:
    """--tf32: let CUDA compute fp32 matmuls (and cuDNN convolutions) on TF32 tensor cores.
    Set for the whole process, as torch's flags are; off leaves torch's default (IEEE fp32
    matmuls), which is what the planner then plans."""
    if not enabled:
        return
    if device.type != "cuda":
        log(f"precision: --tf32 has no effect on device {device.type} (TF32 is a CUDA tensor "
            "core format); fp32 matmuls stay IEEE fp32")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log("precision: fp32 matmuls on TF32 tensor cores (--tf32): 10-bit mantissa inputs, fp32 "
        "accumulate")


def prepare_precision(
    model: nn.Module, cfg: PrecisionConfig, mode: str, device: torch.device,
    *, log: Callable[[str], None] = print,
) -> Fp8Watch | NoFp8Watch:
    """Apply the policy to `model` in place (mode: the resolved fp32 | bf16 | fp8), log the
    layer table, and return the watch the loop calls after every step.

    Under fp32 nothing changes. Under bf16 and fp8 the run computes inside bf16 autocast, and
    every linear layer is replaced by a `PrecisionLinear` whose matmul is the one its class
    says: fp32 for sensitive ones (autocast would take the head to bf16), bf16, or fp8.
    """
    choices = classify(model, cfg, mode)
    if mode == "fp32":
        log("precision: fp32 everywhere")
        return NoFp8Watch()
    probe_fp32_out_mm(device)
    any_fp8 = any(c.compute == "fp8" for c in choices)
    mm = select_matmul(device, cfg.fp8_emulate) if any_fp8 else None
    input_rule, grad_rule = scaling_rules(cfg)
    modules = dict(model.named_modules())
    fp8_layers: dict[str, PrecisionLinear] = {}
    for c in choices:
        if not c.is_linear:
            continue
        src = modules[c.name]
        if c.compute == "fp8":
            compute = Fp8Linear(Fp8LayerScalers(c.name, input_rule, grad_rule), mm)
        else:
            compute = Fp32Linear() if c.compute == "fp32" else Bf16Linear()
        transposed = not isinstance(src, nn.Linear)  # GPT-2 Conv1D stores (in, out)
        assert linear_dims(src) is not None
        swapped = PrecisionLinear(c.name, src, compute, transposed=transposed)
        parent_name, _, child = c.name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, swapped)
        if c.compute == "fp8":
            fp8_layers[c.name] = swapped
    head = f"precision: {mode}"
    if mm is not None:
        head += (f"; fp8 matmuls via {mm.name}, E4M3 weights/activations, E5M2 gradients, "
                 f"activation and gradient scaling {scaling_label(cfg)}, weights dynamic")
    log(head + "\n" + table(choices))
    if isinstance(mm, Emulated):  # said once at the start: the run is slower, not faster
        log(emulation_note(device, cfg.fp8_emulate))
    return Fp8Watch(fp8_layers, cfg, log) if fp8_layers else NoFp8Watch()
