"""Outside implementations the tests compare ours with (torchao, galore-torch, datasets).

They are dev extras (pyproject.toml), so a plain `pytest` without them skips the comparison;
under `make test` (and so CI) TIERLM_REQUIRE_COMPARISONS=1 is set and a missing package fails
the test instead: a comparison that silently skips checks nothing."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

REQUIRED_ENV = "TIERLM_REQUIRE_COMPARISONS"


def comparison_module(name: str) -> ModuleType:
    """`import name`; when it cannot be imported: skip, or fail where comparisons are required."""
    if os.environ.get(REQUIRED_ENV) != "1":
        return pytest.importorskip(name)
    try:
        return __import__(name, fromlist=["_"])
    except ImportError as err:
        missing = err
    pytest.fail(f"{name} is required for this comparison ({REQUIRED_ENV}=1): {missing}; install "
                f"the dev extras (pip install -e '.[dev]')", pytrace=False)
