"""`--grad-checkpointing dynamic`: a policy per segment under the device budget.

The budget rule (until the planner chooses activation policies itself): what the placement
leaves of `--device-budget` is spent on keeping activations, starting from the segment whose
backward comes first (the last block), because its saved tensors are held the shortest time and
keeping them saves the recompute that would come first in the backward. Each segment, last to
first, gets `keep` if the step's predicted activation peak still fits, else `selective`, else
the fallback (`full`, or `offload` with `--activations.dynamic_fallback offload`).

The prediction uses each segment's bytes measured once at setup by running the real policies on
one block with the step's shape (`probe_costs`): what `keep` and `selective` hold from the
forward to the backward, and what `full`, `selective` and `offload` materialise for the backward.
The step's activation peak is the larger of the end of the forward (everything held, plus the
head's chunked loss) and the backward of each segment (what earlier segments still hold, plus its
workspace).

With `--boundary-activations host` (long sequences: every block's input is a (B, S, D) fp32
tensor, 512 MiB for 7B at 32k tokens) the boundary inputs of `full` segments wait in host RAM;
a segment given any other policy holds its input on the device as well (its graph refers to
it), so that input counts in what choosing it costs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tierlm.activations.policies import Keep, RunScope, Selective
from tierlm.activations.rerun import recording_paused
from tierlm.activations.saved import storages_of
from tierlm.memory.layout import FlatLayout
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import PlacementError, gib


@dataclass(frozen=True)
class SegmentCosts:
    """Activation bytes of one segment for one micro-batch, beyond its boundary input."""

    keep_bytes: int  # saved tensors of the whole graph
    selective_bytes: int  # matmul and attention outputs kept by `selective`
    selective_workspace_bytes: int  # what selective's re-run adds in the backward

    def held(self, policy: str) -> int:
        return {"keep": self.keep_bytes, "selective": self.selective_bytes}.get(policy, 0)

    def workspace(self, policy: str) -> int:
        return {
            "keep": 0,
            "selective": self.selective_workspace_bytes,
            "full": self.keep_bytes,  # the re-run saves what a kept graph would
            "offload": self.keep_bytes,  # everything comes back for the backward
        }[policy]


def head_workspace_bytes(chunk_tokens: int, vocab: int, tokens: int, hidden: int) -> int:
    """The head's activations at their peak, a bound: the normed hidden state and its gradient,
    and per loss chunk the logits, their log-softmax (saved) and its gradient (fp32)."""
    return 2 * tokens * hidden * 4 + 3 * min(chunk_tokens, tokens) * vocab * 4


def activation_peak_bytes(
    policies: list[str], costs: list[SegmentCosts], *, in_flight: int, head_bytes: int,
    boundary_bytes: int = 0,
) -> int:
    """Predicted device peak of saved tensors and workspace over one step (boundary
    activations are reserved by the placement). `boundary_bytes`: with boundary activations
    parked on the host (`--boundary-activations host`), one micro-batch's boundary input,
    which every segment after the first (embed takes token ids) that does not recompute from
    it (`full`) holds on the device until its backward, since its graph refers to it."""
    held = [in_flight * (c.held(p) + (boundary_bytes if s and p != "full" else 0))
            for s, (p, c) in enumerate(zip(policies, costs, strict=True))]
    peak = sum(held) + head_bytes
    below = 0
    for p, c, h in zip(policies, costs, held, strict=True):
        below += h
        peak = max(peak, below + c.workspace(p))
    return peak


def choose_policies(
    costs: list[SegmentCosts],
    pinned: list[str | None],
    budget_bytes: int | None,
    *,
    fallback: str,
    in_flight: int,
    head_bytes: int,
    boundary_bytes: int = 0,
) -> list[str]:
    """Per-segment policies, last segment first, within `budget_bytes` (None: keep all).
    `boundary_bytes`: as `activation_peak_bytes` takes it (boundaries parked on the host)."""
    policies = [p or fallback for p in pinned]
    if budget_bytes is None:
        return [p or "keep" for p in pinned]

    def peak(ps: list[str]) -> int:
        return activation_peak_bytes(ps, costs, in_flight=in_flight, head_bytes=head_bytes,
                                     boundary_bytes=boundary_bytes)

    if peak(policies) > budget_bytes:
        raise PlacementError(
            f"--grad-checkpointing dynamic: activations need at least {gib(peak(policies))} "
            f"(every segment {fallback}) but the device budget leaves {gib(budget_bytes)}; raise "
            "--device-budget, or lower --batch-size or --seq-len"
        )
    for s in reversed(range(len(costs))):
        if pinned[s] is not None:
            continue
        for candidate in ("keep", "selective"):
            trial = policies[:s] + [candidate] + policies[s + 1 :]
            if peak(trial) <= budget_bytes:
                policies = trial
                break
    return policies


def probe_costs(
    segments: list,
    layouts: list[FlatLayout],
    weights: Callable[[Any], Mapping[str, torch.Tensor]],
    context: Callable[[torch.Tensor, torch.Tensor], object],
    *,
    device: torch.device,
    batch_size: int,
    seq_len: int,
    hidden_size: int,
    vocab_size: int,
    autocast: Callable,
) -> list[SegmentCosts]:
    """Measure `SegmentCosts` for `embed` and one block by running `Keep` and `Selective` on the
    device with the step's shape; every block has the first one's costs. `segments` excludes
    the head; `weights` gives a segment's initial weights (runtime.state.InitialWeights)."""
    ids, h, ctx = probe_inputs(context, device=device, batch_size=batch_size, seq_len=seq_len,
                               hidden_size=hidden_size, vocab_size=vocab_size)
    with recording_paused():  # random inputs: fp8 layers cast them without moving their scales
        measured = [_measure(segments[i], layouts[i], weights(segments[i]),
                             ids if i == 0 else h, ctx, device, autocast)
                    for i in range(min(2, len(segments)))]
    return measured[:1] + measured[1:] * (len(segments) - 1)


def probe_inputs(context, *, device, batch_size, seq_len, hidden_size, vocab_size):
    """Token ids, a hidden state and their context with the step's shape (seeded)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g).to(device)
    h = torch.randn(batch_size, seq_len, hidden_size, generator=g).to(device)
    return ids, h, context(ids, h)


def _measure(seg, layout: FlatLayout, weights, x, ctx, device, autocast) -> SegmentCosts:
    flat = layout.pack(weights, torch.empty(layout.numel))
    flat = flat.to(device)

    def run(w: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        with autocast():
            return seg.forward(layout.views(w), inp, ctx)

    shared = storages_of(x, ctx)
    kept = Ledger()
    _, graph = Keep().forward(run, flat, x, RunScope(seg.name, kept, shared))
    del graph  # measured; no backward needed
    selective = Ledger()
    scope = RunScope(seg.name, selective, shared)
    sel = Selective()
    out, graph = sel.forward(run, flat, x, scope)
    grad = torch.zeros(layout.numel, device=device)
    sel.backward(graph, run, flat, x, torch.ones_like(out), grad, scope)
    peaks = selective.segment_activations()[seg.name]
    return SegmentCosts(
        kept.activation_bytes[(seg.name, "saved")], peaks["saved"], peaks.get("workspace", 0)
    )
