"""Cross-entropy over a large vocabulary without the (tokens x vocab) logits.

The full logits of a step are tokens x vocab x 4 bytes (4 x 1024 tokens at vocab 32000: 0.5 GiB),
and autograd keeps their log-softmax and builds their gradient as well. Here the tokens are cut
into chunks: each chunk's logits, loss and gradient are computed and released before the next
chunk starts, so at most one chunk's worth exists at any time. The gradient reaches the hidden
states and the output projection's weights through autograd, accumulated over chunks, and the
loss is the same sum over all trained tokens (targets equal to -100 are skipped, as
F.cross_entropy skips them) over the same divisor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tierlm.activations.saved import SavedTensorScope
from tierlm.data.batch import IGNORE_INDEX, local_divisor
from tierlm.memory.ledger import Ledger


def default_chunk_tokens(vocab: int, logits_per_chunk: int = 1 << 24) -> int:
    """Tokens per chunk: ~16M logits (64 MiB in fp32) whatever the vocabulary."""
    return max(1, logits_per_chunk // vocab)


def sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of a chunk of logits (N, V) in fp32; -100 targets are skipped."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_cross_entropy(
    project: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    divisor: float | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    saved: Callable[[], SavedTensorScope] | None = None,
    ledger: Ledger | None = None,
    segment: str = "head",
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `project(h)` (logits) against `targets` over `divisor`;
    backpropagates it into whatever `h` and `project` depend on and returns its value, a 0-dim
    fp64 tensor on `h`'s device (the chunks' fp32 losses summed in fp64, as Python floats
    would be): reading each chunk's value on the host would wait for the device per chunk, so
    the caller reads the sum once, when it needs it.

    `h`: (N, D) hidden states, a tensor requiring grad; `targets`: (N,) token ids, -100 where
    the loss does not look. `divisor`: None, the trained targets here (the mean); a step of
    several micro-batches passes the step's trained-token count, so that the micro-batches'
    gradients add up to that of the step's mean over all its tokens (tierlm.data.batch).
    `saved`/`ledger`: count each chunk's saved tensors in the ledger while the chunk lives.
    `loss_of(logits, targets)`: the chunk's summed loss (None: fp32 F.cross_entropy; --compile
    segments passes its compiled form, tierlm.runtime.compile).
    """
    loss_of = loss_of or sum_cross_entropy
    if divisor is None:
        divisor = local_divisor(int((targets != IGNORE_INDEX).sum()))
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for c0 in range(0, targets.numel(), chunk_tokens):
        scope = saved() if saved is not None else None
        with torch.enable_grad():
            with scope.hooks() if scope is not None else contextlib.nullcontext():
                with autocast():
                    logits = project(h[c0 : c0 + chunk_tokens])  # (chunk, V)
                loss = loss_of(logits, targets[c0 : c0 + chunk_tokens]) / divisor
                del logits  # the loss saved its log-softmax; the logits can go now
            held = scope.bytes if scope is not None and ledger is not None else 0
            if held:
                ledger.hold_activation(segment, "saved", held)
            loss.backward()
        if held:
            ledger.release_activation(segment, "saved", held)
        total += loss.detach()
    return total
