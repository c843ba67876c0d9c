"""From `--grad-checkpointing` and its per-segment overrides to one policy name per segment.

`--grad-checkpointing` values: `none` (no checkpointing: segments whose weights stay on the
device keep their graph; streamed segments recompute from their boundary input, since the device
holds neither their weights nor, usually, room for their activations), `full`, `selective`,
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
    """Per-segment policy for a fixed `--grad-checkpointing` value (not `dynamic`)."""
    if policy == "none":
        return ["keep" if r else "full" for r in resident]
    return [policy] * len(resident)


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
) -> list[str]:
    """One policy name per segment (the head excluded): overrides first, then `dynamic`'s
    budget rule or the fixed policy."""
    pinned = pinned_policies(names, overrides)
    if policy == "dynamic":
        if costs is None:
            raise ValueError("dynamic needs the measured segment costs")
        return choose_policies(
            costs, pinned, budget_bytes, fallback=fallback, in_flight=in_flight,
            head_bytes=head_bytes, boundary_bytes=boundary_bytes,
        )
    base = base_policies(policy, resident)
    return [p or b for p, b in zip(pinned, base, strict=True)]
