"""Runs of a segment's ops that are not the step's own: a recompute (the forward ran these ops
already and recorded what it records) and the dynamic policy's probe on random inputs.

Per-op statistics a layer keeps (the fp8 scaling's amax and counts, tierlm.precision.scaling)
must count neither: `recording_paused()` marks such a run and `recording_is_paused()` is what a
layer asks. The flag lives here, with the policies that re-run ops, so the dependency runs one way:
precision/ asks activations/ (the layer below it), activations/ knows nothing of fp8."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# Open `recording_paused()` blocks. Process-wide, not per thread: a recompute may run in the
# autograd engine's device thread while the step that started it waits for it.
_paused = 0


@contextlib.contextmanager
def recording_paused() -> Iterator[None]:
    """Compute as usual, record no statistics: a recompute (its forward recorded these tensors
    already; recording again would count them twice, and add ops that selective checkpointing's
    replay refuses, having not seen them in the forward) and the dynamic activation policy's
    probe (random inputs must not move the scales)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def recording_is_paused() -> bool:
    """Whether a `recording_paused()` block is open (in any thread)."""
    return _paused > 0
