"""From a run's config to the planner's inputs and its plan: the hardware profile, the step
shape, and the plan itself (`make_plan`, `plan_auto`, `predict_for_engine`). The precision choice
(`auto` resolved) is tierlm.precision.choice."""

from __future__ import annotations

from typing import Any

import torch

from tierlm.config import (
    Config,
    base_format_of,
    lora_of,
    parse_bytes,
)
from tierlm.distributed.strategies import sync_config
from tierlm.memory.device import sim_profile
from tierlm.memory.hardware import HardwareProfile, resolve
from tierlm.memory.placement import PlacementError
from tierlm.models import preset_config
from tierlm.models.hf import _check_checkpoint_dir
from tierlm.plan.checks import check_supported
from tierlm.plan.evaluate import evaluate
from tierlm.plan.result import Plan, usable_budgets
from tierlm.plan.search import plan
from tierlm.runtime.compile import check_compile
from tierlm.runtime.shapes import ModelShape, TrainShape


def hardware_for(cfg: Config) -> HardwareProfile:
    mem = cfg.memory

    def size(v: str | None, flag: str) -> int | None:
        return parse_bytes(v, flag) if v else None

    hardware = mem.hardware
    simulated = sim_profile(cfg.run.device)
    if hardware == "auto" and simulated is not None:
        hardware = simulated.name  # plan for the GPU the run simulates
    return resolve(
        hardware,
        gpu_memory_bytes=size(mem.gpu_memory, "--gpu-memory"),
        host_memory_bytes=size(mem.host_memory, "--host-memory"),
        disk_budget_bytes=size(mem.disk_budget, "--disk-budget"),
        offload_dir=mem.offload_dir,
    )


def cap_gpu_memory(cfg: Config, device: torch.device) -> None:
    """`--gpu-memory` on a CUDA run also caps what this process may allocate on the GPU
    (`torch.cuda.set_per_process_memory_fraction`), so a large card stands in for the smaller
    one the plan is made for; an allocation past the cap raises CUDA's out-of-memory error."""
    if device.type != "cuda" or not cfg.memory.gpu_memory:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    cap = parse_bytes(cfg.memory.gpu_memory, "--gpu-memory")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


def train_shape(cfg: Config, precision: str) -> TrainShape:
    """One rank's step: under context parallel its 1/N share of every row; with --nproc
    ranks (dp x cp, at least the CP group) the gradient sync --grad-sync chose."""
    d = cfg.distributed
    cp = d.context_parallel
    nproc = max(d.nproc, cp)
    return TrainShape(
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len // cp,
        micro_batches=cfg.train.grad_accum_steps,
        precision=precision,
        context_parallel=cp,
        compiled=cfg.run.compile == "segments",
        nproc=nproc,
        grad_sync=sync_config(d, cfg.train.max_steps) if nproc > 1 else None,
        tf32=cfg.precision.tf32,
    )


def make_plan(
    cfg: Config, model_config: Any, hw: HardwareProfile, precision: str,
    shape: ModelShape | None = None, *, advise: bool = True,
) -> tuple[Plan, ModelShape, TrainShape]:
    """`shape`: the model's (default: from `model_config` under the run's optimizer);
    `advise`: a plan that does not fit says what would (the planner searches again for it)."""
    mem = cfg.memory
    shape = shape or ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                            base_format=base_format_of(cfg, precision),
                                            precision=precision)
    train = train_shape(cfg, precision)
    p = plan(
        shape,
        train,
        hw,
        device_budget=parse_bytes(mem.device_budget) if mem.device_budget else None,
        host_budget=parse_bytes(mem.host_budget) if mem.host_budget else None,
        # parked boundaries need every segment to recompute (--boundary-activations), or
        # `dynamic`, which parks the inputs of the segments it recomputes
        park_boundaries=cfg.activations.policy == "dynamic" or (
            cfg.activations.policy in ("none", "full") and not cfg.activations.overrides),
        advise=advise,
    )
    return p, shape, train


def model_config_for(cfg: Config) -> Any:
    """The model's config without weights: the preset's (with its default vocabulary) or the
    checkpoint directory's config.json."""
    if cfg.model.path:
        from pathlib import Path

        from transformers import AutoConfig

        _check_checkpoint_dir(Path(cfg.model.path))
        return AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)

    return preset_config(cfg.model.size, max_seq_len=cfg.data.seq_len)


def check_trainable(cfg: Config, precision: str) -> None:
    """Refuse, as `tierlm train` would, a plan whose run is not built: the plan ends with the
    flags to train it (`--nproc` = dp x `--context-parallel`)."""
    from dataclasses import replace

    dist = cfg.distributed
    run = replace(cfg, distributed=replace(dist, nproc=max(dist.nproc, dist.context_parallel)))
    check_supported(run)
    check_compile(run, precision)


def plan_auto(cfg: Config, model_config: Any, precision: str) -> Plan:
    """`--offload-policy auto`: the planner's choice, or a PlacementError saying what fits."""
    hw = hardware_for(cfg)
    p, _, _ = make_plan(cfg, model_config, hw, precision)
    if not p.fits:
        raise PlacementError(
            f"--offload-policy auto: no plan fits on {hw.name}: " + "; ".join(p.problems)
        )
    return p


def predict_for_engine(cfg: Config, model_config: Any, engine: Any, precision: str) -> Plan:
    """The planner's prediction for the placement the engine actually runs."""
    hw = hardware_for(cfg)
    shape = ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                   base_format=base_format_of(cfg, precision),
                                   precision=precision)
    placements = engine.report.placements
    # the engine's own choice per segment (`none` keeps streamed graphs where the budget holds
    # them); the head keeps as the planner's rule says
    # (an offloaded segment's graph waits in host RAM: counted there, not kept on the device)
    offload = tuple(name == "offload" for name in engine.activation_policies) + (False,)
    keep = (*(not p.recomputes and not off for p, off in zip(engine.policies, offload,
                                                             strict=False)),
            placements[-1].resident and engine.opts.keep_resident_activations)
    return evaluate(
        shape, train_shape(cfg, precision), hw, placements,
        engine.opts.microbatch_order, keep,
        usable_budgets(hw), engine.host_boundaries, readahead=engine.opts.readahead,
        writeback=engine.opts.writeback, offload=offload if any(offload) else (),
    )
