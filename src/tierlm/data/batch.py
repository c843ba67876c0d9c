"""What a batch holds, read the same way by every stepper.

A batch is (B, T+1) token ids: inputs are [:, :-1], targets [:, 1:], every target trained. Data
with a loss mask (fine-tuning examples) gives (B, 2, T+1): the ids, and beside them their labels,
the same ids with IGNORE_INDEX where the loss does not look; the targets are the labels [:, 1:].
IGNORE_INDEX is F.cross_entropy's default, so the losses skip those positions as they are, and a
mean runs over trained targets only. Packing by documents adds a third row, (B, 3, T+1): each
token's position within its example; a position that does not follow its predecessor by one
starts a new example, and transformers' mask builders turn those resets into a block-diagonal
causal mask, so no example attends to another.

The loss of an optimizer step is the mean over every trained target of the step: the summed
token losses of all its micro-batches (and, data parallel, all ranks) over their count, so that
a micro-batch weighs what its trained tokens weigh (with loss masks, micro-batches differ in
count; a mean of micro-batch means would count a short answer's tokens more than a long one's).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def inputs_and_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) inputs and (B, T) targets of a batch (see the module docstring)."""
    if batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    return batch[:, 0, :-1], batch[:, 1, 1:]


def position_ids(batch: torch.Tensor) -> torch.Tensor | None:
    """(B, T) positions of the inputs, or None: 0, 1, ... for every row."""
    if batch.dim() == 2 or batch.shape[1] < 3:
        return None
    return batch[:, 2, :-1]


def trained_targets(batch: torch.Tensor) -> int:
    """Targets the loss covers: the token count a mean loss of the batch divides by."""
    if batch.dim() == 2:
        return batch[:, 1:].numel()
    return int((batch[:, 1, 1:] != IGNORE_INDEX).sum())


def local_divisor(trained: int) -> float:
    """The divisor of one process's summed step loss: its trained targets (at least 1, so a step
    without any gives loss 0, not NaN). Data parallel syncs divide by the world's instead
    (tierlm.distributed.comm.Comm.token_divisor)."""
    return float(max(trained, 1))
