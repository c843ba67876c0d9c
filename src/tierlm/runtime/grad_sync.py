"""The gradient-sync protocol the engine calls (ARCHITECTURE.md section 7), and its null object.

The engine starts a segment's sync the moment its gradient for the step is complete and waits
for it before the norm is taken; it asks nothing else of data parallelism. So the protocol lives
here, beside the engine that calls it, and the strategies that implement it (dense all-reduce,
top-k, delayed) live above, in tierlm.distributed.sync, which builds one from its typed config.

- `check_optimizer(optimizer)`: refuse, at setup, an optimizer whose state the strategy cannot
  handle.
- `loss_divisor(local_tokens)`: what the step divides this rank's summed token loss by (see
  tierlm.distributed.sync for the two answers).
- `start(segment, grad, slots)`: start the exchange and return a `Pending` whose `wait()` leaves
  the synced gradient in `grad`.

`NoSync` is one process's strategy (nothing to exchange), the engine's default, and the base the
strategies extend (the data-parallel stepper's `after_step` and per-rank state are no-ops here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from tierlm.data.batch import local_divisor
from tierlm.memory.layout import ParamSlot


class Pending:
    """An exchange in flight: `wait()` blocks until the bytes are in and the gradient is final."""

    def __init__(self, works: list[Any] = (), then: Callable[[], None] | None = None) -> None:
        self._works = list(works)
        self._then = then

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        if self._then is not None:
            self._then()


DONE = Pending()


class GradSync(Protocol):
    def check_optimizer(self, optimizer: Any) -> None: ...

    def loss_divisor(self, local_tokens: int) -> float: ...

    def start(self, segment: str, grad: torch.Tensor, slots: list[ParamSlot]) -> Pending: ...


class NoSync:
    """A single process, or a strategy that never touches gradients: nothing to exchange."""

    engine_state_per_rank = False

    def loss_divisor(self, local_tokens: int) -> float:
        """Gradients stay this rank's (one process; delayed sync's local steps): its own mean."""
        return local_divisor(local_tokens)

    def start(self, segment: str, grad: torch.Tensor, slots: list[ParamSlot]) -> Pending:
        return DONE

    def after_step(self, engine: Any, skipped: bool) -> None:
        pass

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse, before anything is allocated, an optimizer (tierlm.optim.flat) whose state
        this strategy cannot handle."""

    def local_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        pass


NO_SYNC = NoSync()
