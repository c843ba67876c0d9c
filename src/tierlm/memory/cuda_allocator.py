"""The CUDA caching allocator, set for the runtime's pattern.

The tiered runtime frees and reallocates blocks of a few fixed sizes every step (streamed
weights, gradients, activations); with `expandable_segments` the allocator grows one mapping per
stream instead of carving fixed segments, so a freed block of one size serves a request of
another and reserved memory stays close to allocated. The step records reserved against
allocated bytes and the allocator's retries (a retry: a cudaMalloc failed, the cache was freed
and the request tried again; each costs a device synchronisation) in metrics.jsonl
(tierlm.monitor.probes.CudaMemory).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

SETTING = "expandable_segments:True"


def configure_cuda_allocator(device: torch.device, log: Callable[[str], None] = print) -> bool:
    """Turn on expandable segments for a CUDA run, unless PYTORCH_CUDA_ALLOC_CONF says what the
    user wants (then it is left alone). Returns whether the setting was applied."""
    if device.type != "cuda":
        return False
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        log(f"CUDA allocator: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} "
            "(left as set)")
        return False
    torch.cuda.memory._set_allocator_settings(SETTING)
    log(f"CUDA allocator: {SETTING} (set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)")
    return True
