"""The planner's byte model of offloaded activations (tierlm.plan.offload chooses them): the
host buffers one micro-batch of an offloaded block takes, and the device workspace offloading
adds in the backward."""

from __future__ import annotations

from tierlm.runtime.schedule import micro_batches_in_flight
from tierlm.runtime.shapes import ModelShape, TrainShape, block_saved_storage_bytes


def offload_sizes(shape: ModelShape, train: TrainShape, offload: tuple[bool, ...]
                  ) -> tuple[tuple[int, ...], ...]:
    """Per segment but the head, the host buffers (bytes, in order) the `offload` policy takes
    for one micro-batch by the planner's byte model: a block's saved storages, as one block
    run on fake tensors saves them (tierlm.runtime.shapes.block_saved_storage_bytes; without
    the model's config, its saved bytes as one buffer); () where a segment does not offload
    (the embedding saves only its token ids: nothing)."""
    if not any(offload):
        return ()
    last = len(shape.names) - 1
    if shape.model_config is not None:  # each storage, as the engine's probe measures them
        block = block_saved_storage_bytes(shape.model_config, train.precision,
                                          train.batch_size, train.seq_len)
    else:
        block = (int(shape.saved_bytes_per_token(train.precision) * train.batch_size
                     * train.seq_len),)
    return tuple(block if offload[s] and 0 < s < last else () for s in range(last))


def offload_workspace_bytes(shape: ModelShape, train: TrainShape, offload: tuple[bool, ...],
                            order: str) -> int:
    """Device bytes offloaded segments add to the activation workspace (beyond the recompute
    workspace `activation_workspace_bytes` already counts for them: one block's saved tensors
    during its backward): the backward of an offloaded segment holds its saved tensors for
    every micro-batch of its action, and the next offloaded segment's come back meanwhile."""
    if not any(offload[1:len(shape.names) - 1]):
        return 0
    block = int(shape.saved_bytes_per_token(train.precision) * train.batch_size * train.seq_len)
    in_flight = micro_batches_in_flight(train.micro_batches, order)
    return (2 * in_flight - 1) * block
