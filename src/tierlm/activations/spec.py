"""From `--grad-checkpointing` and its per-segment overrides to one policy name per segment.

`--grad-checkpointing` values: `none` (no checkpointing: segments whose weights stay on the
device keep their graph; a streamed segment keeps its graph too where the device budget left by
the placement holds it, else recomputes from its boundary input, or holds its saved tensors in
host RAM with `--activations.dynamic_fallback offload`: `keep_streamed`), `full`, `selective`,
`offload` (every segment), `dynamic` (chosen per segment under the device budget, see
`dynamic.py`). Overrides pin single segments: comma-separated `pattern=policy` pairs, the pattern
a regex matched against the whole segment name (`embed`, `block.N`), the policy one of keep,
selective, full, offload; the last matching pair wins. The head is not a choice: its forward and
backward run back to back, chunk by chunk, so it always keeps; `head=keep` is accepted.
"""

from __future__ import annotations

from tierlm.activations.dynamic import SegmentCosts, activation_peak_bytes, choose_policies
from tierlm.activations.overrides import parse_overrides


def pinned_policies(names: list[str], overrides: str | None) -> list[str | None]:
    """The override for each segment, or None where no pattern matches."""
    rules = parse_overrides(overrides)
    out: list[str | None] = []
    for name in names:
        chosen = None
        for pattern, policy in rules:
            if pattern.fullmatch(name):
                chosen = policy
        out.append(chosen)
    return out


def base_policies(policy: str, resident: list[bool]) -> list[str]:
    """Per-segment policy for a fixed `--grad-checkpointing` value (not `dynamic`); `none`'s
    streamed segments recompute here (the planner's rule until it chooses per segment; the
    engine's own rule for `none` is `keep_streamed`)."""
    if policy == "none":
        return ["keep" if r else "full" for r in resident]
    return [policy] * len(resident)


def keep_streamed(
    costs: list[SegmentCosts] | None,
    pinned: list[str | None],
    resident: list[bool],
    budget_bytes: int | None,
    *,
    fallback: str,
    in_flight: int,
    head_bytes: int,
) -> list[str]:
    """`--grad-checkpointing none` without the planner: resident segments keep their graph;
    a streamed segment keeps its graph too (its weights leave the device and come back for its
    backward, which then runs without a recompute: tierlm.activations.policies) where the
    device budget left by the placement holds its saved tensors, chosen last segment first as
    `dynamic` does (its backward comes first, so it holds them the shortest); the others take
    `fallback` (`full`: recompute, or `offload`: hold them in host RAM). No budget (a CPU run):
    every segment keeps. Overrides (`pinned`) win."""
    policies = [p or ("keep" if r or budget_bytes is None else fallback)
                for p, r in zip(pinned, resident, strict=True)]
    if budget_bytes is None or costs is None:
        return policies
    for s in reversed(range(len(policies))):
        if pinned[s] is not None or policies[s] == "keep":
            continue
        trial = policies[:s] + ["keep"] + policies[s + 1:]
        if activation_peak_bytes(trial, costs, in_flight=in_flight,
                                 head_bytes=head_bytes) <= budget_bytes:
            policies = trial
    return policies


def dynamic_reserve_bytes(
    policy: str, costs: list[SegmentCosts] | None, *, fallback: str, in_flight: int,
    head_bytes: int, boundary_bytes: int = 0,
) -> int:
    """Device bytes `dynamic` needs at least (every segment on the fallback), reserved in the
    placement before model state is placed; 0 for the fixed policies. `boundary_bytes`: see
    `activation_peak_bytes`."""
    if policy != "dynamic" or costs is None:
        return 0
    return activation_peak_bytes(
        [fallback] * len(costs), costs, in_flight=in_flight, head_bytes=head_bytes,
        boundary_bytes=boundary_bytes,
    )


def resolve_policies(
    policy: str,
    overrides: str | None,
    names: list[str],
    resident: list[bool],
    *,
    fallback: str = "full",
    costs: list[SegmentCosts] | None = None,
    budget_bytes: int | None = None,
    in_flight: int = 1,
    head_bytes: int = 0,
    boundary_bytes: int = 0,
    planned: bool = False,
) -> list[str]:
    """One policy name per segment (the head excluded): overrides first, then `dynamic`'s
    budget rule, `none`'s (`keep_streamed`; `planned`: the planner's, `base_policies`) or the
    fixed policy."""
    pinned = pinned_policies(names, overrides)
    if policy == "none" and not planned:
        return keep_streamed(costs, pinned, resident, budget_bytes, fallback=fallback,
                             in_flight=in_flight, head_bytes=head_bytes)
    if policy == "dynamic":
        if costs is None:
            raise ValueError("dynamic needs the measured segment costs")
        return choose_policies(
            costs, pinned, budget_bytes, fallback=fallback, in_flight=in_flight,
            head_bytes=head_bytes, boundary_bytes=boundary_bytes,
        )
    base = base_policies(policy, resident)
    return [p or b for p, b in zip(pinned, base, strict=True)]
