"""Where tierlm keeps files between runs: below every package, so that memory/ (the probe's
results) and train/ (tokenizers, encoded corpora, compiled kernels) read the same place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where trained tokenizers and encoded corpora are kept between runs
    ($TIERLM_CACHE overrides)."""
    env = os.environ.get("TIERLM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tierlm"
