"""Activation policies: what a segment keeps between its forward and its backward.

Each policy is a small object the engine calls unconditionally, once per segment and
micro-batch: `forward(run, w, x, scope) -> (output, handle)`, later `bring_back(handle)` (the
next segment of the backward is about to run) and `backward(handle, run, w, x, gout, grad,
scope) -> grad of x`. The engine never asks which policy it has.

- `Keep`: the forward's autograd graph, as is (no recompute).
- `Selective`: `torch.utils.checkpoint` with a selective policy: matmul and attention outputs
  are kept, cheap elementwise ops and norms are recomputed.
- `Full`: nothing kept; the backward re-runs the segment from its boundary input.
- `Offload`: the whole graph, with its saved tensors in host RAM until the backward.

Graphs never hold the segment's weights. Saved views of the weights are packed as positions
(`WeightRef`), and the flat leaf the views come from gives up its memory after the forward and
is pointed at the then-current device copy before the backward. A streamed segment's weights can
therefore leave the device after its forward whatever its policy; its backward fetches them
again, as a recomputing segment's does. Saved tensors are counted per storage in the ledger:
`saved` (held on the device until the backward), `offloaded` (held on the host), `workspace`
(materialised for the backward: a recompute, or copies brought back from the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tierlm.activations.offload import Copier, HostPool, OffloadScope
from tierlm.activations.rerun import recording_paused
from tierlm.activations.saved import FrozenWeights, SavedTensorScope, storage_key
from tierlm.activations.selective import SelectiveRun
from tierlm.memory.device import Device, as_device
from tierlm.memory.ledger import Ledger
from tierlm.memory.store import Store

SegmentRun = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""Runs one segment: (flat weights, boundary input) -> output, under the step's autocast."""


@dataclass
class RunScope:
    """One segment run of one micro-batch, as a policy sees it."""

    segment: str
    ledger: Ledger
    shared: set[int]  # storages the step holds anyway: boundary input, micro-batch context
    frozen: FrozenWeights | None = None  # the segment's frozen weights (LoRA's base), if any

    def frozen_keys(self) -> set[int]:
        return {storage_key(self.frozen.flat)} if self.frozen and self.frozen.flat is not None \
            and self.frozen.flat.numel() else set()


def _leaves(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = w.detach().requires_grad_()
    xin = x.detach().requires_grad_() if x.is_floating_point() else x  # token ids: no grad
    return leaf, xin


def _release_weights(leaf: torch.Tensor) -> None:
    """The graph keeps the leaf object (its gradient sink), not the weights' memory."""
    leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)


@dataclass
class _Graph:
    """A forward graph kept for the backward."""

    out: torch.Tensor
    leaf: torch.Tensor
    xin: torch.Tensor
    held_bytes: int
    extra: Any = None

    def backward(self, w: torch.Tensor, gout: torch.Tensor, grad: torch.Tensor):
        self.leaf.data = w  # the device copy of the weights for this backward
        self.leaf.grad = grad  # autograd accumulates into the segment's gradient buffer
        torch.autograd.backward(self.out, gout)
        return self.xin.grad if self.xin.requires_grad else None


class ActivationPolicy:
    name: ClassVar[str]
    # the backward runs the segment's forward again (what the time model prices twice)
    recomputes: ClassVar[bool] = False

    def forward(
        self, run: SegmentRun, w: torch.Tensor, x: torch.Tensor, scope: RunScope
    ) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def forward_done(self, handle: Any) -> None:
        """The forward's compute has been issued: start what follows it (the copies out)."""

    def bring_back(self, handle: Any) -> None:
        """The backward of this segment comes next: start moving what it needs back."""

    def backward(
        self,
        handle: Any,
        run: SegmentRun,
        w: torch.Tensor,
        x: torch.Tensor,
        gout: torch.Tensor,
        grad: torch.Tensor,
        scope: RunScope,
    ) -> torch.Tensor | None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class Keep(ActivationPolicy):
    name = "keep"

    def forward(self, run, w, x, scope):
        leaf, xin = _leaves(w, x)
        saved = SavedTensorScope(leaf, scope.shared, scope.frozen)
        with torch.enable_grad(), saved.hooks():
            out = run(leaf, xin)
        _release_weights(leaf)
        scope.ledger.hold_activation(scope.segment, "saved", saved.bytes)
        return out.detach(), _Graph(out, leaf, xin, saved.bytes)

    def backward(self, handle, run, w, x, gout, grad, scope):
        dx = handle.backward(w, gout, grad)
        scope.ledger.release_activation(scope.segment, "saved", handle.held_bytes)
        return dx


