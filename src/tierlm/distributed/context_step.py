"""The context-parallel step: the reference step over zig-zag shares of every sequence.

Each rank runs the whole (resident) model on its share of each row (tierlm.distributed.context
says which tokens, and how attention sees the rest through the ring). What makes the ranks
together equal one process over the full sequences and the whole global batch:

- the loss is token-weighted over the whole step: each rank divides its summed token losses
  by the trained targets of every rank's step (all micro-batches, all row groups) over the
  data-parallel size, the count all-reduced once before the forward;
- weight gradients are summed over every rank (all-reduce) and divided by the data-parallel
  size, so they are those of the whole step's summed token loss over its token count;
- the logged loss is every rank's summed token loss over that count.

Every rank then steps with the same gradient and keeps the same weights, so checkpoints,
evaluation and sampling read rank 0's, as the reference step gives them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from tierlm.data.batch import IGNORE_INDEX, inputs_and_targets, position_ids
from tierlm.distributed.comm import Comm
from tierlm.distributed.context import (
    ContextLayout,
    Ring,
    ZigzagShare,
    check_ring_model,
    use_ring_attention,
)
from tierlm.memory.ledger import Ledger
from tierlm.memory.tiers import Link
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.stepper import Stepper


class ContextParallelStep(Stepper):
    def __init__(self, ref: ReferenceStep, layout: ContextLayout, ring: Ring) -> None:
        check_ring_model(ref.model)
        self.ref = ref
        self.layout = layout
        self.ring = ring
        self.share = ZigzagShare(layout, ring)
        self.comm = Comm(layout.world_size, Ledger())  # the gradient all-reduce, counted
        use_ring_attention(ref.model)

    @property
    def skipped_steps(self) -> int:
        return self.ref.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.ref.skipped_steps = value

    # -- this rank's share of a batch ----

    def _share(self, batch: torch.Tensor):
        """(B, T/N) inputs, targets and global positions (RoPE reads them) of this rank's
        share of `batch`."""
        batch = batch.to(self.ref.device)
        inputs, targets = inputs_and_targets(batch)  # (B, T)
        return self.share.take(inputs, targets, position_ids(batch))

    def _share_nll(self, inputs, targets, positions) -> torch.Tensor:
        """Summed token loss of this rank's share."""
        with self.ref.autocast():
            logits = self.ref.model(input_ids=inputs, position_ids=positions, use_cache=False,
                                    cp_ring=self.ring).logits  # (B, T/N, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def _nll(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss of this rank's share of `batch`, target count of the CP group)."""
        inputs, targets, positions = self._share(batch)
        nll = self._share_nll(inputs, targets, positions)
        tokens = (targets != IGNORE_INDEX).sum().to(torch.float32)
        dist.all_reduce(tokens, group=self.ring.group)
        return nll, tokens

    # -- the step ----

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        ref = self.ref
        for group in ref.optimizer.param_groups:
            group["lr"] = lr
        self.ring.sent_bytes = 0
        self.comm.ledger.reset_step()
        with ref.clock.measure():
            shares = [self._share(batch) for batch in batches]
            tokens = sum(int((t != IGNORE_INDEX).sum()) for _, t, _ in shares)
            # every rank's tokens over dp: the gradients are summed, then divided by dp
            divisor = self.comm.token_divisor(tokens, averaged_over=self.layout.dp)
            nll_sum = torch.zeros((), device=ref.device)
            for inputs, targets, positions in shares:
                nll = self._share_nll(inputs, targets, positions)
                (nll / divisor).backward()
                nll_sum += nll.detach()
            self._sum_gradients()
            grad_norm = torch.nn.utils.clip_grad_norm_(ref.params, ref.clip_norm).item()
            skipped = not math.isfinite(grad_norm)
            if skipped:
                ref.skipped_steps += 1
            else:
                ref.optimizer.step()
            ref.optimizer.zero_grad(set_to_none=True)
        kv_send_bytes = self.ring.sent_bytes
        out = self.comm.step_loss({"loss": nll_sum.item() / divisor, "loss_divisor": divisor,
                                   "loss_tokens": tokens})
        return {**out, "grad_norm": grad_norm, "skipped": skipped,
                "compute_s": ref.clock.take(), "kv_send_bytes": kv_send_bytes,
                "net_send_bytes": kv_send_bytes + self.comm.ledger.moved_bytes[Link.NET_SEND]}

    def _sum_gradients(self) -> None:
        """Sum over all ranks, divided by the data-parallel size (the module docstring)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.ref.params]
        flat = _flatten_dense_tensors([g.float() for g in grads])
        self.comm.all_reduce_sum(flat)
        flat /= self.layout.dp
        for p, g in zip(self.ref.params, _unflatten_dense_tensors(flat, grads), strict=True):
            p.grad = g.to(p.dtype)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of `batch` (every row group evaluates all of its rows)."""
        self.ref.model.eval()
        try:
            nll, tokens = self._nll(batch)
            dist.all_reduce(nll, group=self.ring.group)
            return (nll / tokens).item()
        finally:
            self.ref.model.train()

    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole prompt on this rank, through SDPA (no ring given)."""
        return self.ref.next_token_logits(ids)

    # -- state: every rank holds the same weights ----

    def weights(self) -> dict[str, torch.Tensor]:
        return self.ref.weights()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.ref.optimizer_state()

    def state_shards(self) -> Iterator:
        return self.ref.state_shards()

    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
        self.ref.load(weights, optim)

    def synchronize(self) -> None:
        self.ref.synchronize()

    def close(self) -> None:
        self.ref.close()
