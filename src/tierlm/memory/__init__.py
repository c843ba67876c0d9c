"""Mechanism: tiers, the ledger, flat layouts, the store, disk I/O; and placement policy."""

from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import PlacementError, SegmentPlacement, place
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
    "place",
]
