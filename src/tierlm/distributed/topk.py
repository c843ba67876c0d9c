"""Top-k gradient sparsification with error feedback.

For each parameter of a segment whose ratio r < 1, a rank sends the k = round(r * numel)
entries of largest magnitude of (gradient + residual) as values (fp32) and flat indices (int32);
the ranks all-gather them and each sums everything it received with `index_add_` (entries two
ranks both sent add up), then divides by the world size. Parameters at ratio 1.0 (the sensitive
ones by default) are packed into one buffer and all-reduced densely. What a rank did not send
stays in its residual and joins the next step's gradient (error feedback), so no gradient is
lost, only delayed.

With `feedback="ef21"` (Richtarik et al., "EF21", 2021) a rank keeps instead an estimate of its
own gradient and sends the top-k of the change (gradient - estimate); sender and receivers move
the estimates by exactly what was sent, so every rank also holds the mean of all the ranks'
estimates ("shared"), and that dense mean is the gradient the optimizer sees. Residual
feedback holds a small entry back for many steps and then delivers it at once, which AdamW
turns into one large step; ef21's entries change a little every time they are sent and keep
their last value in between. The start-up costs nothing extra with `warmup_steps` (a dense
first step fills the estimates exactly).

k depends only on the parameter's size and the step, so every rank contributes equally sized
buffers and a plain all-gather suffices. Non-finite entries are ranked first, so a bad gradient
always reaches every rank, the step is skipped everywhere, and `after_step` then clears the
buffers that hold it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from tierlm.config import DistributedConfig
from tierlm.distributed.checks import parse_ratio_overrides
from tierlm.distributed.comm import Comm, all_gather_send_bytes, all_reduce_send_bytes
from tierlm.distributed.sync import NoSync, Pending, Segments, segment_numel
from tierlm.memory.layout import ParamSlot

# Parameters kept dense under top-k by default (the config's default): embeddings (a batch
# touches few rows, and error feedback would hold stale rows for long), the output head and
# the norms (tiny, and the loss is most sensitive to them).
DEFAULT_RATIO_OVERRIDES = DistributedConfig().sparse_grad_ratio_overrides


def entries_sent(ratio: float, numel: int) -> int:
    """k, the entries of a `numel`-entry parameter sent at `ratio`: at least one; k >= numel
    means the parameter goes dense."""
    return max(1, round(ratio * numel))


@dataclass(frozen=True, kw_only=True)
class TopKSync:
    """Send the largest-magnitude `ratio` of each parameter's gradient (values + indices);
    `overrides` are (regex, ratio) pairs matched against parameter names, first match wins,
    ratio 1.0 meaning dense; the rest stays in a local residual added to the next step's
    gradient (error feedback) unless `error_feedback` is off; with `feedback="ef21"` each rank
    sends the top-k of the change in its gradient instead and every rank steps with the
    average of the ranks' running estimates (see the module docstring). Over the first
    `warmup_steps` the ratio falls geometrically from 1.0 (dense) to its target."""

    ratio: float
    overrides: tuple[tuple[str, float], ...] = field(
        default_factory=lambda: parse_ratio_overrides(DEFAULT_RATIO_OVERRIDES)
    )
    error_feedback: bool = True
    feedback: Literal["residual", "ef21"] = "residual"
    warmup_steps: int = 0
    overlaps_backward: ClassVar[bool] = True

    def build(self, comm: Comm) -> TopK:
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
        total = 0
        for seg in segments:
            dense = sparse = 0
            for name, numel in seg:
                k = entries_sent(self.ratio_for(name), numel)
                dense, sparse = (dense + numel, sparse) if k >= numel else (dense, sparse + k)
            index_bytes = 4 if segment_numel(seg) < 2**31 else 8
            if dense:
                total += all_reduce_send_bytes(4 * dense, world)
            if sparse:
                total += all_gather_send_bytes(index_bytes * sparse, world) + \
                    all_gather_send_bytes(4 * sparse, world)
        return total


@dataclass(frozen=True)
class _Plan:
    dense: list[tuple[int, int]]  # (offset, numel) ranges all-reduced as they are
    sparse: list[tuple[int, int, int]]  # (offset, numel, k)

    @property
    def k_total(self) -> int:
        return sum(k for _, _, k in self.sparse)


class TopK(NoSync):
    def __init__(self, comm: Comm, cfg: TopKSync) -> None:
        self.comm = comm
        self.cfg = cfg
        self.steps = 0  # completed steps (the warm-up position)
        # kind -> segment -> flat buffer: "residual" (what was not sent), or for ef21
        # "estimate" (this rank's running gradient estimate) and "shared" (their mean)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.slots: dict[str, list[ParamSlot]] = {}
        self._loaded: dict[str, torch.Tensor] = {}  # "<kind>.<parameter>" from a checkpoint
        self._plans: dict[tuple[str, float], _Plan] = {}

    # -- which parameters go dense, and how many entries the others send ----

    def ratio_of(self, name: str) -> float:
        target = self.cfg.ratio_for(name)
        n = self.cfg.warmup_steps
        if self.steps < n:  # geometric from 1.0 at step 0 to the target at step n
            return target ** (self.steps / n)
        return target

    def plan(self, segment: str, slots: list[ParamSlot]) -> _Plan:
        warm = min(self.steps, self.cfg.warmup_steps)
        key = (segment, warm)
        if key not in self._plans:
            dense, sparse = [], []
            for s in slots:
                k = entries_sent(self.ratio_of(s.name), s.numel)
                if k >= s.numel:
                    if dense and dense[-1][0] + dense[-1][1] == s.offset:  # merge neighbours
                        dense[-1] = (dense[-1][0], dense[-1][1] + s.numel)
                    else:
                        dense.append((s.offset, s.numel))
                else:
                    sparse.append((s.offset, s.numel, k))
            self._plans[key] = _Plan(dense, sparse)
        return self._plans[key]

    # -- the exchange ----

    def loss_divisor(self, local_tokens: int) -> float:
        return self.comm.token_divisor(local_tokens)  # what is sent is averaged over ranks

    def start(self, segment: str, grad: torch.Tensor, slots: list[ParamSlot]) -> Pending:
        plan = self.plan(segment, slots)
        self.slots[segment] = slots
        ef21 = self.cfg.error_feedback and self.cfg.feedback == "ef21"
        if ef21:  # send the change in this rank's gradient since its estimate
            estimate = self._state_for("estimate", segment, grad)
            shared = self._state_for("shared", segment, grad)
            if plan.sparse:
                delta = grad - estimate
        elif self.cfg.error_feedback and plan.sparse:
            grad.add_(self._state_for("residual", segment, grad))
        source = delta if ef21 and plan.sparse else grad
        works = []
        dense_buf = None
        if plan.dense:
            dense_buf = torch.cat([grad.narrow(0, o, n) for o, n in plan.dense])
            works.append(self.comm.all_reduce_sum(dense_buf, async_op=True))
        if plan.sparse:
            index_dtype = torch.int32 if grad.numel() < 2**31 else torch.int64
            idx = torch.cat([
                # NaN ranks above everything, so a non-finite gradient is always sent
                torch.topk(source.narrow(0, o, n).abs().nan_to_num_(nan=torch.inf), k,
                           sorted=False).indices.add_(o)
                for o, n, k in plan.sparse
            ]).to(index_dtype)
            vals = source[idx]
            w = self.comm.size
            all_idx = torch.empty(w * idx.numel(), dtype=index_dtype, device=grad.device)
            all_vals = torch.empty(w * vals.numel(), dtype=vals.dtype, device=grad.device)
            works.append(self.comm.all_gather(all_idx, idx, async_op=True))
            works.append(self.comm.all_gather(all_vals, vals, async_op=True))
            if ef21:  # the estimate moves by what was sent, on every rank alike
                estimate.index_add_(0, idx.long(), vals)
            elif self.cfg.error_feedback:  # what is not sent now is sent later
                res = self.state["residual"][segment]
                res.copy_(grad)
                res[idx] = 0
                for o, n in plan.dense:
                    res.narrow(0, o, n).zero_()

        def finish() -> None:
            if ef21:  # dense ranges: this rank's estimate is its exact gradient
                for o, n in plan.dense:
                    estimate.narrow(0, o, n).copy_(grad.narrow(0, o, n))
            if plan.sparse and ef21:
                # shared = mean of the ranks' estimates, moved by the mean of what they sent
                shared.index_add_(0, all_idx.long(), all_vals.div_(self.comm.size))
                grad.copy_(shared)
            elif plan.sparse:
                grad.zero_()
                grad.index_add_(0, all_idx.long(), all_vals)
            start = 0
            for o, n in plan.dense:
                grad.narrow(0, o, n).copy_(dense_buf.narrow(0, start, n))
                start += n
            if not ef21:
                grad.div_(self.comm.size)
                return
            for o, n in plan.dense:
                grad.narrow(0, o, n).div_(self.comm.size)
                shared.narrow(0, o, n).copy_(grad.narrow(0, o, n))

        return Pending(works, finish)

    def _state_for(self, kind: str, segment: str, like: torch.Tensor) -> torch.Tensor:
        """This segment's `kind` buffer (residual, estimate or shared), zeros at first, or the
        values a resumed run saved."""
        held = self.state.setdefault(kind, {})
        buf = held.get(segment)
        if buf is None:
            buf = torch.zeros_like(like)
            for s in self.slots[segment]:
                saved = self._loaded.pop(f"{kind}.{s.name}", None)
                if saved is not None:
                    buf.narrow(0, s.offset, s.numel).copy_(saved.reshape(-1))
            held[segment] = buf
        return buf

    # -- step boundary and checkpoints ----

    def after_step(self, engine, skipped: bool) -> None:
        self.steps += 1
        if skipped:  # the buffers hold part of the non-finite gradient that was skipped
            for buffers in self.state.values():
                for buf in buffers.values():
                    buf.zero_()

    def local_state(self) -> dict[str, torch.Tensor]:
        out = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        for kind, buffers in self.state.items():
            for segment, buf in buffers.items():
                for s in self.slots[segment]:
                    out[f"{kind}.{s.name}"] = buf.narrow(0, s.offset, s.numel).view(s.shape)
        out.update(self._loaded)  # not used yet since the resume: keep them
        return out

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if "steps" in state:
            self.steps = int(state["steps"])
        kinds = ("residual.", "estimate.", "shared.")
        self._loaded = {k: state[k] for k in state if k.startswith(kinds)}
        self.state = {}
