"""SSD wear: what the disk tier's writes cost the drive's rated endurance.

A run whose state spills to disk rewrites that state every step; a consumer NVMe drive is rated
for a few hundred TB written (TBW) over its warranty. The planner and every run turn bytes
written per step into the share of that rating a day of training uses, so a user sees the price
of a small host budget before the drive pays it.
"""

from __future__ import annotations

from dataclasses import dataclass

# A 1-2 TB consumer TLC NVMe drive (e.g. Samsung 990 Pro 1 TB, WD SN850X 1 TB) is rated 600 TBW.
DEFAULT_ENDURANCE_TBW = 600.0
# Warn when a day of training uses more than this share of the rating: at 1% a day the drive's
# rated writes are gone after 100 days of training (a 5-year warranty allows ~0.05% a day).
WARN_SHARE_PER_DAY = 0.01
SECONDS_PER_DAY = 86_400


@dataclass(frozen=True, kw_only=True)
class DiskWear:
    write_bytes_per_step: float
    step_s: float
    endurance_tbw: float = DEFAULT_ENDURANCE_TBW

    @property
    def write_bytes_per_hour(self) -> float:
        return self.write_bytes_per_step * 3600 / self.step_s if self.step_s > 0 else 0.0

    @property
    def share_per_day(self) -> float:
        """The fraction of the drive's rated TBW one day of training writes."""
        return self.write_bytes_per_hour * 24 / (self.endurance_tbw * 1e12)

    @property
    def days_to_rated(self) -> float:
        return 1 / self.share_per_day if self.share_per_day > 0 else float("inf")

    @property
    def too_high(self) -> bool:
        return self.share_per_day > WARN_SHARE_PER_DAY

    def describe(self) -> str:
        line = (
            f"disk writes: {_size(self.write_bytes_per_step)}/step, "
            f"{self.write_bytes_per_hour / 1e12:.3g} TB/hour; a day of training uses "
            f"{self.share_per_day * 100:.3g}% of a {self.endurance_tbw:g} TBW drive's rated "
            "endurance"
        )
        if self.share_per_day > 0:
            line += f" (all of it in {self.days_to_rated:.3g} days)"
        return line

    def warning(self) -> str | None:
        if not self.too_high:
            return None
        return (
            f"WARNING: the disk tier would use {self.share_per_day * 100:.3g}% of the drive's "
            f"rated endurance per day (over {WARN_SHARE_PER_DAY:.0%}); give the host tier more RAM "
            "(--host-budget / --host-memory) so less state lives on disk, or set "
            "--disk-endurance-tbw to your drive's rating"
        )

    def to_json(self) -> dict[str, float]:
        return {
            "write_bytes_per_step": self.write_bytes_per_step,
            "write_bytes_per_hour": self.write_bytes_per_hour,
            "endurance_tbw": self.endurance_tbw,
            "share_per_day": self.share_per_day,
        }


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
