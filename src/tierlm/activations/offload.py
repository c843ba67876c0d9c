"""Saved tensors to host RAM after the forward, back to the device ahead of the backward.

Each activation storage is copied once (several saved views of one buffer share the copy) into a
host buffer (`HostPool`). In an engine the buffers are cut from the run's pinned arena
(tierlm.memory.arena, through the store: counted by the ledger as pinned host activations) at
the forward and given back after the backward, so the arena, allocated once per run, is what
lives across steps; the plan's replay (tierlm.runtime.byte_replay) cuts the same sizes in the
same order, measured before the first step by running each offloaded segment once
(`offloaded_sizes`). Under CUDA the copies run on the copy streams: the device-to-host copies are
issued once the segment's forward has been issued (`OffloadScope.copy_out`, called by the engine
after the forward's compute region), so each waits for the forward that wrote it and overlaps
what follows; the engine asks for the host-to-device copies one segment ahead of the backward,
so they overlap the backward of the segment before, and the backward waits for the last of them
before it runs (one wait: the copies of one stream land in order). The simulated timeline and
the planner's replay (tierlm.plan.replay) issue the same copies with the same waits. On a
CPU-only machine the "device" is the CPU and the copies are plain memcpys, still counted as
D2H/H2D so the ledger shows what a GPU run would move.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tierlm.activations.saved import FrozenWeights, SavedTensorScope, storage_bytes
from tierlm.memory.device import Device
from tierlm.memory.disk import aligned_empty
from tierlm.memory.ledger import Ledger
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass, Tier


class HostPool:
    """Host byte buffers for offloaded activations.

    With a `store` (an engine's): the buffer a segment's `index`-th offloaded storage takes is
    cut from the run's pinned arena when its size is the one `expected` for that position (the
    sizes the arena was sized with, `Engine.pinned_bytes`), so the arena sees exactly the
    sequence the plan's replay counted; a size the count did not foresee (a segment switched to
    `offload` later, a step of another row shape, a format the probe did not run) takes a
    pageable host buffer, counted by the ledger but not pinned (its copies are synchronous on a
    GPU). What each segment's last run took is kept in `observed`, from which the engine sizes
    the arena for the next step (Engine._learn_offload_sizes).

    Without one (a policy run on its own): pinned where CUDA exists, elsewhere mappings of their
    own, reused by size and unmapped when the pool lets them go."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.expected: dict[str, tuple[int, ...]] = {}  # segment -> sizes the arena holds
        self.observed: dict[str, tuple[int, ...]] = {}  # segment -> sizes its last run took

    def take(self, nbytes: int, segment: str = "", index: int = 0) -> torch.Tensor:
        if self.store is None:
            free = self._free[nbytes]
            return free.pop() if free else aligned_empty(nbytes, torch.uint8)
        sizes = self.expected.get(segment, ())
        pinned = index < len(sizes) and sizes[index] == nbytes
        return self.store.alloc(Tier.HOST, TensorClass.ACTIVATION, nbytes, torch.uint8,
                                pinned=pinned)

    def give(self, buf: torch.Tensor) -> None:
        if self.store is None:
            self._free[buf.numel()].append(buf)
            return
        # an arena range comes back once the copies queued so far (its copy back) have finished
        self.store.free(Tier.HOST, TensorClass.ACTIVATION, buf)

    def observe(self, segment: str, sizes: tuple[int, ...]) -> None:
        self.observed[segment] = sizes


class _SizeScope(SavedTensorScope):
    """Records the bytes of the host buffer each offloaded storage would take, in order."""

    def __init__(self, weights: torch.Tensor, shared: set[int]) -> None:
        super().__init__(weights, shared)
        self.sizes: list[int] = []

    def pack_activation(self, t: torch.Tensor, key: int, first: bool) -> object:
        if first:
            self.sizes.append(storage_bytes(t))
        return t


