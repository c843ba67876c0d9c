"""The ledger: bytes per tier and tensor class (current and peak) and bytes moved per link.

Every managed allocation and every move goes through `Store`, which reports here; the trainer
logs `snapshot()` each step and the planner's predictions are checked against it. Updates come
from the training thread and the update worker, hence the lock.

Pinned host buffers (tierlm.memory.arena) are counted twice: in the host tier by their bytes, as
every buffer, and in a pinned dimension of their own by their footprint in the arena (whole
4 KiB units), per tensor class, current and peak: what RAM the run locks for PCIe copies.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from tierlm.memory.arena import footprint_bytes
from tierlm.memory.tiers import Link, TensorClass, Tier


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current_bytes: dict[tuple[Tier, TensorClass], int] = defaultdict(int)
        self.peak_tier_bytes: dict[Tier, int] = defaultdict(int)
        self.step_peak_tier_bytes: dict[Tier, int] = defaultdict(int)
        self.peak_class_bytes: dict[tuple[Tier, TensorClass], int] = defaultdict(int)
        self.moved_bytes: dict[Link, int] = defaultdict(int)  # since the last reset_step
        self.moved_s: dict[Link, float] = defaultdict(float)
        self.total_moved_bytes: dict[Link, int] = defaultdict(int)
        # Activations per segment (tierlm.activations): "boundary" inputs (also in the tier
        # totals, class ACTIVATION), "saved" tensors held on the device until the backward,
        # "offloaded" saved tensors held on the host, "workspace" materialised for a backward
        # (a recompute, or saved tensors brought back). Saved and workspace bytes are not managed
        # buffers, so they stay out of the tier totals the placement budgets; the device total
        # below adds them.
        self.activation_bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.step_activation_peak: dict[tuple[str, str], int] = defaultdict(int)
        self.kind_bytes: dict[str, int] = defaultdict(int)  # all segments together
        self.step_kind_peak: dict[str, int] = defaultdict(int)
        self.device_activation_bytes = 0  # saved + workspace on the device now
        self.peak_device_total_bytes = 0  # device tier + saved + workspace
        self.step_peak_device_total_bytes = 0
        self.step_peak_activation_bytes = 0  # boundary + saved + workspace on the device
        # pinned host buffers by class: arena footprints (also in the host tier by their bytes)
        self.pinned_class_bytes: dict[TensorClass, int] = defaultdict(int)
        self.pinned_class_peak_bytes: dict[TensorClass, int] = defaultdict(int)
        self.pinned_peak_bytes = 0
        self.step_pinned_peak_bytes = 0

    @property
    def pinned_bytes(self) -> int:
        """Pinned host bytes held now (arena footprints)."""
        return sum(self.pinned_class_bytes.values())

    def tier_bytes(self, tier: Tier) -> int:
        return sum(v for (t, _), v in self.current_bytes.items() if t == tier)

    def allocate(self, tier: Tier, cls: TensorClass, nbytes: int, *, pinned: bool = False
                 ) -> None:
        """`pinned`: a host buffer from the pinned arena (counted in the pinned class too)."""
        with self._lock:
            if pinned:
                self._pin(tier, cls, footprint_bytes(nbytes))
            self.current_bytes[(tier, cls)] += nbytes
            total = self.tier_bytes(tier)
            self.peak_tier_bytes[tier] = max(self.peak_tier_bytes[tier], total)
            self.step_peak_tier_bytes[tier] = max(self.step_peak_tier_bytes[tier], total)
            key = (tier, cls)
            self.peak_class_bytes[key] = max(self.peak_class_bytes[key], self.current_bytes[key])
            if tier == Tier.DEVICE:
                self._observe_device(total)

    def release(self, tier: Tier, cls: TensorClass, nbytes: int, *, pinned: bool = False
                ) -> None:
        with self._lock:
            if pinned:
                self.pinned_class_bytes[cls] -= footprint_bytes(nbytes)
                if self.pinned_class_bytes[cls] < 0:
                    raise AssertionError(f"ledger underflow for pinned {cls}")
            self.current_bytes[(tier, cls)] -= nbytes
            if self.current_bytes[(tier, cls)] < 0:
                raise AssertionError(f"ledger underflow for {tier}/{cls}")

    def _pin(self, tier: Tier, cls: TensorClass, footprint: int) -> None:
        if tier != Tier.HOST:
            raise ValueError(f"only host buffers are pinned, not {tier} {cls}")
        self.pinned_class_bytes[cls] += footprint
        self.pinned_class_peak_bytes[cls] = max(self.pinned_class_peak_bytes[cls],
                                                self.pinned_class_bytes[cls])
        total = self.pinned_bytes
        self.pinned_peak_bytes = max(self.pinned_peak_bytes, total)
        self.step_pinned_peak_bytes = max(self.step_pinned_peak_bytes, total)

    def record_move(self, link: Link, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.moved_bytes[link] += nbytes
            self.moved_s[link] += seconds
            self.total_moved_bytes[link] += nbytes

    def add_move_seconds(self, link: Link, seconds: float) -> None:
        """Time the device measured for copies whose bytes `record_move` counted earlier (an
        asynchronous copy is timed by its own events once it has run)."""
        with self._lock:
            self.moved_s[link] += seconds

    def reset_step(self) -> None:
        """Start a new step's counters: bytes moved and the per-step peaks."""
        with self._lock:
            self.moved_bytes.clear()
            self.moved_s.clear()
            self.step_peak_tier_bytes = defaultdict(int)
            for tier in Tier:
                self.step_peak_tier_bytes[tier] = self.tier_bytes(tier)
            self.step_activation_peak = defaultdict(int, self.activation_bytes)
            self.step_kind_peak = defaultdict(int, self.kind_bytes)
            self.step_peak_device_total_bytes = 0
            self.step_peak_activation_bytes = 0
            self.step_pinned_peak_bytes = self.pinned_bytes
            self._observe_device(self.tier_bytes(Tier.DEVICE))

    # -- activations ----

    _DEVICE_EXTRA = ("saved", "workspace")  # device activation kinds outside the tier totals

    def hold_activation(self, segment: str, kind: str, nbytes: int) -> None:
        with self._lock:
            key = (segment, kind)
            self.activation_bytes[key] += nbytes
            self.step_activation_peak[key] = max(
                self.step_activation_peak[key], self.activation_bytes[key]
            )
            self.kind_bytes[kind] += nbytes
            self.step_kind_peak[kind] = max(self.step_kind_peak[kind], self.kind_bytes[kind])
            if kind in self._DEVICE_EXTRA:
                self.device_activation_bytes += nbytes
                self._observe_device(self.tier_bytes(Tier.DEVICE))

    def release_activation(self, segment: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self.activation_bytes[(segment, kind)] -= nbytes
            if self.activation_bytes[(segment, kind)] < 0:
                raise AssertionError(f"ledger underflow for {segment}/{kind} activations")
            self.kind_bytes[kind] -= nbytes
            if kind in self._DEVICE_EXTRA:
                self.device_activation_bytes -= nbytes

    def _observe_device(self, device_tier_bytes: int) -> None:
        total = device_tier_bytes + self.device_activation_bytes
        self.peak_device_total_bytes = max(self.peak_device_total_bytes, total)
        self.step_peak_device_total_bytes = max(self.step_peak_device_total_bytes, total)
        acts = self.current_bytes.get((Tier.DEVICE, TensorClass.ACTIVATION), 0)
        self.step_peak_activation_bytes = max(
            self.step_peak_activation_bytes, acts + self.device_activation_bytes
        )

    def segment_activations(self) -> dict[str, dict[str, int]]:
        """This step's peak activation bytes per segment and kind (the planner's input)."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (segment, kind), nbytes in self.step_activation_peak.items():
                out.setdefault(segment, {})[kind] = nbytes
            return out

    def snapshot(self) -> dict[str, Any]:
        """Flat, JSON-ready view for metrics.jsonl."""
        with self._lock:
            out: dict[str, Any] = {}
            for tier in Tier:
                out[f"{tier}_bytes"] = self.tier_bytes(tier)
                out[f"{tier}_peak_bytes"] = self.peak_tier_bytes[tier]
                out[f"{tier}_step_peak_bytes"] = self.step_peak_tier_bytes[tier]
            for link in Link:
                nbytes = self.moved_bytes[link]
                seconds = self.moved_s[link]
                out[f"{link}_bytes"] = nbytes
                out[f"{link}_Bps"] = nbytes / seconds if seconds > 0 else None
            out["host_pinned_bytes"] = self.pinned_bytes
            out["host_pinned_peak_bytes"] = self.pinned_peak_bytes
            out["host_pinned_step_peak_bytes"] = self.step_pinned_peak_bytes
            out["device_total_step_peak_bytes"] = self.step_peak_device_total_bytes
            out["activation_step_peak_bytes"] = self.step_peak_activation_bytes
            for kind in ("saved", "offloaded", "workspace"):
                out[f"{kind}_activation_step_peak_bytes"] = self.step_kind_peak[kind]
            return out
