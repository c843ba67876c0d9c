"""Collectives that count their bytes in the ledger.

Every byte the gradient sync, the parameter averaging or a checkpoint gather puts on the
network goes through `Comm`, which records it as `Link.NET_SEND` / `Link.NET_RECV`. The counts
follow the bandwidth-optimal (ring) algorithms the backends use, per rank, for a payload of n
bytes over W ranks:

    all-reduce        sends and receives 2 (W-1)/W n   (reduce-scatter, then all-gather)
    all-gather        sends and receives (W-1) n      (each rank contributes n)
    send / recv       n

so dense and sparse strategies are compared on the same footing. Collectives may run
asynchronously (`async_op=True`): the caller gets a `Work` to wait on, and can keep computing
(the rest of the backward) while the bytes move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tierlm.memory.ledger import Ledger
from tierlm.memory.tiers import Link

# all_gather_single is the newer name of all_gather_into_tensor (which now warns)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce_send_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `nbytes` over `world` ranks."""
    return int(2 * (world - 1) / world * nbytes)


def all_gather_send_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in an all-gather where each of `world` ranks contributes `nbytes`."""
    return (world - 1) * nbytes


class Comm:
    def __init__(self, size: int, ledger: Ledger) -> None:
        self.size = size
        self.ledger = ledger

    def _count(self, sent_bytes: float, received_bytes: float) -> None:
        self.ledger.record_move(Link.NET_SEND, int(sent_bytes))
        self.ledger.record_move(Link.NET_RECV, int(received_bytes))

    def all_reduce_sum(self, t: torch.Tensor, *, async_op: bool = False):
        n = all_reduce_send_bytes(_nbytes(t), self.size)
        self._count(n, n)
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=async_op)

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, *, async_op: bool = False):
        """`out` (W * mine.numel(), rank-major) receives every rank's `mine`."""
        n = all_gather_send_bytes(_nbytes(mine), self.size)
        self._count(n, n)
        return _all_gather_single(out, mine, async_op=async_op)

    def send(self, t: torch.Tensor, dst: int) -> None:
        self._count(_nbytes(t), 0)
        dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self._count(0, _nbytes(t))
        dist.recv(t, src)

    def token_divisor(self, local_tokens: int, averaged_over: int | None = None) -> float:
        """The divisor of this rank's summed step loss when a sync averages the gradients of
        `averaged_over` ranks (None: every rank): the trained tokens of every rank's whole step
        over that count, so the averaged gradient is the one of the world's summed token loss
        over its token count, however the tokens fall between ranks and micro-batches. One
        int64 all-reduce, before the step's forward."""
        t = torch.tensor([local_tokens], dtype=torch.int64)
        self.all_reduce_sum(t)
        return float(max(int(t[0]), 1)) / (averaged_over or self.size)

    def step_loss(self, out: dict[str, float]) -> dict[str, float]:
        """A rank's step output with the world's loss: every rank's summed token loss over
        every rank's trained tokens ("loss_tokens" becomes the world's count too). Two float64
        all-reduced."""
        nll, tokens = self.sum_of([out["loss"] * out["loss_divisor"], out["loss_tokens"]])
        return {**out, "loss": nll / max(tokens, 1.0), "loss_tokens": int(tokens)}

    def sum_of(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks of a few scalars."""
        t = torch.tensor(values, dtype=torch.float64)
        self.all_reduce_sum(t)
        return t.tolist()

    def mean_of(self, values: list[float]) -> list[float]:
        """Element-wise mean over ranks of a few scalars (losses for the log)."""
        t = torch.tensor(values, dtype=torch.float64)
        self.all_reduce_sum(t)
        return (t / self.size).tolist()
