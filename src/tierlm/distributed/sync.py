"""Gradient sync strategies for data parallelism (ARCHITECTURE.md section 7).

A strategy is chosen by the type of its config (`DenseSync`, `TopKSync`, `DelayedSync`; none in
a single process) and built once at setup; the runtime then calls it unconditionally:

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

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from tierlm.config import DistributedConfig
from tierlm.distributed.checks import parse_ratio_overrides, resolved_mode
from tierlm.distributed.comm import Comm, all_gather_send_bytes, all_reduce_send_bytes
from tierlm.memory.layout import ParamSlot

# the protocol the engine calls and its null object live in runtime/, below: NO_SYNC is
# re-exported for tierlm.distributed's lazy names
from tierlm.runtime.grad_sync import NO_SYNC as NO_SYNC
from tierlm.runtime.grad_sync import NoSync, Pending

# Parameters kept dense under top-k by default (the config's default): embeddings (a batch
# touches few rows, and error feedback would hold stale rows for long), the output head and
# the norms (tiny, and the loss is most sensitive to them).
DEFAULT_RATIO_OVERRIDES = DistributedConfig().sparse_grad_ratio_overrides


# -- configs: the type picks the implementation ----
#
# Each config also says what its strategy puts on the wire, for the planner: `send_bytes(
# segments, world, slot_numels)`, the bytes one rank sends per step on average (the same
# per-collective counts `Comm` records), where `segments` lists each segment's parameters as
# (name, numel) in the engine's order and `slot_numels` the entries of every optimizer state
# slot of every segment; `overlaps_backward` says whether they move while the backward runs
# (started per segment as its gradient completes) or after the step.

Segments = Sequence[Sequence[tuple[str, int]]]


def _numel(segment: Sequence[tuple[str, int]]) -> int:
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
        return sum(all_reduce_send_bytes(element * _numel(seg), world) for seg in segments)


@dataclass(frozen=True, kw_only=True)
class TopKSync:
    """Send the largest-magnitude `ratio` of each parameter's gradient (values + indices);
    `overrides` are (regex, ratio) pairs matched against parameter names, first match wins,
    ratio 1.0 meaning dense; the rest stays in a local residual added to the next step's
    gradient (error feedback) unless `error_feedback` is off; with `feedback="ef21"` each rank
    sends the top-k of the change in its gradient instead and every rank steps with the
    average of the ranks' running estimates (see tierlm.distributed.topk). Over the first
    `warmup_steps` the ratio falls geometrically from 1.0 (dense) to its target."""

    ratio: float
    overrides: tuple[tuple[str, float], ...] = field(
        default_factory=lambda: parse_ratio_overrides(DEFAULT_RATIO_OVERRIDES)
    )
    error_feedback: bool = True
    feedback: Literal["residual", "ef21"] = "residual"
    warmup_steps: int = 0
    overlaps_backward: ClassVar[bool] = True

    def build(self, comm: Comm):
        from tierlm.distributed.topk import TopK

        return TopK(comm, self)

    def summary(self) -> str:
        return f"top-k {self.ratio:g}" + (" with dense overrides" if self.overrides else "")

    def ratio_for(self, name: str) -> float:
        """The ratio parameter `name` is sent at after the warm-up: the first override whose
        pattern it contains, else `ratio`."""
        return next((r for p, r in self.overrides if re.search(p, name)), self.ratio)

    def send_bytes(self, segments: Segments, world: int, slot_numels: Sequence[int] = ()) -> float:
        """After the warm-up, per segment: the parameters sent whole, all-reduced as one fp32
        buffer; the k entries of each other one, all-gathered as fp32 values and int32 indices
        (int64 in a segment of 2**31 entries or more). ef21 sends as many."""
        from tierlm.distributed.topk import entries_sent

        total = 0
        for seg in segments:
            dense = sparse = 0
            for name, numel in seg:
                k = entries_sent(self.ratio_for(name), numel)
                dense, sparse = (dense + numel, sparse) if k >= numel else (dense, sparse + k)
            index_bytes = 4 if _numel(seg) < 2**31 else 8
            if dense:
                total += all_reduce_send_bytes(4 * dense, world)
            if sparse:
                total += all_gather_send_bytes(index_bytes * sparse, world) + \
                    all_gather_send_bytes(4 * sparse, world)
        return total


@dataclass(frozen=True, kw_only=True)
class DelayedSync:
    """Local SGD: no gradient exchange; every `every` steps (and at `final_step`) the ranks'
    weights are averaged, and with `moments="average"` both AdamW moments too, in bf16 on the
    wire; "local" keeps them per rank (see tierlm.distributed.delayed)."""

    every: int
    final_step: int | None = None
    moments: Literal["local", "average"] = "local"
    overlaps_backward: ClassVar[bool] = False  # the averaging waits for the step's updates

    def build(self, comm: Comm):
        from tierlm.distributed.delayed import Delayed

        return Delayed(comm, self)

    def summary(self) -> str:
        return f"delayed, every {self.every} steps" + (
            ", moments averaged" if self.moments == "average" else "")

    def send_bytes(self, segments: Segments, world: int, slot_numels: Sequence[int] = ()) -> float:
        """Once every `every` steps: each segment's fp32 master all-reduced, and with
        moments="average" each optimizer state slot in bf16 (the extra average at
        `final_step` left out of the mean)."""
        sync = sum(all_reduce_send_bytes(4 * _numel(seg), world) for seg in segments)
        if self.moments == "average":
            sync += sum(all_reduce_send_bytes(2 * n, world) for n in slot_numels)
        return sync / self.every


SyncConfig = DenseSync | TopKSync | DelayedSync


def sync_config(dist_cfg: Any, max_steps: int) -> SyncConfig:
    """The typed strategy config for the `distributed` section (already validated)."""
    mode = resolved_mode(dist_cfg)
    if mode == "topk":
        return TopKSync(
            ratio=dist_cfg.sparse_grad_ratio,
            overrides=parse_ratio_overrides(dist_cfg.sparse_grad_ratio_overrides),
            error_feedback=dist_cfg.error_feedback,
            feedback=dist_cfg.topk_feedback,
            warmup_steps=dist_cfg.sparse_warmup_steps,
        )
    if mode == "delayed":
        return DelayedSync(every=dist_cfg.sync_every, final_step=max_steps,
                           moments=dist_cfg.sync_moments)
    return DenseSync(dtype=dist_cfg.grad_sync_dtype)


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
