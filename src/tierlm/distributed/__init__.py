"""Data-parallel and sharded training over torch.distributed (ARCHITECTURE.md section 7).

Kept import-light: `tierlm.plan.checks` validates the distributed section through
`tierlm.distributed.checks` before anything has imported torch (so `tierlm --help` and a bad
flag answer at once). The names below are therefore loaded on first use, not when the package
is imported."""

from importlib import import_module
from typing import Any

_HOMES = {"NO_SYNC": "sync", "DelayedSync": "delayed", "DenseSync": "sync", "TopKSync": "topk",
          "World": "world"}

__all__ = ["NO_SYNC", "DelayedSync", "DenseSync", "TopKSync", "World"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