def offloaded_sizes(run, w: torch.Tensor, x: torch.Tensor, shared: set[int]) -> tuple[int, ...]:
    """The host buffers (bytes, in the order they are taken) the offload policy takes for one
    forward of `run` on weights `w` and input `x` (`shared`: the storages the step holds
    anyway): the step's sizes, since they depend only on the segment, its format and the
    input's shape."""
    leaf = w.detach().requires_grad_()
    xin = x.detach().requires_grad_() if x.is_floating_point() else x
    scope = _SizeScope(leaf, shared)
    with torch.enable_grad(), scope.hooks():
        run(leaf, xin)
    return tuple(scope.sizes)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` as a flat uint8 tensor."""
    s = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (s.nbytes(),), (1,))


class Copier:
    """The offload's copies, through the engine's device (tierlm.memory.device): on CUDA they
    run on the copy streams, on a CPU they are memcpys, on a simulated device they land when
    waited for."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.asynchronous = device.asynchronous

    def to_host(self, dst: torch.Tensor, src: torch.Tensor):
        """Copy out once compute has written `src`; returns the copy's event."""
        return self.device.copy(dst, src, Link.D2H, "offload")

    def to_device(self, src: torch.Tensor, device: torch.device, written):
        """(device copy, event the compute stream waits for before using it). The copy starts
        once the host copy `written` (its event) is complete and the compute queued so far
        (which may still use the memory the new buffer reuses) is done."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        return dst, self.device.copy(dst, src, Link.H2D, "offload",
                                     after=[written, self.device.mark()])

    def ready(self, t: torch.Tensor, event) -> None:
        self.device.wait(event, "offload")


class _HostCopy:
    """One activation storage on the host, and its device copy once brought back."""

    __slots__ = ("host", "written", "device_copy", "event")

    def __init__(self, host: torch.Tensor, written) -> None:
        self.host = host
        self.written = written  # the copy out's event
        self.device_copy: torch.Tensor | None = None
        self.event = None  # the copy back's completion, until the compute stream waited on it


class _Offloaded:
    """What autograd holds for one saved tensor: its host copy and how to view it."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset")

    def __init__(self, copy: _HostCopy, t: torch.Tensor) -> None:
        self.copy = copy
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()


class OffloadScope(SavedTensorScope):
    """Saved-tensor hooks of one segment run that keep activations on the host."""

    def __init__(
        self,
        weights: torch.Tensor,
        shared: set[int],
        *,
        frozen: FrozenWeights | None = None,
        pool: HostPool,
        copier: Copier,
        ledger: Ledger,
        segment: str,
    ) -> None:
        super().__init__(weights, shared, frozen)
        self.pool, self.copier, self.ledger, self.segment = pool, copier, ledger, segment
        self.device = weights.device
        self._copies: dict[int, _HostCopy] = {}  # storage key -> its copy (the latest)
        self._all: list[_HostCopy] = []
        # storages packed and not yet copied out (held until `copy_out`), with their copies
        self._pending: list[tuple[torch.Tensor, _HostCopy]] = []
        self.device_bytes = 0  # brought back and not yet released

    def pack_activation(self, t: torch.Tensor, key: int, first: bool) -> object:
        if first:
            src = _bytes_view(t)
            host = self.pool.take(src.numel(), self.segment, len(self._all))
            self._copies[key] = _HostCopy(host, None)
            self._all.append(self._copies[key])
            self._pending.append((src, self._copies[key]))
        return _Offloaded(self._copies[key], t)

    def copy_out(self) -> None:
        """Issue the copies to the host of what the forward saved, in the order it saved them:
        called once the forward's compute is issued, so each copy waits for the forward that
        wrote its tensor (on a simulated device: for the forward's compute region)."""
        pending, self._pending = self._pending, []
        for src, c in pending:
            c.written = self.copier.to_host(c.host, src)
            self.ledger.record_move(Link.D2H, src.numel())

    def sizes(self) -> tuple[int, ...]:
        """The bytes of each host buffer this run took, in order."""
        return tuple(c.host.numel() for c in self._all)

    def bring_back(self) -> None:
        """Start copying every activation back to the device (before the backward needs it)."""
        for c in self._all:
            self._to_device(c)

    def arrive(self) -> None:
        """Before the backward: every activation on its way back, and the compute stream
        waiting for the last copy issued (the copies of one stream complete in order), so the
        backward's unpacks find them there."""
        self.bring_back()
        last = None
        for c in self._all:
            if c.event is not None:
                last, c.event = c.event, None
        if last is not None:
            self.copier.ready(None, last)

    def _to_device(self, c: _HostCopy) -> torch.Tensor:
        if self._pending:  # used before the engine issued them (a policy run on its own)
            self.copy_out()
        if c.device_copy is None:
            c.device_copy, c.event = self.copier.to_device(c.host, self.device, c.written)
            n = c.host.numel()
            self.ledger.record_move(Link.H2D, n)
            self.ledger.hold_activation(self.segment, "workspace", n)
            self.device_bytes += n
        return c.device_copy

    def unpack_activation(self, packed: object) -> torch.Tensor:
        assert isinstance(packed, _Offloaded)
        c = packed.copy
        dev = self._to_device(c)
        if c.event is not None:
            self.copier.ready(dev, c.event)
            c.event = None
        return torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            dev.untyped_storage(), packed.offset, packed.size, packed.stride
        )

    def release(self) -> None:
        """After the backward: host buffers back to the pool, device copies dropped."""
        self._pending.clear()
        for c in self._all:
            self.pool.give(c.host)
            c.device_copy = c.event = None
        self._copies.clear()
        self._all.clear()
        if self.device_bytes:
            self.ledger.release_activation(self.segment, "workspace", self.device_bytes)
            self.device_bytes = 0
