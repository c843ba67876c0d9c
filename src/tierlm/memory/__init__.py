"""Mechanism: tiers, the ledger, flat layouts, the store, disk I/O, the placement record."""

from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import PlacementError, SegmentPlacement
from tierlm.memory.store import Store
from tierlm.memory.tiers import Link, TensorClass, Tier

__all__ = [
    "Ledger",
    "Link",
    "PlacementError",
    "SegmentPlacement",
    "Store",
    "TensorClass",
    "Tier",
]
