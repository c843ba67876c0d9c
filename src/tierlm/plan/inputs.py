"""From a run's config to the planner's inputs and its plan: the hardware profile, the step
shape, and the plan itself (`make_plan`, `plan_auto`, `predict_for_engine`). The precision choice
(`auto` resolved) is tierlm.precision.choice."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tierlm.config import (
    Config,
    ConfigError,
    base_format_of,
    lora_of,
    parse_bytes,
)
from tierlm.config.units import parse_bandwidth
from tierlm.distributed.strategies import sync_config
from tierlm.memory.device import sim_profile
from tierlm.memory.hardware import HardwareProfile, MemoryNodeProfile, resolve
from tierlm.memory.placement import PlacementError
from tierlm.models import preset_config
from tierlm.models.hf import _check_checkpoint_dir
from tierlm.plan.checks import check_supported
from tierlm.plan.evaluate import adopt_simulated, evaluate, simulated_times, simulation_gap
from tierlm.plan.result import Plan, usable_budgets
from tierlm.plan.search import plan
from tierlm.runtime.compile import check_compile
from tierlm.runtime.shapes import ModelShape, TrainShape

if TYPE_CHECKING:
    from tierlm.node.client import NodeHello


# TCP over Ethernet at a 1500-byte MTU carries 1448 payload bytes per 1538 on the wire
# (headers, timestamps option, preamble and inter-frame gap): --net-bandwidth is the line rate
TCP_PAYLOAD_SHARE = 1448 / 1538


def memory_node_for(cfg: Config, reported: NodeHello | None = None) -> MemoryNodeProfile | None:
    """The memory node the plan places state on (None: none): its memory from
    --memory-node-memory (with --memory-node: at most what the node reports at its
    handshake, `reported`, which the trainer fills in once connected), its link rate from
    --net-bandwidth (the line rate, of which TCP carries `TCP_PAYLOAD_SHARE`) or else the
    rate the handshake measured (the slower direction)."""
    mem = cfg.memory
    flag_bytes = (parse_bytes(mem.memory_node_memory, "--memory-node-memory")
                  if mem.memory_node_memory else None)
    if mem.memory_node is None and flag_bytes is None:
        if mem.net_bandwidth:
            raise ConfigError("--net-bandwidth is the link to a memory node: give the node's "
                              "--memory-node-memory to plan one (or --memory-node to use one)")
        return None
    if flag_bytes is None and reported is None:
        raise ConfigError("--memory-node: the plan does not connect to the node; give its "
                          "RAM with --memory-node-memory and its link with --net-bandwidth")
    memory = flag_bytes if reported is None else (
        reported.memory_bytes if flag_bytes is None else min(flag_bytes, reported.memory_bytes))
    measured = None if reported is None or not (
        reported.link_up_bytes_per_s and reported.link_down_bytes_per_s) else min(
        reported.link_up_bytes_per_s, reported.link_down_bytes_per_s)
    if mem.net_bandwidth:
        net = parse_bandwidth(mem.net_bandwidth, "--net-bandwidth") * TCP_PAYLOAD_SHARE
    elif measured is not None:
        net = measured
    else:
        raise ConfigError("--memory-node-memory: the plan needs the link rate to the memory "
                          "node: give --net-bandwidth (e.g. 25Gbit, 10GbE or 3GB/s)")
    return MemoryNodeProfile(memory_bytes=memory, net_Bps=net)


def hardware_for(cfg: Config, *, node: NodeHello | None = None) -> HardwareProfile:
    """The hardware the plan is made for; `node`: what a connected memory node reported at its
    handshake (`memory_node_for`)."""
    mem = cfg.memory

    def size(v: str | None, flag: str) -> int | None:
        return parse_bytes(v, flag) if v else None

    hardware = mem.hardware
    simulated = sim_profile(cfg.run.device)
    if hardware == "auto" and simulated is not None:
        hardware = simulated.name  # plan for the GPU the run simulates
    hw = resolve(
        hardware,
        gpu_memory_bytes=size(mem.gpu_memory, "--gpu-memory"),
        host_memory_bytes=size(mem.host_memory, "--host-memory"),
        disk_budget_bytes=size(mem.disk_budget, "--disk-budget"),
        offload_dir=mem.offload_dir,
    )
    return hw.with_overrides(memory_node=memory_node_for(cfg, node))


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


# --speculative-update as the planner's `speculative`: its choice, always, never
SPECULATIVE_UPDATE: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


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
        speculative=SPECULATIVE_UPDATE[mem.speculative_update],
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
    # the node's size and link are the plan's own inputs (a node that is not there yet)
    run = replace(cfg, distributed=replace(dist, nproc=max(dist.nproc, dist.context_parallel)),
                  memory=replace(cfg.memory, memory_node_memory=None, net_bandwidth=None))
    check_supported(run)
    check_compile(run, precision)


def plan_auto(cfg: Config, model_config: Any, precision: str, *,
              node: NodeHello | None = None) -> Plan:
    """`--offload-policy auto`: the planner's choice, or a PlacementError saying what fits;
    `node`: what the run's memory node reported at its handshake (`hardware_for`)."""
    hw = hardware_for(cfg, node=node)
    p, _, _ = make_plan(cfg, model_config, hw, precision)
    if not p.fits:
        raise PlacementError(
            f"--offload-policy auto: no plan fits on {hw.name}: " + "; ".join(p.problems)
        )
    return p


def predict_for_engine(cfg: Config, model_config: Any, engine: Any, precision: str, *,
                       node: NodeHello | None = None) -> Plan:
    """The planner's prediction for the placement the engine actually runs (`node`: as in
    `plan_auto`): its step is the replay of the engine's own options on a simulated device, as
    `tierlm plan`'s is, where the simulator prices all of it (`evaluate.simulation_gap`)."""
    hw = hardware_for(cfg, node=node)
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
    train = train_shape(cfg, precision)
    p = evaluate(
        shape, train, hw, placements,
        engine.opts.microbatch_order, keep,
        usable_budgets(hw), engine.host_boundaries, readahead=engine.opts.readahead,
        writeback=engine.opts.writeback, offload=offload if any(offload) else (),
    )
    p.speculative = engine.opts.speculative_updates
    p.held_gradients = engine.opts.held_gradients
    if simulation_gap(shape, train, hw) is None:
        p.times_s.update(simulated_times(shape, train, hw, p))
        adopt_simulated(p, train)
    return p