class Selective(ActivationPolicy):
    name = "selective"

    def forward(self, run, w, x, scope):
        leaf, xin = _leaves(w, x)
        sel = SelectiveRun(
            lambda: scope.shared | {storage_key(leaf)} | scope.frozen_keys(),
            lambda nbytes: scope.ledger.hold_activation(scope.segment, "workspace", nbytes),
        )
        # Early stop would end the re-run by raising inside it once every needed tensor exists;
        # running it to the end costs only the cached matmuls' lookups and makes it measurable.
        with torch.enable_grad(), set_checkpoint_early_stop(False):
            out = checkpoint(run, leaf, xin, use_reentrant=False, context_fn=sel.contexts)
        _release_weights(leaf)
        scope.ledger.hold_activation(scope.segment, "saved", sel.held_bytes)
        return out.detach(), _Graph(out, leaf, xin, sel.held_bytes, sel)

    def backward(self, handle, run, w, x, gout, grad, scope):
        dx = handle.backward(w, gout, grad)
        scope.ledger.release_activation(scope.segment, "saved", handle.held_bytes)
        scope.ledger.release_activation(scope.segment, "workspace", handle.extra.workspace_bytes)
        return dx


class RngReplay:
    """Dropout masks for a recompute: the RNG state before the forward, restored around the
    re-run without disturbing the generator's current state. A no-op without dropout."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled

    def capture(self) -> torch.Tensor | None:
        if not self.enabled:
            return None
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    @contextlib.contextmanager
    def replay(self, state: torch.Tensor | None):
        if state is None:
            yield
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(state, self.device)
            else:
                torch.set_rng_state(state)
            yield


class Full(ActivationPolicy):
    name = "full"
    recomputes = True

    def __init__(self, rng: RngReplay) -> None:
        self.rng = rng

    def forward(self, run, w, x, scope):
        state = self.rng.capture()
        with torch.no_grad():
            out = run(w, x)
        return out, state

    def backward(self, handle, run, w, x, gout, grad, scope):
        leaf, xin = _leaves(w, x)
        saved = SavedTensorScope(leaf, scope.shared, scope.frozen)  # what the re-run saves
        # the forward recorded its fp8 statistics: the re-run records nothing again
        with torch.enable_grad(), self.rng.replay(handle), saved.hooks(), recording_paused():
            out = run(leaf, xin)
        scope.ledger.hold_activation(scope.segment, "workspace", saved.bytes)
        leaf.grad = grad
        torch.autograd.backward(out, gout)
        scope.ledger.release_activation(scope.segment, "workspace", saved.bytes)
        return xin.grad if xin.requires_grad else None


class Offload(ActivationPolicy):
    name = "offload"

    def __init__(self, copier: Copier, pool: HostPool) -> None:
        self.copier, self.pool = copier, pool

    def forward(self, run, w, x, scope):
        leaf, xin = _leaves(w, x)
        host = OffloadScope(
            leaf, scope.shared, frozen=scope.frozen, pool=self.pool, copier=self.copier,
            ledger=scope.ledger, segment=scope.segment,
        )
        with torch.enable_grad(), host.hooks():
            out = run(leaf, xin)
        _release_weights(leaf)
        self.pool.observe(scope.segment, host.sizes())
        scope.ledger.hold_activation(scope.segment, "offloaded", host.bytes)
        return out.detach(), _Graph(out, leaf, xin, host.bytes, host)

    def forward_done(self, handle):
        handle.extra.copy_out()

    def bring_back(self, handle):
        if self.copier.asynchronous:  # a synchronous copy gains nothing by going early
            handle.extra.bring_back()

    def backward(self, handle, run, w, x, gout, grad, scope):
        if self.copier.asynchronous:
            handle.extra.arrive()
        dx = handle.backward(w, gout, grad)
        handle.extra.release()
        scope.ledger.release_activation(scope.segment, "offloaded", handle.held_bytes)
        return dx


class PolicyFactory:
    """Builds policy objects by name for one engine (shared host pool, copier, RNG replay).
    `store`: the engine's, whose pinned arena the offloaded activations are cut from."""

    def __init__(self, device: torch.device | Device, *, dropout: bool,
                 store: Store | None = None) -> None:
        dev = as_device(device)
        copier = Copier(dev)
        self.pool = pool = HostPool(store)
        rng = RngReplay(dev.torch_device, dropout)
        self._make: dict[str, Callable[[], ActivationPolicy]] = {
            "keep": Keep,
            "selective": Selective,
            "full": lambda: Full(rng),
            "offload": lambda: Offload(copier, pool),
        }

    def __call__(self, name: str) -> ActivationPolicy:
        return self._make[name]()
