"""Which tokens of each row this rank trains on: the protocol the engine's step calls, and the
whole-sequence default. Context parallelism's zig-zag share, which implements it with a ring its
attention runs over, lives above, in tierlm.distributed.context."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class SequenceShare(Protocol):
    ring: Any
    """What the attention runs over (tierlm.distributed.context.Ring), given to the model's
    context; None: every rank holds whole rows."""

    def take(self, ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's (ids, targets, positions) of a micro-batch's (B, T) rows."""
        ...


class WholeSequence:
    """No context parallelism: every token of every row (the engine's default)."""

    ring: Any = None

    def take(self, ids, targets, positions):
        return ids, targets, positions


WHOLE_SEQUENCE = WholeSequence()
