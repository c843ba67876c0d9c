"""Activation memory: per-segment checkpoint / offload policies and their byte accounting
(ARCHITECTURE.md section 6).

The names below load on first use, not when the package is imported: `tierlm.plan.checks` checks
`--activations.overrides` through the torch-free `tierlm.activations.overrides` before anything
has imported torch (so `tierlm --help` and a bad flag answer at once)."""

from importlib import import_module
from typing import Any

_HOMES = {
    "chunked_cross_entropy": "chunked_loss",
    "default_chunk_tokens": "chunked_loss",
    "SegmentCosts": "dynamic",
    "activation_peak_bytes": "dynamic",
    "choose_policies": "dynamic",
    "head_workspace_bytes": "dynamic",
    "probe_costs": "dynamic",
    "probe_inputs": "dynamic",
    "POLICY_NAMES": "overrides",
    "parse_overrides": "overrides",
    "ActivationPolicy": "policies",
    "Full": "policies",
    "Keep": "policies",
    "Offload": "policies",
    "PolicyFactory": "policies",
    "RunScope": "policies",
    "Selective": "policies",
    "SavedTensorScope": "saved",
    "WeightRef": "saved",
    "storages_of": "saved",
    "base_policies": "spec",
    "dynamic_reserve_bytes": "spec",
    "pinned_policies": "spec",
    "resolve_policies": "spec",
}

__all__ = [
    "POLICY_NAMES",
    "ActivationPolicy",
    "Full",
    "Keep",
    "Offload",
    "PolicyFactory",
    "RunScope",
    "SavedTensorScope",
    "SegmentCosts",
    "Selective",
    "WeightRef",
    "activation_peak_bytes",
    "chunked_cross_entropy",
    "default_chunk_tokens",
    "base_policies",
    "choose_policies",
    "dynamic_reserve_bytes",
    "head_workspace_bytes",
    "parse_overrides",
    "pinned_policies",
    "probe_costs",
    "probe_inputs",
    "resolve_policies",
    "storages_of",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)
