"""The stepper protocol: what the trainer, the monitor and checkpoints may ask of the object that
runs one optimizer step (the reference step, the tiered engine, data parallel over engines,
FSDP). Every stepper subclasses `Stepper` and answers every call itself: nothing is forwarded
by `__getattr__`, and nobody asks `isinstance(stepper, Engine)`.

Capabilities that only some steppers have are declared here as attributes that are None where
absent, so a caller decides once, at setup, with `stepper.ledger is not None`:

- `engine`: the tiered engine that runs the step (the engine itself; the one a data-parallel
  stepper drives). Its placement is what the planner's prediction is checked against; its
  states, schedule and offload directory feed the streaming probe, the disk probe and the step
  trace.
- `ledger`: the byte ledger of the managed memory (tiers, links).
- `cache`: the stream cache of device-resident segments (its fetch counts, the thrashing alert).
- `fp8_stats`: {layer: (underflow fraction, overflow fraction)} of the last step, set by the
  fp8 watch (`tierlm.precision.watch.Fp8Watch.attach`) when the run has fp8 layers.
- `save_sharded`: writes this rank's shards into a checkpoint directory
  (`torch.distributed.checkpoint`, FSDP): every rank saves. None: rank 0 writes the checkpoint
  from `state_shards()`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tierlm.memory.ledger import Ledger
    from tierlm.runtime.cache import StreamCache
    from tierlm.runtime.state import DiskTensor

# (name, weights, optimizer state): tensors, or for disk-tier state `DiskTensor`s that read their
# slice when opened (tierlm.runtime.state.opened / as_tensor), so a segment is never staged whole
Shard = tuple[str, Mapping[str, "torch.Tensor | DiskTensor"],
              Mapping[str, "torch.Tensor | DiskTensor"]]


class Stepper(ABC):
    skipped_steps: int  # steps skipped for a non-finite gradient (checkpointed)

    # optional capabilities: None where this stepper has none (see the module docstring)
    # the tiered engine (tierlm.runtime.engine.Engine, a Stepper itself): named by its base
    # here, since the base cannot import the class built on it
    engine: Stepper | None = None
    ledger: Ledger | None = None
    cache: StreamCache | None = None
    fp8_stats: Callable[[], dict[str, tuple[float, float]]] | None = None
    save_sharded: Callable[[Path], None] | None = None

    @abstractmethod
    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        """One optimizer step over the micro-batches `batches` (each (B, T+1) token ids):
        {"loss", "grad_norm", "skipped", "compute_s", ...}. "loss" is the step's mean over its
        trained tokens: every micro-batch's (and every rank's) summed token loss over their
        count, the normalisation its gradient used too (tierlm.data.batch)."""

    @abstractmethod
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of `batch`, no update."""

    @abstractmethod
    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(V,) fp32 logits after the last token of `ids` (1, T)."""

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by parameter name (CPU copies)."""

    @abstractmethod
    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state by `<parameter name>.<slot>` (CPU copies)."""

    @abstractmethod
    def state_shards(self) -> Iterator[Shard]:
        """(shard name, weights, optimizer state), one shard at a time, for checkpoints."""

    @abstractmethod
    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
        """Restore what `state_shards` (or `weights`/`optimizer_state`) gave."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for work still running in the background (updates behind the next forward)."""

    @abstractmethod
    def close(self) -> None:
        """Release threads, files and memory."""
