"""Who we are in a multi-process run: rank, world size and the process group.

`torchrun` (or `tierlm train --nproc N`, which re-executes itself under torchrun) sets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous address in the environment; `World.from_env` joins
that group (`_backend`: gloo for CPU tensors, NCCL for CUDA tensors).
Without those variables the run is a single process: `World.single()`, whose every collective
is a no-op, so callers never ask how many processes there are.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from tierlm.config import ConfigError

T = TypeVar("T")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes logs, metrics, checkpoints and exports."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @staticmethod
    def single() -> World:
        return World()

    @staticmethod
    def from_env(timeout_s: float = 1800.0) -> World:
        """Join the process group torchrun described in the environment (a single-process
        world when it described none). Idempotent: a second call returns the same world."""
        if "WORLD_SIZE" not in os.environ:
            return World.single()
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE is set but {', '.join(missing)} is not: launch with torchrun "
                "(or `tierlm train --nproc N`), which sets them all"
            )
        world = World(
            rank=int(os.environ["RANK"]),
            size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ["LOCAL_RANK"]),
        )
        if world.size > 1 and not dist.is_initialized():
            if torch.cuda.is_available():  # one GPU per process: "cuda" is this rank's GPU
                torch.cuda.set_device(world.local_rank)
            dist.init_process_group(_backend(), timeout=dt.timedelta(seconds=timeout_s))
        return world

    # -- coordination ----

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def main_first(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0, then on the other ranks: for work with side effects on shared
        files (tokenizer cache, crash recovery of checkpoints), which the others then reuse."""
        if self.is_main:
            out = fn()
            self.barrier()
            return out
        self.barrier()
        return fn()

    def from_main(self, obj: T) -> T:
        """Rank 0's value of `obj` on every rank (e.g. a run directory named by the clock)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_to_main(self, obj: T) -> list[T] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere): e.g. the checksums of
        the checkpoint files each rank wrote."""
        if not self.distributed:
            return [obj]
        out: list[T] | None = [obj] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_agree(self, ok: bool) -> bool:
        """True on every rank when `ok` holds on every rank: a verdict drawn from rank-local
        state (an FSDP shard) that decides a collective step (a checkpoint every rank writes)."""
        verdicts = self.gather_to_main(bool(ok))
        return self.from_main(all(verdicts) if verdicts is not None else False)

    def ensure_group(self) -> None:
        """A process group even for one process (FSDP2 shards over one): a one-rank group
        over an in-memory store."""
        if not dist.is_initialized():
            dist.init_process_group(_backend(), store=dist.HashStore(), rank=0, world_size=1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _backend() -> str:
    """gloo for CPU tensors; NCCL for CUDA tensors where CUDA exists (one default group serves
    both: gradients of host-tier segments stay in RAM even on a GPU run)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    """The command that runs `tierlm <argv>` as `nproc` processes on this machine. `--nproc`
    is passed on under its long name: torchrun's parser would read it as an abbreviation of
    its own `--nproc-per-node`."""
    ours = [
        "--distributed.nproc" + a[len("--nproc"):] if a == "--nproc" or a.startswith("--nproc=")
        else a
        for a in argv
    ]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "tierlm", *ours,
    ]


def launch_if_asked(nproc: int, argv: list[str]) -> None:
    """`tierlm train --nproc N` outside torchrun: become torchrun running N copies of the same
    command (this call then never returns). Under torchrun, or with one process, nothing."""
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        relaunch_under_torchrun(nproc, argv)


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> None:
    """Replace this process with torchrun running `nproc` copies of the same command. The copies
    see torchrun's environment (WORLD_SIZE) and so do not relaunch themselves."""
    sys.stdout.flush()
    sys.stderr.flush()
    cmd = torchrun_argv(nproc, argv)
    os.execv(cmd[0], cmd)
