"""The ledger: bytes per tier and tensor class (current and peak) and bytes moved per link.

Every managed allocation and every move goes through `Store`, which reports here; the trainer
logs `snapshot()` each step and the planner's predictions are checked against it. Updates come
from the training thread and the update worker, hence the lock.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

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

    def tier_bytes(self, tier: Tier) -> int:
        return sum(v for (t, _), v in self.current_bytes.items() if t == tier)

    def allocate(self, tier: Tier, cls: TensorClass, nbytes: int) -> None:
        with self._lock:
            self.current_bytes[(tier, cls)] += nbytes
            total = self.tier_bytes(tier)
            self.peak_tier_bytes[tier] = max(self.peak_tier_bytes[tier], total)
            self.step_peak_tier_bytes[tier] = max(self.step_peak_tier_bytes[tier], total)
            key = (tier, cls)
            self.peak_class_bytes[key] = max(self.peak_class_bytes[key], self.current_bytes[key])

    def release(self, tier: Tier, cls: TensorClass, nbytes: int) -> None:
        with self._lock:
            self.current_bytes[(tier, cls)] -= nbytes
            if self.current_bytes[(tier, cls)] < 0:
                raise AssertionError(f"ledger underflow for {tier}/{cls}")

    def record_move(self, link: Link, nbytes: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.moved_bytes[link] += nbytes
            self.moved_s[link] += seconds
            self.total_moved_bytes[link] += nbytes

    def reset_step(self) -> None:
        """Start a new step's counters: bytes moved and the per-step peaks."""
        with self._lock:
            self.moved_bytes.clear()
            self.moved_s.clear()
            self.step_peak_tier_bytes = defaultdict(int)
            for tier in Tier:
                self.step_peak_tier_bytes[tier] = self.tier_bytes(tier)

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
            return out
