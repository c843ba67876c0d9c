"""Data parallelism on the tiered runtime: one engine per rank, a gradient sync between them.

Each rank runs `Engine.step` on its own slice of the global batch. The engine hands every
segment's finished gradient to the sync strategy while the backward goes on (the engine hook
`EngineOptions.grad_sync`), so dense and top-k ranks step with identical gradients and stay
bitwise identical; delayed sync averages weights after the step instead.

This wrapper is a `Stepper` (tierlm.runtime.stepper) like the engine, and forwards each of its
calls explicitly: the engine's ledger, stream cache and placement are its capabilities
(`engine` is the wrapped engine, so the planner's prediction is checked in data-parallel runs
too). It adds what spans ranks: the logged loss is every rank's summed token loss over every
rank's trained tokens (as the synced gradient is: the sync's `loss_divisor`), evaluation
splits each batch's rows over the ranks, and checkpoints gather the state that differs between
ranks (error-feedback residuals; under delayed sync every rank's weights and moments) into
rank 0's checkpoint under `dp.rank<r>.` keys in the optimizer files.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from tierlm.config import ConfigError
from tierlm.data.batch import trained_targets
from tierlm.distributed.comm import Comm
from tierlm.distributed.world import World
from tierlm.memory.ledger import Ledger
from tierlm.runtime.cache import StreamCache
from tierlm.runtime.engine import Engine
from tierlm.runtime.state import as_tensor
from tierlm.runtime.stepper import Stepper

_PREFIX = "dp"


class Prefixed(Mapping[str, torch.Tensor]):
    """The entries of `base` under `prefix`, with the prefix removed (read lazily)."""

    def __init__(self, base: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.base, self.prefix = base, prefix
        self._keys = [k[len(prefix):] for k in base if k.startswith(prefix)]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.base[self.prefix + key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class DataParallelStep(Stepper):
    def __init__(self, engine: Engine, strategy, world: World, comm: Comm) -> None:
        self.engine = engine
        self.strategy = strategy
        self.world = world
        self.comm = comm

    @property
    def ledger(self) -> Ledger:  # network bytes land in it too (tierlm.train.prepare.build_stepper)
        return self.engine.ledger

    @property
    def cache(self) -> StreamCache:
        return self.engine.cache

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.engine.skipped_steps = value

    # -- the step ----

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        out = self.engine.step(batches, lr)
        self.strategy.after_step(self.engine, out["skipped"])
        return self.comm.step_loss(out)

    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of `batch`, its rows split over the ranks."""
        w = self.world.size
        if batch.shape[0] < w:  # too few rows to split: every rank evaluates them all
            (loss,) = self.comm.mean_of([self.engine.eval_loss(batch)])
            return loss
        mine = batch.tensor_split(w)[self.world.rank]
        tokens = trained_targets(mine)
        nll, total = self.comm.mean_of([self.engine.eval_loss(mine) * tokens, tokens])
        return nll / total

    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's forward: every rank holds the same weights (delayed sync: its own)."""
        return self.engine.next_token_logits(ids)

    def synchronize(self) -> None:
        self.engine.synchronize()

    # -- checkpoints ----

    def weights(self) -> dict[str, torch.Tensor]:
        """This rank's weights."""
        return self.engine.weights()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state."""
        return self.engine.optimizer_state()

    def state_shards(self) -> Iterator[tuple[str, dict, dict]]:
        """Rank 0's engine state, segment by segment, then what differs between ranks. Every
        rank iterates this (the gathers are collective); only rank 0 yields anything."""
        per_rank = self.strategy.engine_state_per_rank
        for name, weights, optim in self.engine.state_shards():
            if self.world.is_main:
                yield name, weights, optim
            if per_rank:  # every rank's weights and moments, one segment of one rank at a time
                mine = {f"weight.{k}": as_tensor(v) for k, v in weights.items()}
                mine.update({k: as_tensor(v) for k, v in optim.items()})
                for r in range(1, self.world.size):
                    got = self._gather_from(r, mine)
                    if self.world.is_main:
                        yield f"{name}.{_PREFIX}{r}", {}, self._keyed(r, got)
        local = self.strategy.local_state()
        for r in range(self.world.size):
            got = local if r == 0 else self._gather_from(r, local)
            if self.world.is_main:
                extra = self._keyed(r, got)
                if r == 0:
                    extra[f"{_PREFIX}.world_size"] = torch.tensor(self.world.size)
                yield f"{_PREFIX}{r}", {}, extra

    def _keyed(self, r: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"{_PREFIX}.rank{r}.{k}": v for k, v in tensors.items()}

    def _gather_from(self, r: int, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank r's tensors of the same names and shapes as `template` (this rank's), on rank 0;
        an empty dict elsewhere. Point to point, one tensor at a time: rank 0 holds one rank's
        copy of one segment at once."""
        out = {}
        for key, t in template.items():
            if self.world.rank == r:
                self.comm.send(t.contiguous(), 0)
            elif self.world.is_main:
                buf = torch.empty_like(t, memory_format=torch.contiguous_format)
                self.comm.recv(buf, r)
                out[key] = buf
        return out

    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
        saved_world = f"{_PREFIX}.world_size"
        if saved_world in optim and int(optim[saved_world]) != self.world.size:
            raise ConfigError(
                f"the checkpoint was written by {int(optim[saved_world])} processes, this run "
                f"has {self.world.size}: resume with --nproc {int(optim[saved_world])} (rank-local "
                "state such as error-feedback residuals belongs to its rank)"
            )
        mine = Prefixed(optim, f"{_PREFIX}.rank{self.world.rank}.")
        if self.strategy.engine_state_per_rank and self.world.rank > 0 and len(mine):
            weights = Prefixed(mine, "weight.")
            optim = mine
        # A checkpoint without rank entries (from one process) starts every rank from its state.
        self.engine.load(weights, optim)
        self.strategy.load_local_state(mine)

    def close(self) -> None:
        self.engine.close()
