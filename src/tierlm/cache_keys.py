"""Keys for what tierlm caches between runs and clones (trained tokenizers, encoded corpora,
inductor kernels).

An entry is a function of its inputs *and* of the code that produced it: the libraries that ran
(a tokenizers release can split the same text into other ids; a torch release compiles other
kernels) and tierlm's own producing module(s). `producer_key` folds both into a short hex string
that each cache puts into its entries' names, so an upgrade or a code change misses the cache
instead of reusing a stale entry (a warm machine must give the same token ids as CI's cold one).
Imports nothing from tierlm: every layer may use it.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata
from pathlib import Path
from types import ModuleType

# the libraries whose releases change what the caches hold: kernels (torch), token ids
# (tokenizers, and transformers' fast-tokenizer wrapper around it)
LIBRARIES = ("torch", "tokenizers", "transformers")


@functools.cache
def library_versions() -> tuple[tuple[str, str], ...]:
    """(name, installed version) of each of LIBRARIES; "none" where one is not installed."""
    versions = []
    for name in LIBRARIES:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            versions.append((name, "none"))
    return tuple(versions)


@functools.cache
def source_digest(*module_files: str) -> str:
    """sha256 of the source files (bytes) of the producing modules, in the order given."""
    digest = hashlib.sha256()
    for file in module_files:
        data = Path(file).read_bytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def producer_key(*producers: ModuleType) -> str:
    """16 hex digits naming the library versions and the source of `producers` (the modules
    whose code produced a cache entry)."""
    digest = hashlib.sha256()
    for name, version in library_versions():
        digest.update(f"{name}={version}\0".encode())
    digest.update(source_digest(*(str(m.__file__) for m in producers)).encode())
    return digest.hexdigest()[:16]
