"""Selective checkpointing: keep the outputs of matmuls and attention, recompute the rest.

Matmuls and attention are most of a block's FLOPs; norms, rotary embeddings, activations and
residual adds are cheap to recompute but save many tensors. The policy runs through
`torch.utils.checkpoint` with selective-checkpoint contexts: in the forward the caching mode
stores the outputs of the ops listed here, and a dispatch mode beside it counts their bytes (the
policy function sees outputs only on recent torch releases); in the backward the whole segment
is re-run from its boundary input, the stored outputs are returned from the cache and
everything else is recomputed.

The recompute's workspace is what autograd saves while re-running the segment: the outputs the
re-run produces that are still alive when it ends (the checkpoint holds them for the backward),
tracked with weak references to their storages.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tierlm.activations.rerun import recording_paused
from tierlm.activations.saved import storage_bytes, storage_key

aten = torch.ops.aten


def _ops(*names: str) -> set:
    """Overload packets that exist in this torch build (fused attention kernels vary by build)."""
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


SAVED_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _saved(op) -> bool:
    return op.overloadpacket in SAVED_OPS


class _LiveOutputs(TorchDispatchMode):
    """Records the storages of every op output (weakly), to see which survive the re-run.

    `exclude`: storages alive throughout (weights, boundary input, context), by address.
    `cached`: the forward's kept outputs, by identity: the re-run consumes them and may free
    the ones nothing saves, after which their addresses can come back for new tensors."""

    def __init__(self, exclude: set[int], cached: dict[int, weakref.ref]) -> None:
        super().__init__()
        self.exclude = exclude
        self.cached = cached
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                key = storage_key(t)
                if key not in self.exclude:
                    self.storages[key] = weakref.ref(t.untyped_storage())
        return out

    def live_bytes(self) -> int:
        total = 0
        for key, ref in self.storages.items():
            s = ref()
            cached = self.cached.get(key)
            if s is not None and (cached is None or cached() is not s):
                total += s.nbytes()
        return total


class _KeptOutputs(TorchDispatchMode):
    """Hands `hold` the outputs of the ops the policy keeps, as the forward produces them."""

    def __init__(self, hold: Callable[[object], None]) -> None:
        super().__init__()
        self.hold = hold

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _saved(func):
            self.hold(out)
        return out


class SelectiveRun:
    """Selective-checkpoint contexts for one segment run, with the byte counts the ledger needs.

    `held_bytes`: the cached outputs, held from the forward to the backward.
    `workspace_bytes`: what the backward's re-run left alive when it ended; `on_workspace` is
    called with it then.
    """

    def __init__(self, excluded: Callable[[], set[int]], on_workspace: Callable[[int], None]):
        self.excluded = excluded  # storages not counted: weights, boundary input, context
        self.on_workspace = on_workspace
        self.held_bytes = 0
        self.held_count = 0
        self.workspace_bytes = 0
        self._held: dict[int, weakref.ref] = {}

    @staticmethod
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if _saved(op) else CheckpointPolicy.PREFER_RECOMPUTE

    def _hold(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                key = storage_key(t)
                self.held_count += 1
                if key not in self._held:  # cached outputs live until the backward
                    self._held[key] = weakref.ref(t.untyped_storage())
                    self.held_bytes += storage_bytes(t)

    def contexts(self):
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(self.policy)
        return self._counted(forward_ctx), self._measured(recompute_ctx)

    @contextlib.contextmanager
    def _counted(self, forward_ctx):
        with forward_ctx, _KeptOutputs(self._hold):  # ours innermost: it sees each output
            yield

    @contextlib.contextmanager
    def _measured(self, recompute_ctx):
        live = _LiveOutputs(self.excluded(), self._held)
        try:
            # fp8 statistics: the forward recorded them, the replay runs the forward's ops only
            with recompute_ctx, live, recording_paused():
                yield
        finally:
            self.workspace_bytes = live.live_bytes()
            self.on_workspace(self.workspace_bytes)
