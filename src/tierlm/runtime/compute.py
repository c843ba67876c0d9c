"""The engine's compute on one action (part of tierlm.runtime.engine.Engine): the weights an
action reads (the update it waits for, the stream cache's copy, a frozen base's, the head's tied
weights), the activation policies, and the forward, head and backward each action runs under
them. tierlm.runtime.walk holds, parks and drops what these return.

`SegmentCompute` is one of the Engine's parts: it reads the engine's states, store, cache,
policies and options, which Engine.__init__ sets."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tierlm.activations import (
    RunScope,
    SavedTensorScope,
    chunked_cross_entropy,
    storages_of,
)
from tierlm.memory.store import nbytes_of
from tierlm.models.adapters import HeadSegment, StepContext
from tierlm.runtime.schedule import Action, reads
from tierlm.runtime.state import (
    SegmentState,
    refresh_due,
    refresh_resident,
    reload_resident,
)


@dataclass
class MicroBatch:
    ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T)
    positions: torch.Tensor | None = None  # (B, T) for packed examples; None: 0..T-1
    ctx: StepContext | None = None
    saved: dict[int, object] = field(default_factory=dict)  # activation policy handles


class SegmentCompute:
    """The forward, head and backward of the Engine's actions, and the weights they read."""

    def _trained_flat(self, s: int, w: torch.Tensor) -> torch.Tensor:
        """The flat the activation policy differentiates for segment `s`, whose weights on the
        device are `w`: `w` itself when the segment's weights are trained; for a frozen base,
        `w` becomes the frozen copy this action reads and the adapters are differentiated."""
        frozen = self.frozen[s]
        if frozen is None:
            return w
        frozen.flat = w
        t = self.trained[s]
        return self._no_params if t is None else t.master

    def _param_views(self, s: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of segment `s` on the flat `_trained_flat` gave (or a leaf of it)."""
        frozen = self.frozen[s]
        if frozen is None:
            return self.states[s].views(flat)
        views = self.states[s].views(frozen.flat)
        if self.trained[s] is not None:
            views.update(self.trained[s].layout.views(flat))
        return views

    def _weights(self, k: int, s: int) -> torch.Tensor:
        self._wait_update(s)
        st = self.states[s]
        t0 = time.perf_counter()
        if not st.placement.resident:
            # a copy still in flight (prefetched) or not started: this call waits for it
            arrived = s in self.cache.pending or s not in self.cache.entries
            w = self.cache.acquire(k, s)
        else:
            arrived = st.device_stale
            if st.device_stale:  # finished here if `_refresh_ahead` started it
                reload_resident(self.store, st, self.chunk_numel, self._refreshing.pop(s, None))
                st.device_stale = False
            w = st.device_weights
        # Host-side wait: on CUDA an H2D copy the compute stream waits for is not included.
        t1 = time.perf_counter()
        self.transfer_wait_s += t1 - t0
        if arrived:
            self.tracer.record("wait", f"weights {st.seg.name}", t0, t1, cat="transfer wait")
        return st.flat(w)

    def _refresh_ahead(self, a: Action) -> None:
        """Start refreshing the stale resident copies action `a` reads (issued while the action
        before it runs, as the stream cache prefetches what it streams), each whose update is
        done: its upload then runs under that action's compute instead of after it. One whose
        update is still running is refreshed at its use (`_weights`): the training thread
        does not wait for an update here."""
        for s in reads(a, [owner for owner, _, _ in self.borrowed.values()]):
            st = self.states[s]
            if s not in self._refreshing and refresh_due(st, self._updates.get(s)):
                load = refresh_resident(self.store, st, self.chunk_numel)
                if load is not None:
                    self._refreshing[s] = load

    def _views(self, k: int, s: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter views of segment `s`; for the head also the borrowed (tied) weights, as
        leaves of their own whose gradients `_collect_tied` gathers for the owner."""
        views = self._param_views(s, flat)
        self._borrowed_leaf = {}
        if s == len(self.states) - 1:
            for name, (owner, off, n) in self.borrowed.items():
                tied = self._weights(k, owner).narrow(0, off, n).detach()
                if self.tied_trained:
                    self._borrowed_leaf[name] = tied.requires_grad_()
                views[name] = tied.view(self._slot_shape(owner, name))
        return views

    def _slot_shape(self, owner: int, name: str) -> tuple[int, ...]:
        return next(s.shape for s in self.states[owner].layout.slots if s.name == name)

    def _collect_tied(self, buf: torch.Tensor) -> None:
        """The head's tied weights (`_borrowed_leaf`, just made by `_views`) take their slots of
        `buf`, a zeroed buffer the size of the owner's gradient, as their gradients, so autograd
        accumulates the head's contribution straight into what the owner's backward then
        accumulates its own into (tierlm.runtime.walk)."""
        for name, b in self._borrowed_leaf.items():
            _, off, n = self.borrowed[name]
            b.grad = buf.narrow(0, off, n)

    def _run(self, st: SegmentState, mb: MicroBatch):
        """Segment `st` on micro-batch `mb`: (flat weights, boundary input) -> output."""

        def run(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            with self.opts.autocast():
                return st.seg.forward(self._param_views(st.index, flat), x, mb.ctx)

        return run

    def _scope(self, st: SegmentState, mb: MicroBatch, x: torch.Tensor) -> RunScope:
        return RunScope(st.seg.name, self.ledger, storages_of(x, mb.ctx), self.frozen[st.index])

    def _bring_back(self, upcoming: list[Action], mbs: list[MicroBatch]) -> None:
        """The next backward's offloaded activations start back to the device now, so their
        copy overlaps the current action (a no-op for the other policies)."""
        for a in upcoming:
            if a.kind == "bwd":
                for i in a.mbs:
                    self.policies[a.seg].bring_back(mbs[i].saved[a.seg])

    def _forward(self, a: Action, mbs: list[tuple[MicroBatch, torch.Tensor | None]],
                 w: torch.Tensor) -> Iterator[torch.Tensor]:
        """Forward action `a` on each of its micro-batches with its input (None: the token
        ids) in turn: each output, yielded before the next micro-batch runs."""
        s = a.seg
        st = self.states[s]
        w = self._trained_flat(s, w)
        cost = self.costs[s]
        for mb, x in mbs:
            x = mb.ids if x is None else x
            with self.clock.measure(f"forward {st.seg.name}", cost.forward(*self._shape(mb)),
                                    block=cost.block):
                out, mb.saved[s] = self.policies[s].forward(self._run(st, mb), w, x,
                                                            self._scope(st, mb, x))
                if s == 0:
                    with torch.no_grad(), self.opts.autocast():
                        mb.ctx = self.adapter.context(mb.ids, out, mb.positions,
                                                      ring=self.opts.sequence_share.ring)
            # after the region: what follows the forward waits for its compute (the offload's
            # copies out)
            self.policies[s].forward_done(mb.saved[s])
            yield out

    def _head(
        self, k: int, mb: MicroBatch, divisor: float, w: torch.Tensor, x: torch.Tensor,
        grad: torch.Tensor, tied: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed token loss of one micro-batch over `divisor` (the step's, see
        tierlm.data.batch; a 0-dim fp64 tensor on the device, not read here) and its gradient
        at the head's input `x`, chunk by chunk over tokens,
        so the full (tokens x vocab) logits never exist at once. The head's gradient
        accumulates in `grad`, the borrowed weights' in `tied` (None without trained ties)."""
        s = len(self.states) - 1
        st = self.states[s]
        seg: HeadSegment = st.seg  # type: ignore[assignment]
        w = self._trained_flat(s, w)
        frozen = self.frozen[s]
        leaf = w.detach().requires_grad_()
        leaf.grad = grad
        views = self._views(k, s, leaf)
        if tied is not None:
            self._collect_tied(tied)
        x = x.detach().requires_grad_()
        # The ledger counts what autograd saves here: the norm's tensors and the normed input
        # for the whole action, each chunk's log-softmax during that chunk.
        shared = storages_of(x, mb.ctx, [views[n] for n in self.borrowed])
        norm = SavedTensorScope(leaf, shared, frozen)
        flops = self.costs[s].head(self._shape(mb)[0])
        with self.clock.measure(f"head {seg.name}", flops), torch.enable_grad(), \
                self.opts.autocast(), norm.hooks():
            hn = seg.forward(views, x, mb.ctx)
        hn_leaf = hn.detach().requires_grad_()
        held = norm.bytes + nbytes_of(hn_leaf)
        self.ledger.hold_activation(seg.name, "saved", held)
        shared |= storages_of(hn_leaf)
        with self.clock.measure():  # priced with the head's forward above
            loss = chunked_cross_entropy(
                lambda h: seg.project(views, h),
                hn_leaf.flatten(0, 1),  # (B*T, D)
                mb.targets.flatten(),
                chunk_tokens=self.chunk_tokens,
                divisor=divisor,
                autocast=self.opts.autocast,
                saved=lambda: SavedTensorScope(leaf, shared, frozen),
                ledger=self.ledger,
                segment=seg.name,
                loss_of=self.opts.chunk_loss,
            )
            hn.backward(hn_leaf.grad)
        self.ledger.release_activation(seg.name, "saved", held)
        return loss, x.grad

    def _backward(
        self, s: int, mb: MicroBatch, w: torch.Tensor, x: torch.Tensor | None,
        gout: torch.Tensor, grad: torch.Tensor,
    ) -> torch.Tensor:
        """Segment `s`'s gradient at its input `x` (None: the token ids) given `gout` at its
        output; `w`: the weights on the device, which every policy's backward reads; `grad`:
        where the segment's gradient accumulates."""
        st = self.states[s]
        w = self._trained_flat(s, w)
        x = mb.ids if x is None else x
        flops = self.costs[s].backward(*self._shape(mb), recompute=self.policies[s].recomputes)
        with self.clock.measure(f"backward {st.seg.name}", flops, block=self.costs[s].block):
            return self.policies[s].backward(mb.saved.pop(s), self._run(st, mb), w, x, gout,
                                             grad, self._scope(st, mb, x))

    def _shape(self, mb: MicroBatch) -> tuple[int, int, int]:
        """(tokens, sequence length, hidden size) of micro-batch `mb` for the FLOP rule."""
        return mb.ids.numel(), mb.ids.shape[-1], self.hidden_size
