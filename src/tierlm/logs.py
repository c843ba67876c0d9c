"""Library log lines that say nothing to a tierlm user, filtered by their exact shape.

torchao (a dev extra, for the comparisons in tests/) is imported by transformers whenever it is
installed. On a CPU build of torch it logs one "Failed to load .../_C*.so" warning per CUDA
extension, and registering its enums logs torch's deprecation of `register_constant` on Enum
subclasses. Neither changes what a run computes. Only these shapes are dropped: any other
warning of either library still reaches the user.
"""

from __future__ import annotations

import logging


class _Drop(logging.Filter):
    def __init__(self, *, starts: str, contains: str) -> None:
        super().__init__()
        self.starts = starts
        self.contains = contains

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.starts) and self.contains in message)


_NOISE = {
    "torchao": _Drop(starts="Failed to load ", contains=".so"),
    "torch.utils._pytree": _Drop(starts="<enum ", contains="is an Enum subclass"),
}


def quiet_library_noise() -> None:
    """Install the filters once (idempotent); call before transformers is imported."""
    for name, drop in _NOISE.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)
