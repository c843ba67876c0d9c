"""How a run becomes data parallel: joining the world, sharding the batches, building the
stepper, and keeping the outputs on rank 0. The trainer calls these once at setup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierlm.config import Config, ConfigError
from tierlm.distributed.checks import resolved_mode
from tierlm.distributed.comm import Comm
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.strategies import sync_config
from tierlm.distributed.world import World
from tierlm.memory.ledger import Ledger


def join_world(cfg: Config) -> World:
    """The world torchrun described (or a single process), checked against the config."""
    world = World.from_env(cfg.distributed.timeout_s)
    d = cfg.distributed
    if world.distributed and d.nproc not in (1, world.size):
        raise ConfigError(
            f"--nproc {d.nproc}, but torchrun started {world.size} processes; drop --nproc "
            "under torchrun, or make the two agree"
        )
    if world.size % d.context_parallel:
        raise ConfigError(
            f"{world.size} processes is not a multiple of --context-parallel "
            f"{d.context_parallel}: launch dp x {d.context_parallel} processes (--nproc)"
        )
    mode = resolved_mode(d)
    if not world.distributed and mode in ("topk", "delayed"):
        flag = "--sparse-grad-ratio" if mode == "topk" else "--sync-every"
        raise ConfigError(
            f"{flag} (--grad-sync {mode}) syncs several processes, this run has one: add "
            "--nproc N (or launch with torchrun --nproc-per-node N)"
        )
    return world


def build_parallel_stepper(
    cfg: Config,
    world: World,
    model: torch.nn.Module,
    device: torch.device,
    precision: str,
    build_single: Callable[..., Any],
) -> Any:
    """The stepper for this world; `build_single(grad_sync=None)` is the trainer's builder of
    the single-process stepper (reference or tiered engine).

    The order, written once: FSDP2 owns the whole model when asked for (its reduce-scatter is
    the gradient sync, dense); otherwise one process gets the single-process stepper; several
    processes each get the tiered engine (with `--offload-policy none` it keeps everything on
    the device and reproduces the reference trainer exactly), with the sync strategy as the
    engine's per-segment gradient hook, wrapped for what spans ranks. Context parallel
    (checked at config validation: dense sync, not under FSDP) gives every rank a zig-zag share
    of each row and routes attention through the ring: with the tiered runtime the engine takes
    its share and scales its loss to it (the data-parallel dense mean then sums the CP group),
    else the reference step runs under `ContextParallelStep`."""
    share = None
    if cfg.distributed.context_parallel > 1:
        from tierlm.config import uses_tiered_runtime
        from tierlm.distributed.context import (
            ContextLayout,
            ZigzagShare,
            build_ring,
            check_ring_model,
            use_ring_attention,
        )

        check_ring_model(model)
        if precision == "fp8":  # --precision auto chose it on this hardware
            from tierlm.config import NotSupportedYet

            raise NotSupportedYet("--context-parallel with --precision fp8",
                                  "use --precision bf16 or fp32")
        layout = ContextLayout(world.rank, world.size, cfg.distributed.context_parallel)
        ring = build_ring(layout)
        if not uses_tiered_runtime(cfg):
            from tierlm.distributed.context_step import ContextParallelStep

            return ContextParallelStep(build_single(), layout, ring)
        use_ring_attention(model)
        share = ZigzagShare(layout, ring)
    comm = Comm(world.size, Ledger())
    if cfg.distributed.backend == "fsdp":
        from tierlm.distributed.fsdp import FSDPStep

        world.ensure_group()

        return FSDPStep(
            model, cfg.optim, grad_clip=cfg.optim.grad_clip, device=device, world=world,
            comm=comm, precision=precision, cpu_offload=cfg.distributed.fsdp_cpu_offload,
            reduce_dtype=(
                torch.bfloat16 if cfg.distributed.grad_sync_dtype == "bf16" else torch.float32
            ),
        )
    if not world.distributed:
        return build_single()
    strategy = sync_config(cfg.distributed, cfg.train.max_steps).build(comm)
    engine = build_single(grad_sync=strategy, sequence_share=share)
    comm.ledger = engine.ledger  # network bytes land in the engine's ledger, with the rest
    if share is not None:
        share.ring.ledger = engine.ledger
    return DataParallelStep(engine, strategy, world, comm)


class RankSlice:
    """Rank r's rows of each global batch: with W ranks of micro-batch b, the sampler draws
    batches of W*b rows and rank r takes rows [r*b, (r+1)*b), so W ranks see exactly the rows
    one process with micro-batch W*b would. Position and resume are the global sampler's.
    Under context parallel the W / cp row groups split the rows (rank r's group is r // cp)
    and the ranks of a group share theirs."""

    def __init__(self, sampler: Any, world: World, cp: int = 1) -> None:
        self.sampler = sampler
        self.world = world
        self.groups, self.group = world.size // cp, world.rank // cp

    def next_batch(self) -> torch.Tensor:
        return self.sampler.next_batch().tensor_split(self.groups)[self.group]

    def __getattr__(self, name: str):  # state_dict, load_state_dict, epoch, ...
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


def shard_batches(sampler: Any, world: World, cp: int = 1) -> Any:
    return RankSlice(sampler, world, cp) if world.size > cp else sampler


class NullMetrics:
    """metrics.jsonl on ranks other than 0: they write nothing."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class NullMonitor:
    """The monitor on ranks other than 0: no live view, no files, no alerts."""

    last_eval: dict[str, Any] | None = None

    def start(self, total_steps: int, start_step: int, stream: Any = None) -> NullMonitor:
        return self

    def log(self, message: str) -> None:
        pass

    def step(self, rec: dict[str, Any]) -> dict[str, Any]:
        return rec

    def eval(self, rec: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def quiet(message: str) -> None:
    """The log of ranks other than 0."""


def drain(shards) -> None:
    """Ranks other than 0 take part in a checkpoint's gathers without writing anything."""
    for _ in shards:
        pass
