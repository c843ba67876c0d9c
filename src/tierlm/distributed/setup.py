"""How a run becomes data parallel: joining the world, the context-parallel ring, the FSDP step,
sharding the batches, and keeping the outputs on rank 0. The run's build (tierlm.train.prepare)
calls these once, in its order."""

from __future__ import annotations

from typing import Any

import torch

from tierlm.config import Config, ConfigError, NotSupportedYet
from tierlm.distributed.checks import resolved_mode
from tierlm.distributed.comm import Comm
from tierlm.distributed.context import ContextLayout, Ring, build_ring, check_ring_model
from tierlm.distributed.fsdp import FSDPStep
from tierlm.distributed.world import World


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


def context_ring(cfg: Config, world: World, model: torch.nn.Module,
                 precision: str) -> tuple[ContextLayout, Ring]:
    """Context parallel (`--context-parallel` above 1): this rank's place in the dp x cp grid
    and the ring its CP group's attention runs over, the model checked for ring attention."""
    check_ring_model(model)
    if precision == "fp8":  # --precision auto chose it on this hardware
        raise NotSupportedYet("--context-parallel with --precision fp8",
                              "use --precision bf16 or fp32")
    layout = ContextLayout(world.rank, world.size, cfg.distributed.context_parallel)
    return layout, build_ring(layout)


def fsdp_step(cfg: Config, world: World, model: torch.nn.Module, device: torch.device,
              precision: str, comm: Comm) -> FSDPStep:
    """`--backend fsdp`: FSDP2 owns the whole model; its reduce-scatter is the gradient sync."""
    world.ensure_group()
    return FSDPStep(
        model, cfg.optim, grad_clip=cfg.optim.grad_clip, device=device, world=world,
        comm=comm, precision=precision, cpu_offload=cfg.distributed.fsdp_cpu_offload,
        reduce_dtype=(
            torch.bfloat16 if cfg.distributed.grad_sync_dtype == "bf16" else torch.float32
        ),
    )


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
