"""Flat buffers: a segment's parameters packed into one contiguous tensor per copy.

Parameters that take weight decay come first, the rest after, so each optimizer group is one
contiguous slice and a move is one large copy instead of hundreds of small ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    name: str  # the parameter's qualified name in the model
    shape: tuple[int, ...]
    offset: int
    numel: int
    decay: bool


class FlatLayout:
    def __init__(self, named_shapes: list[tuple[str, tuple[int, ...], bool]]) -> None:
        """`named_shapes`: (name, shape, takes_weight_decay) in the segment's order."""
        ordered = [e for e in named_shapes if e[2]] + [e for e in named_shapes if not e[2]]
        slots, offset = [], 0
        for name, shape, decay in ordered:
            numel = 1
            for d in shape:
                numel *= d
            slots.append(ParamSlot(name, tuple(shape), offset, numel, decay))
            offset += numel
        self.slots: list[ParamSlot] = slots
        self.numel: int = offset
        self.decay_numel: int = sum(s.numel for s in slots if s.decay)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view of `flat` with the parameter's shape (autograd flows back into `flat`).

        One split rather than a narrow per parameter: the backward of a split concatenates the
        parameters' gradients once, where each narrow's backward would fill and add a zeroed
        flat-sized buffer (a quarter of a block's backward time on CPU)."""
        parts = flat.split_with_sizes([s.numel for s in self.slots])  # slots tile `flat`
        return {s.name: part.view(s.shape) for s, part in zip(self.slots, parts, strict=True)}

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, lo: int = 0
             ) -> torch.Tensor:
        """Write elements [lo, lo + out.numel()) of the packed parameters into `out` (by
        default all of them); only the parameters that range touches are looked up."""
        hi = lo + out.numel()
        for s in self.slots:
            a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
            if a < b:
                src = tensors[s.name].reshape(-1)
                out[a - lo : b - lo].copy_(src[a - s.offset : b - s.offset])
        return out

    def groups(self) -> list[tuple[int, int, bool]]:
        """(start, length, takes_weight_decay) of the non-empty optimizer groups."""
        out = []
        if self.decay_numel:
            out.append((0, self.decay_numel, True))
        if self.numel - self.decay_numel:
            out.append((self.decay_numel, self.numel - self.decay_numel, False))
        return out
