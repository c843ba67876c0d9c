"""The run's compute precision: `--precision auto` resolved against the device (at train time)
or the hardware profile (when planning), and clamped where a feature has no fp8 path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.config import (
    Config,
    ConfigError,
    NotSupportedYet,
    PrecisionConfig,
    check_precision_flags,
    mode_only_flags,
)
from tierlm.memory.hardware import HardwareProfile


@dataclass(frozen=True)
class PrecisionChoice:
    """The run's compute precision (fp32 | bf16 | fp8) and, when --precision auto chose it,
    why."""

    mode: str
    why: str | None = None  # None: the user named the precision

    def describe(self) -> str:
        return f"precision: auto -> {self.mode} ({self.why})" if self.why else (
            f"precision: {self.mode}")


def resolve_precision(
    p: PrecisionConfig, device: torch.device | None, hw: HardwareProfile | None, *,
    backend: str = "engine", compiled: bool = False, context_parallel: int = 1,
) -> PrecisionChoice:
    """`auto`: fp8 where the device has fp8 units (CUDA sm_89+; a profile with
    `fp8_matmul_flops`) or the user asked for emulation (`--fp8-emulate`), else bf16 where the
    device computes it natively, else fp32; at most bf16 under `--backend fsdp` (no fp8 there),
    under `--compile segments` (`compiled`; fp8 is not compiled yet, tierlm.runtime.compile) and
    under `--context-parallel` above 1 (its ring has no fp8 path, tierlm.distributed.context).
    Judged against `device` at train time, against the profile `hw` when planning. A flag the
    resolved precision would ignore (`--fp8-history` under bf16, ...) is an error."""
    if p.mode != "auto":
        return PrecisionChoice(p.mode)
    mode, why = _auto_precision(device, hw)
    if mode != "fp8" and p.fp8_emulate:
        mode, why = "fp8", f"--fp8-emulate on {why}"
    if mode == "fp8" and backend == "fsdp":
        mode, why = "bf16", f"{why}; bf16 at most: --backend fsdp has no fp8"
    if mode == "fp8" and compiled and not p.fp8_emulate:
        mode, why = "bf16", f"{why}; bf16 at most: --compile segments has no fp8 yet"
    if mode == "fp8" and context_parallel > 1 and not p.fp8_emulate:
        mode, why = "bf16", f"{why}; bf16 at most: --context-parallel has no fp8 yet"
    check_precision_flags(p, mode, auto_why=why)
    return PrecisionChoice(mode, why)


def finetune_precision(cfg: Config, choice: PrecisionChoice) -> PrecisionChoice:
    """--finetune lora/qlora computes in fp32 or bf16: the frozen base's copy in the dtype its
    layers compute in (bf16 for the blocks' linear layers: LoRA's base stored and streamed as
    bf16, QLoRA's NF4 decoded to bf16), the adapters' fp32 masters and AdamW state, and every
    matmul under the bf16 policy of full training (tierlm.runtime.frozen). fp8 is not built for
    a frozen base (it would need an E4M3 copy of it, or NF4 re-quantised to E4M3 per action):
    `auto` choosing fp8 becomes bf16, saying why; a named fp8 is refused, naming the flag."""
    if cfg.train.finetune == "full" or choice.mode != "fp8":
        return choice
    if choice.why is None:
        raise NotSupportedYet(f"--finetune {cfg.train.finetune} with --precision fp8",
                              "use --precision bf16 (or auto)")
    for flag, modes in mode_only_flags(cfg.precision):  # asked for fp8 only: nothing reads it
        if "bf16" not in modes:
            raise ConfigError(f"{flag} has no effect under --finetune {cfg.train.finetune}: it "
                              f"computes in bf16 at most; drop {flag.split()[0]}")
    return PrecisionChoice("bf16", f"{choice.why}; bf16 at most: --finetune "
                                   f"{cfg.train.finetune} has no fp8 (its frozen base and "
                                   "adapters compute in bf16)")


def _auto_precision(device: torch.device | None, hw: HardwareProfile | None) -> tuple[str, str]:
    if device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return "fp8", f"{name} (sm_{major}{minor}) has fp8 units"
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{name} (sm_{major}{minor}) computes bf16, has no fp8 units"
        return "fp32", f"{name} (sm_{major}{minor}) has no bf16 or fp8 units"
    if device is not None:
        return "fp32", f"device {device.type}: no fp8 units, no native bf16"
    if hw is None:
        raise ValueError("resolve_precision: give the device or the hardware profile")
    if hw.fp8_matmul_flops is not None:
        return "fp8", f"{hw.name} has fp8 units"
    if hw.device_is_cpu:
        return "fp32", f"{hw.name}: a CPU profile, no fp8 units, no native bf16"
    return "bf16", f"{hw.name} computes bf16, has no fp8 units"
