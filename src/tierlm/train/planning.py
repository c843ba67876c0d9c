"""Glue between the run config and the planner: hardware, step shape, and the plan itself."""

from __future__ import annotations

from typing import Any

import torch

from tierlm.config import Config, parse_bytes
from tierlm.memory.hardware import HardwareProfile, resolve
from tierlm.memory.planner import ModelShape, Plan, TrainShape, plan


def hardware_for(cfg: Config) -> HardwareProfile:
    mem = cfg.memory

    def size(v: str | None, flag: str) -> int | None:
        return parse_bytes(v, flag) if v else None

    return resolve(
        mem.hardware,
        gpu_memory_bytes=size(mem.gpu_memory, "--gpu-memory"),
        host_memory_bytes=size(mem.host_memory, "--host-memory"),
        disk_budget_bytes=size(mem.disk_budget, "--disk-budget"),
        offload_dir=mem.offload_dir,
    )


def resolve_precision(mode: str, device: torch.device | None, hw: HardwareProfile | None) -> str:
    """`auto`: bf16 where the device computes it natively, fp32 elsewhere. (fp8 is chosen only
    once the fp8 engine exists.)"""
    if mode != "auto":
        return mode
    if device is not None:
        native = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        native = hw is not None and not hw.device_is_cpu
    return "bf16" if native else "fp32"


def train_shape(cfg: Config, precision: str) -> TrainShape:
    return TrainShape(
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len,
        micro_batches=cfg.train.grad_accum_steps,
        precision=precision,
    )


def make_plan(
    cfg: Config, model_config: Any, hw: HardwareProfile, precision: str
) -> tuple[Plan, ModelShape, TrainShape]:
    mem = cfg.memory
    shape = ModelShape.from_config(model_config)
    train = train_shape(cfg, precision)
    p = plan(
        shape,
        train,
        hw,
        device_budget=parse_bytes(mem.device_budget) if mem.device_budget else None,
        host_budget=parse_bytes(mem.host_budget) if mem.host_budget else None,
    )
    return p, shape, train


def model_config_for(cfg: Config) -> Any:
    """The model's config without weights: the preset's (with its default vocabulary) or the
    checkpoint directory's config.json."""
    if cfg.model.path:
        from pathlib import Path

        from transformers import AutoConfig

        from tierlm.models.hf import _check_checkpoint_dir

        _check_checkpoint_dir(Path(cfg.model.path))
        return AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)
    from tierlm.models import preset_config

    return preset_config(cfg.model.size, max_seq_len=cfg.data.seq_len)


def print_plan(cfg: Config, *, as_json: bool = False) -> int:
    """`tierlm plan`: 0 when a plan fits, 3 when nothing does (the output says what would)."""
    import json

    from tierlm.memory.planner import describe

    hw = hardware_for(cfg)
    precision = resolve_precision(cfg.precision.mode, None, hw)
    p, shape, train = make_plan(cfg, model_config_for(cfg), hw, precision)
    if as_json:
        print(json.dumps(p.to_json(), indent=1))
    else:
        print(describe(p, shape, train, hw, run_flags=_input_flags(cfg, precision)))
    return 0 if p.fits else 3


def _input_flags(cfg: Config, precision: str) -> list[str]:
    """The flags that reproduce this plan's inputs on `tierlm train`."""
    m = cfg.memory
    out = ["--model", cfg.model.path] if cfg.model.path else ["--model-size", cfg.model.size]
    out += ["--batch-size", str(cfg.train.batch_size), "--seq-len", str(cfg.data.seq_len),
            "--grad-accum-steps", str(cfg.train.grad_accum_steps), "--precision", precision,
            "--hardware", m.hardware]
    for flag, value in (("--gpu-memory", m.gpu_memory), ("--host-memory", m.host_memory),
                        ("--disk-budget", m.disk_budget), ("--device-budget", m.device_budget),
                        ("--host-budget", m.host_budget)):
        if value:
            out += [flag, value]
    return out
