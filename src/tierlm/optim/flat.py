"""The optimizer interface over flat segment state.

A segment's parameters live in one flat fp32 master (tierlm.memory.layout); an optimizer's state
is a few more flat buffers beside it, one per *slot*. A slot declares how many of its elements a
parameter of a given shape owns (`numel_of`) and their dtype; its buffer holds the parameters'
parts in the layout's order. Everything that stores, moves, counts or checkpoints optimizer state
(state homes, the engine's update and checkpoint paths, delayed sync, placement, the planner)
reads these declarations and never names a slot itself.

Ranges. The engine may update a disk-tier segment in chunks: elements [lo, hi) of the flat
master and gradient, with each slot's matching range (`slot_range`). Chunk boundaries fall on
parameter starts or on multiples of the optimizer's `align` inside a parameter, so a slot of
`block` elements per state element (8-bit scales: one per 256 values) maps a cut to a whole
state element. An optimizer whose state is not elementwise within a parameter (factored
moments, projections) sets `align = 0`: it is always given whole segments.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from tierlm.memory.layout import FlatLayout, ParamSlot
from tierlm.memory.tiers import TensorClass

Shape = tuple[int, ...]


@dataclass(frozen=True)
class StateSlot:
    """One buffer of optimizer state.
    - `numel_of(p)`: the elements parameter `p` (a `ParamSlot`: name, shape, weight decay) owns;
      default one per parameter element.
    - `shape_of(p)`: the shape its part is stored under in a checkpoint; default the
      parameter's shape for an elementwise slot (no `numel_of`), else flat.
    - `block`: parameter elements per state element within a chunk range: 1 elementwise, 256
      for per-block scales, 0 not rangeable (the optimizer's `align` must then be 0).
    - `average`: delayed sync may average it across ranks as a float tensor."""

    name: str
    dtype: torch.dtype = torch.float32
    numel_of: Callable[[ParamSlot], int] | None = None
    shape_of: Callable[[ParamSlot], Shape] | None = None
    block: int = 1
    cls: TensorClass = TensorClass.OPTIM
    average: bool = True

    def param_numel(self, p: ParamSlot) -> int:
        if self.numel_of is not None:
            return self.numel_of(p)
        return p.numel

    def param_shape(self, p: ParamSlot) -> Shape:
        if self.shape_of is not None:
            return self.shape_of(p)
        if self.numel_of is None:  # elementwise: the parameter's own shape, as torch keeps it
            return p.shape
        return (self.param_numel(p),)

    def offsets(self, layout: FlatLayout) -> list[int]:
        """Where each of the layout's parameters starts in this slot's buffer."""
        out, at = [], 0
        for p in layout.slots:
            out.append(at)
            at += self.param_numel(p)
        return out

    def numel(self, layout: FlatLayout) -> int:
        return sum(self.param_numel(p) for p in layout.slots)

    def nbytes(self, layout: FlatLayout) -> int:
        return self.numel(layout) * torch.empty((), dtype=self.dtype).element_size()

    def views(self, layout: FlatLayout, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter name -> its part of `buf` (the whole slot buffer), in checkpoint shape."""
        out = {}
        for p, off in zip(layout.slots, self.offsets(layout), strict=True):
            n = self.param_numel(p)
            out[p.name] = buf[off : off + n].view(self.param_shape(p))
        return out

    def pack(self, layout: FlatLayout, tensors: Mapping[str, torch.Tensor], out: torch.Tensor,
             a: int = 0) -> torch.Tensor:
        """Write elements [a, a + out.numel()) of this slot's buffer into `out` from `tensors`
        (parameter name -> its part, in any shape and float dtype, as a checkpoint holds it);
        only the parameters that range touches (and that own elements here) are looked up."""
        b = a + out.numel()
        for p, off in zip(layout.slots, self.offsets(layout), strict=True):
            n = self.param_numel(p)
            lo, hi = max(off, a), min(off + n, b)
            if lo < hi:
                src = tensors[p.name].reshape(-1)
                out[lo - a : hi - a].copy_(src[lo - off : hi - off])
        return out

    def range(self, layout: FlatLayout, lo: int, hi: int) -> tuple[int, int]:
        """The slice [a, b) of this slot's buffer that parameter elements [lo, hi) own. `lo`
        and `hi` must be chunk boundaries (see the module's comment)."""
        if (lo, hi) == (0, layout.numel):
            return 0, self.numel(layout)
        if self.block <= 0:
            raise ValueError(f"slot {self.name!r} has no ranges: its optimizer must set align = 0")
        return self._at(layout, lo), self._at(layout, hi)

    def _at(self, layout: FlatLayout, i: int) -> int:
        at = 0
        for p in layout.slots:
            if i <= p.offset:
                return at
            if i < p.offset + p.numel:
                return at + (i - p.offset) // self.block
            at += self.param_numel(p)
        return at


class FlatOptimizer(ABC):
    """An optimizer over one segment's flat state. Subclasses set `name`, `slots` and `align`
    and implement `update_range`; the step counters stay per weight-decay group (as
    `FlatLayout.groups()` lists them) and are advanced by the caller after the last range
    (`advance`). Built from the run's `OptimConfig` (tierlm.optim.build.build_flat_optimizer)."""

    name: str = ""
    slots: tuple[StateSlot, ...] = ()
    align: int = 1  # see the module's comment; 0: whole segments only
    # CPU update time per parameter relative to fused fp32 AdamW (the planner's CPU-update time
    # is the hardware profile's AdamW rate times this), from bench/optimizer_update.py
    cpu_cost: float = 1.0

    def __init__(self, cfg) -> None:  # cfg: tierlm.config.OptimConfig
        self.cfg = cfg

    def chunk_ranges(self, layout: FlatLayout, chunk_numel: int) -> list[tuple[int, int]]:
        """(first element, length) of the chunks a disk-tier update of this segment takes, at
        most `chunk_numel` elements each, cut where the slots can be cut (module comment)."""
        n = layout.numel
        if self.align == 0 or n <= chunk_numel:
            return [(0, n)]
        if self.align == 1:
            return [(lo, min(chunk_numel, n - lo)) for lo in range(0, n, chunk_numel)]
        if chunk_numel < self.align:
            raise ValueError(f"a chunk of {chunk_numel} elements is smaller than optimizer "
                             f"{self.name}'s alignment {self.align}: raise staging_chunk_numel")
        out, lo = [], 0
        while lo < n:
            cut = min(lo + chunk_numel, n)
            for p in layout.slots:
                if p.offset < cut < p.offset + p.numel:  # inside p: back to a multiple of align
                    inside = p.offset + (cut - p.offset) // self.align * self.align
                    cut = inside if inside > lo else p.offset
                    break
            if cut <= lo:  # cannot happen: chunk_numel >= align keeps one aligned cut above lo
                raise AssertionError(f"no chunk boundary after {lo}")
            out.append((lo, cut - lo))
            lo = cut
        return out

    def state_numel(self, layout: FlatLayout) -> dict[str, int]:
        return {s.name: s.numel(layout) for s in self.slots}

    def state_nbytes(self, layout: FlatLayout) -> int:
        """Optimizer-state bytes of one segment (master and gradient not included)."""
        return sum(s.nbytes(layout) for s in self.slots)

    def init_slot(self, slot: StateSlot, layout: FlatLayout, buf: torch.Tensor) -> None:
        """Fill a new slot buffer (whole segment). Zeros unless an optimizer says otherwise."""
        buf.zero_()

    @abstractmethod
    def update_range(
        self,
        layout: FlatLayout,
        lo: int,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        steps: list[torch.Tensor],
        lr: float,
    ) -> None:
        """One step on parameter elements [lo, lo + master.numel()) of a segment: `master` and
        `grad` are that range (fp32, grad already clipped), `state[slot]` each slot's matching
        range (`StateSlot.range`). `steps[g]` is group g's counter before this step; use
        `count + 1` without advancing it (other ranges of the same step follow)."""


def params_in(layout: FlatLayout, lo: int, hi: int) -> list[tuple[ParamSlot, int, int]]:
    """(parameter, a, b): the parameters elements [lo, hi) touch, each with the part [a, b) of
    it (in flat element indices) that lies inside the range."""
    out = []
    for p in layout.slots:
        a, b = max(p.offset, lo), min(p.offset + p.numel, hi)
        if a < b:
            out.append((p, a, b))
    return out


def advance(steps: list[torch.Tensor]) -> None:
    """Count one optimizer step on every group (after `update_range` covered the segment)."""
    for step in steps:
        step.add_(1)


def new_step_counter(device: torch.device | None = None) -> torch.Tensor:
    """The per-group step count, as torch's optimizers keep it (fp32 scalar), in host memory
    whatever `device` the segment's state lives on: every update reads the count on the host
    (bias corrections, Adafactor's rho, GaLore's refresh), and reading a device copy would wait
    for the device's whole queue. Only the optimizer (`advance`) and a checkpoint restore write
    it; torch's fused kernels get a device copy made from it (`device_steps`)."""
    return torch.zeros((), dtype=torch.float32)


def step_count(counter: torch.Tensor) -> float:
    """The steps `counter` (a `new_step_counter`) has counted, read from host memory."""
    if counter.device.type != "cpu":
        raise ValueError(f"a step counter on {counter.device}: reading it would wait for the "
                         "device; counters live in host memory (new_step_counter)")
    return counter.item()


def device_steps(step: torch.Tensor, device: torch.device, n: int = 1) -> list[torch.Tensor]:
    """`n` copies of a step counter on `device`, for torch's fused kernels to advance (the
    counter itself is advanced by `advance`). A host counter reaches a device as a fill of its
    value: no copy from host memory, which would block until the device's queue drained."""
    if step.device == device:
        return [step.clone() for _ in range(n)]
    return [torch.full((), step_count(step), dtype=step.dtype, device=device) for _ in range(n)]
