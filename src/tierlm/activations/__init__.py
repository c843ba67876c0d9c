"""Activation memory: per-segment checkpoint / offload policies and their byte accounting
(ARCHITECTURE.md section 6)."""

from tierlm.activations.chunked_loss import chunked_cross_entropy, default_chunk_tokens
from tierlm.activations.dynamic import (
    SegmentCosts,
    activation_peak_bytes,
    choose_policies,
    head_workspace_bytes,
    probe_costs,
)
from tierlm.activations.policies import (
    POLICY_NAMES,
    ActivationPolicy,
    Full,
    Keep,
    Offload,
    PolicyFactory,
    RunScope,
    Selective,
)
from tierlm.activations.saved import SavedTensorScope, WeightRef, storages_of
from tierlm.activations.spec import (
    base_policies,
    dynamic_reserve_bytes,
    parse_overrides,
    pinned_policies,
    resolve_policies,
)

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
    "resolve_policies",
    "storages_of",
]
