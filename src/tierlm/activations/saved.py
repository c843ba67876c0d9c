"""What autograd saves for a segment's backward, seen through `saved_tensors_hooks`.

A saved tensor is one of three things:

- a view of the segment's **weights**: packed as a `WeightRef` (shape, strides, offset) and
  rebuilt in the backward from whatever buffer then holds the weights, so a kept graph never pins
  the device copy of a streamed segment;
- a view of a segment's **frozen weights** (a LoRA run's base, `FrozenWeights`): packed the same
  way and rebuilt from the base's device copy the backward runs with;
- a view of a **shared** tensor the step holds anyway (the segment's boundary input, the
  micro-batch context: rotary tables, masks, positions): kept as is and not counted;
- an **activation**: what the activation policy keeps, offloads or counts.

Bytes are counted per storage, not per saved tensor: autograd often saves several views of one
buffer (the normed hidden state feeds the q, k and v projections), which hold its memory once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory a tensor views (shared by all views of one buffer)."""
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def storages_of(*objs: object) -> set[int]:
    """Storage keys of every tensor inside `objs` (tensors, tuples, lists, dicts, dataclasses)."""
    keys: set[int] = set()
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.numel():
                keys.add(storage_key(o))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    return keys


@dataclass(frozen=True)
class WeightRef:
    """A saved view of the segment's flat weights, by position instead of by memory. The view
    may have another dtype than the flat weights (a compute copy's bf16 or E4M3 entries,
    tierlm.precision.streaming): its offset is kept in bytes."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int  # from the start of the flat weights
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor, flat: torch.Tensor) -> WeightRef:
        start = t.storage_offset() * t.element_size() - flat.storage_offset() * flat.element_size()
        return cls(tuple(t.size()), tuple(t.stride()), start, t.dtype)

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        start = flat.storage_offset() * flat.element_size() + self.byte_offset
        if self.dtype == flat.dtype:
            return flat.detach().as_strided(self.size, self.stride, start // flat.element_size())
        out = torch.empty(0, dtype=self.dtype, device=flat.device)
        return out.set_(flat.untyped_storage(), start // self.dtype.itemsize, self.size,
                        self.stride)


class FrozenWeights:
    """Where a segment's frozen weights (a LoRA run's base: no gradient) are on the device for
    the action running now. The engine points `flat` at the action's copy before the segment
    runs, forward or backward, so a kept graph or a recompute reads the copy of its own action
    (a streamed base may come back in another slot)."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None


@dataclass(frozen=True)
class _FrozenRef:
    ref: WeightRef


class SavedTensorScope:
    """Sorts saved tensors of one segment run into weights, shared tensors and activations, and
    counts the activations' bytes per storage. Subclasses decide where activations go."""

    def __init__(self, weights: torch.Tensor, shared: Iterable[int],
                 frozen: FrozenWeights | None = None) -> None:
        self.weights = weights  # the flat leaf the segment's parameter views come from
        self.weight_key = storage_key(weights)
        self.frozen = frozen
        self.frozen_key = (storage_key(frozen.flat) if frozen is not None
                           and frozen.flat is not None else None)
        self.shared = set(shared)
        self.count = 0  # saved tensors that are activations
        self.bytes = 0  # their memory, each storage once
        # storage key -> weak reference to the storage: a key whose storage died may come back
        # for a new buffer at the same address (offloaded tensors are not held on the device)
        self._seen: dict[int, weakref.ref] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> object:
        if t.numel() == 0:  # (an empty flat, a segment without adapters, has no address)
            return t
        key = storage_key(t)
        if key == self.weight_key:
            return WeightRef.of(t, self.weights)
        if key == self.frozen_key:
            return _FrozenRef(WeightRef.of(t, self.frozen.flat))
        if key in self.shared:
            return t
        self.count += 1
        seen = self._seen.get(key)
        first = seen is None or seen() is None
        if first:
            self._seen[key] = weakref.ref(t.untyped_storage())
            self.bytes += storage_bytes(t)
        return self.pack_activation(t, key, first)

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, WeightRef):
            return packed.rebuild(self.weights)
        if isinstance(packed, _FrozenRef):
            return packed.ref.rebuild(self.frozen.flat)
        if isinstance(packed, torch.Tensor):
            return packed
        return self.unpack_activation(packed)

    # -- where activations go: kept as they are here ----

    def pack_activation(self, t: torch.Tensor, key: int, first: bool) -> object:
        return t

    def unpack_activation(self, packed: object) -> torch.Tensor:
        raise TypeError(f"unexpected saved object {type(packed).__name__}")
