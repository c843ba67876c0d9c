"""What each compute region of a step costs in FLOPs: one rule for the engine, which prices its
regions on a simulated device (tierlm.memory.device), and the planner's replay, which issues the
same regions to its own timeline.

A matmul over `params` weights costs 2 FLOPs per weight per token forward and 4 backward (the
input's gradient and the weight's; a frozen weight takes no gradient: 2). Causal attention adds
2 x T x D per token per block forward (QK^T and AV, half of them masked), twice that backward.
A segment that recomputes its forward in the backward (the `full` policy) runs it twice. The
embedding's lookup costs nothing; the head runs its forward and backward in one action.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SegmentCost:
    """One segment's shape as the FLOP rule sees it."""

    params: int  # weights its matmuls read (the head: with the tied embedding it borrows)
    block: bool  # a transformer block (attention, and fp8 matmuls in an fp8 run)
    frozen: bool = False  # no weight gradients (a LoRA run's base)

    def forward(self, tokens: int, seq_len: int, hidden: int) -> float:
        if not self.block:
            return 0.0
        return 2.0 * self.params * tokens + 2.0 * seq_len * hidden * tokens

    def backward(self, tokens: int, seq_len: int, hidden: int, *, recompute: bool) -> float:
        if not self.block:
            return 0.0
        per_weight = 2.0 if self.frozen else 4.0
        flops = per_weight * self.params * tokens + 4.0 * seq_len * hidden * tokens
        return flops + (self.forward(tokens, seq_len, hidden) if recompute else 0.0)

    def head(self, tokens: int) -> float:
        """Forward and backward of the head (norm and projection) over `tokens`."""
        return 6.0 * self.params * tokens
