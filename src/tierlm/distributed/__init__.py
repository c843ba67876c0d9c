"""Data-parallel and sharded training over torch.distributed (ARCHITECTURE.md section 7).

Kept import-light: the runtime imports `tierlm.distributed.sync` for its gradient hook."""

from tierlm.distributed.sync import NO_SYNC, DelayedSync, DenseSync, TopKSync
from tierlm.distributed.world import World

__all__ = ["NO_SYNC", "DelayedSync", "DenseSync", "TopKSync", "World"]
