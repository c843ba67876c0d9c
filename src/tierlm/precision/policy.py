"""The precision policy: every layer of the model, and the matmul it feeds, gets a class.

- sensitive (embeddings, norms, the output head): fp32. Their parameters are few, and their
  errors reach every token (embeddings, head) or every layer (norms).
- large matmuls (every linear layer inside the blocks: attention q/k/v/o, MLP): fp8 under
  `--precision fp8`, bf16 under `--precision bf16`.
- regular (anything else that owns parameters): bf16, through autocast.

Name filters (`--fp32-layers`, `--bf16-layers`, `--fp8-layers`, Python regexes searched in the
layer's module name) move linear layers between classes; when several match, the safer one wins
(fp32 over bf16 over fp8). An fp8 layer whose in/out features are not multiples of 16 (what the
fp8 GEMMs take) falls back to bf16. The mode caps everything: under `--precision fp32` nothing
leaves fp32, under `bf16` nothing goes below bf16.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from torch import nn

from tierlm.config import ConfigError, PrecisionConfig
from tierlm.precision.matmul import KERNEL_MULTIPLE

COPY_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp8": "e4m3"}


@dataclass(frozen=True)
class LayerChoice:
    name: str
    """Module name, e.g. model.layers.0.mlp.down_proj."""
    kind: str
    """embedding | norm | head | linear | other"""
    params: int
    role: str
    """sensitive | large matmul | regular"""
    compute: str
    """fp32 | bf16 | fp8: the precision its matmul runs in."""
    scaling: str = "-"
    why: str = ""
    """What moved it from its class's default (a name filter, a fallback), if anything."""

    @property
    def copy(self) -> str:
        """dtype of the compute copy of its weights (what the tiered runtime streams)."""
        return COPY_DTYPE[self.compute]

    @property
    def is_linear(self) -> bool:
        return self.kind in ("linear", "head")


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")  # transformers' GPT-2 linear


def linear_dims(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer (nn.Linear or GPT-2 Conv1D), else None."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if _is_conv1d(m):
        return int(m.weight.shape[0]), int(m.weight.shape[1])
    return None


def _kind(m: nn.Module, head: nn.Module | None) -> str:
    if m is head:
        return "head"
    if isinstance(m, nn.Embedding):
        return "embedding"
    if "norm" in type(m).__name__.lower():  # LayerNorm, LlamaRMSNorm, Qwen2RMSNorm, ...
        return "norm"
    if linear_dims(m) is not None:
        return "linear"
    return "other"


def _filters(cfg: PrecisionConfig) -> list[tuple[str, str, re.Pattern]]:
    out = []
    for flag, compute, pattern in (
        ("--fp32-layers", "fp32", cfg.fp32_layers),
        ("--bf16-layers", "bf16", cfg.bf16_layers),
        ("--fp8-layers", "fp8", cfg.fp8_layers),
    ):
        if pattern:
            out.append((flag, compute, re.compile(pattern)))
    return out


def scaling_label(cfg: PrecisionConfig) -> str:
    if cfg.fp8_scaling == "delayed":
        return f"delayed ({cfg.fp8_history} steps)"
    if cfg.fp8_scaling == "fixed":
        return f"fixed (input x{cfg.fp8_input_scale:g}, grad x{cfg.fp8_grad_scale:g})"
    return "dynamic"


def classify(model: nn.Module, cfg: PrecisionConfig, mode: str) -> list[LayerChoice]:
    """One choice per module that owns parameters, in model order."""
    rank = {"fp32": 0, "bf16": 1, "fp8": 2}
    floor = mode if mode in rank else "fp32"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    filters = _filters(cfg)
    matched: Counter[str] = Counter()
    seen: set[int] = set()
    choices = []
    for name, m in model.named_modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        tied = any(id(p) in seen for p in m.parameters(recurse=False))
        if not own and not tied:
            continue
        seen.update(id(p) for p in own)
        kind = _kind(m, head)
        params = sum(p.numel() for p in own)
        if kind in ("embedding", "norm", "head"):
            role, want = "sensitive", "fp32"
        elif kind == "linear":
            role, want = "large matmul", "fp8"
        else:
            role, want = "regular", "bf16"
        why = "weight tied to the embedding" if tied else ""
        if kind in ("linear", "head"):
            for flag, compute, rx in filters:
                if rx.search(name):
                    matched[flag] += 1
                    want, why = compute, flag
                    break
        compute = want if rank[want] <= rank[floor] else floor
        if compute == "fp8":
            dims = linear_dims(m)
            bad = [f"{side} {d}" for side, d in zip(("in", "out"), dims, strict=True)
                   if d % KERNEL_MULTIPLE]
            if bad:
                compute = "bf16"
                why = f"fp8 fallback: {', '.join(bad)} not divisible by {KERNEL_MULTIPLE}"
        choices.append(LayerChoice(
            name=name, kind=kind, params=params, role=role, compute=compute,
            scaling=scaling_label(cfg) if compute == "fp8" else "-", why=why,
        ))
    for flag, _, rx in filters:
        if not matched[flag]:
            raise ConfigError(
                f"{flag} {rx.pattern!r} matches no linear layer of this model; linear layers are "
                f"named like {_example(choices)}"
            )
    return choices


def _example(choices: list[LayerChoice]) -> str:
    names = [c.name for c in choices if c.kind == "linear"][:2]
    return ", ".join(names) or "(none: the model has no linear layers)"


def table(choices: list[LayerChoice]) -> str:
    """Markdown table; layers that differ only in their block index share a row."""
    groups: dict[tuple, list[LayerChoice]] = {}
    for c in choices:
        pattern = re.sub(r"\.\d+\.", ".*.", c.name)
        groups.setdefault((pattern, c.kind, c.role, c.copy, c.compute, c.scaling, c.why),
                          []).append(c)
    lines = ["| layer | kind | role | params | compute copy | compute | fp8 scaling | note |",
             "|---|---|---|---|---|---|---|---|"]
    for (pattern, kind, role, copy, compute, scaling, why), cs in groups.items():
        label = pattern if len(cs) > 1 else cs[0].name
        count = f" (x{len(cs)})" if len(cs) > 1 else ""
        params = sum(c.params for c in cs)
        lines.append(f"| {label}{count} | {kind} | {role} | {params:,} | {copy} | {compute} "
                     f"| {scaling} | {why} |")
    return "\n".join(lines)
