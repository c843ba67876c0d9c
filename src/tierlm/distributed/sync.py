"""Gradient sync strategies for data parallelism (ARCHITECTURE.md section 7).

A strategy is chosen by the type of its config (`DenseSync` here, `TopKSync` in topk.py,
`DelayedSync` in delayed.py, each beside the strategy it builds; none in a single process;
strategies.py picks one for a config section) and built once at setup; the runtime then calls it
unconditionally:

- `loss_divisor(local_tokens)`: what the step divides this rank's summed token loss by, asked
  once before the step's forward with this rank's trained targets of the whole step: the rank's
  own count where gradients stay local, the world's count over the world size where they are
  averaged, so the synced gradient is that of the world's mean token loss (tierlm.data.batch).
- `start(segment, grad, slots)`: the engine calls this the moment a segment's gradient for the
  step is complete (all micro-batches in). It starts the exchange (asynchronously, so the rest
  of the backward overlaps it) and returns a `Pending` whose `wait()` leaves the synced gradient
  in `grad`; the engine waits before it takes the gradient norm.
- `after_step(engine, skipped)`: the data-parallel stepper calls this after every step (local
  SGD averages parameters here; top-k clears its residual after a skipped step).
- `local_state()` / `load_local_state(...)`: tensors that differ between ranks (error-feedback
  residuals, counters), gathered into rank 0's checkpoint and handed back on resume.

Every byte on the wire goes through `Comm`, which counts it in the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from tierlm.distributed.comm import Comm, all_reduce_send_bytes
from tierlm.memory.layout import ParamSlot

# the protocol the engine calls and its null object live in runtime/, below: NO_SYNC is
# re-exported for tierlm.distributed's lazy names
from tierlm.runtime.grad_sync import NO_SYNC as NO_SYNC
from tierlm.runtime.grad_sync import NoSync, Pending

# -- configs: the type picks the implementation (dense here, top-k and delayed beside theirs) ----
#
# Each config also says what its strategy puts on the wire, for the planner: `send_bytes(
# segments, world, slot_numels)`, the bytes one rank sends per step on average (the same
# per-collective counts `Comm` records), where `segments` lists each segment's parameters as
# (name, numel) in the engine's order and `slot_numels` the entries of every optimizer state
# slot of every segment; `overlaps_backward` says whether they move while the backward runs
# (started per segment as its gradient completes) or after the step.

Segments = Sequence[Sequence[tuple[str, int]]]


def segment_numel(segment: Sequence[tuple[str, int]]) -> int:
    """The parameters' entries of one segment of `Segments`."""
    return sum(n for _, n in segment)


@dataclass(frozen=True, kw_only=True)
class DenseSync:
    """All-reduce every segment's gradient and average it over ranks."""

    dtype: Literal["fp32", "bf16"] = "fp32"
    overlaps_backward: ClassVar[bool] = True

    def build(self, comm: Comm) -> DenseAllReduce:
        return DenseAllReduce(comm, torch.bfloat16 if self.dtype == "bf16" else torch.float32)

    def summary(self) -> str:
        return f"dense {self.dtype}"

    def send_bytes(self, segments: Segments, world: int, slot_numels: Sequence[int] = ()) -> float:
        """Every segment's gradient, one all-reduce each, in the wire dtype."""
        element = 2 if self.dtype == "bf16" else 4
        return sum(all_reduce_send_bytes(element * segment_numel(seg), world) for seg in segments)


# -- dense ----

class DenseAllReduce(NoSync):
    def __init__(self, comm: Comm, wire_dtype: torch.dtype) -> None:
        self.comm = comm
        self.wire_dtype = wire_dtype

    def loss_divisor(self, local_tokens: int) -> float:
        return self.comm.token_divisor(local_tokens)  # the sum below is divided by the size

    def start(self, segment: str, grad: torch.Tensor, slots: list[ParamSlot]) -> Pending:
        w = self.comm.size
        if self.wire_dtype == grad.dtype:
            work = self.comm.all_reduce_sum(grad, async_op=True)
            return Pending([work], lambda: grad.div_(w))
        wire = grad.to(self.wire_dtype)  # bf16 on the wire: half the bytes, summed in bf16
        work = self.comm.all_reduce_sum(wire, async_op=True)
        return Pending([work], lambda: grad.copy_(wire).div_(w))
