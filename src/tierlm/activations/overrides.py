"""The `--activations.overrides` syntax and the policy names it may use.

Torch-free on purpose: `tierlm.plan.checks` validates the flag (`check_overrides`) before anything
has imported torch (`tierlm --help` and a bad flag answer at once); `spec.py` resolves the parsed
rules per segment.
"""

from __future__ import annotations

import re

from tierlm.config import ActivationConfig, ConfigError

POLICY_NAMES = ("keep", "selective", "full", "offload")
HEAD = "head"


def parse_overrides(text: str | None) -> list[tuple[re.Pattern[str], str]]:
    """'block.[0-3]=full,head=keep' -> [(pattern, policy)]; ValueError says what is wrong."""
    if not text or not text.strip():
        return []
    out = []
    for item in text.split(","):
        pattern, sep, policy = item.strip().rpartition("=")
        policy = policy.strip()
        if not sep or not pattern.strip():
            raise ValueError(f"{item.strip()!r} is not pattern=policy")
        if policy not in POLICY_NAMES:
            raise ValueError(
                f"{item.strip()!r}: unknown policy {policy!r}; use one of {', '.join(POLICY_NAMES)}"
            )
        try:
            compiled = re.compile(pattern.strip())
        except re.error as exc:
            raise ValueError(f"{pattern.strip()!r} is not a regex: {exc}") from None
        if compiled.fullmatch(HEAD) and policy != "keep":
            raise ValueError(
                f"{item.strip()!r}: the head computes its loss and gradient in one pass, chunk by "
                "chunk; it always keeps"
            )
        out.append((compiled, policy))
    return out


def check_overrides(activations: ActivationConfig) -> None:
    """The config check of `--activations.overrides`: a ConfigError naming the flag."""
    try:
        parse_overrides(activations.overrides)
    except ValueError as exc:
        raise ConfigError(f"--activations.overrides: {exc}") from None
