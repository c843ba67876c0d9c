"""Model adapters: cut a Hugging Face causal LM into segments in execution order.

Segments are `embed`, `block.0` .. `block.{L-1}` and `head` (final norm + output projection; the
runtime adds the chunked loss). A segment never owns live storage: its `forward` receives a dict
of parameter tensors (views into the runtime's flat buffers) and runs the Hugging Face submodule
through `torch.func.functional_call`, so the math is the library's own, not a re-implementation.

Tied input/output embeddings are owned by the `embed` segment; the head lists the tensor under
`borrowed` and the runtime sums its gradient into the owner's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from transformers import PreTrainedModel

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*LLAMA_FAMILY, "gpt2")


@dataclass
class StepContext:
    """Per-micro-batch tensors every block needs (positions, masks, rotary tables)."""

    position_ids: torch.Tensor
    masks: dict[str, Any]  # attention type -> mask (None: causal via SDPA's is_causal)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    # context parallel: the ring attention runs over (tierlm.distributed.context); None: SDPA
    ring: Any = None


@dataclass
class Segment:
    name: str
    params: list[tuple[str, nn.Parameter, bool]]  # (qualified name, parameter, weight decay)
    forward: Callable[[dict[str, torch.Tensor], torch.Tensor, StepContext], torch.Tensor]
    borrowed: dict[str, str] = field(default_factory=dict)  # qualified name -> owner segment


@dataclass
class HeadSegment(Segment):
    weight_name: str = ""  # the output projection's weight (may be borrowed from `embed`)
    bias_name: str | None = None
    # the head module's own matmul on tensors given by name where it has one (tierlm.precision's
    # PrecisionLinear keeps the head in fp32 under autocast), else a plain linear
    linear: Callable[..., torch.Tensor] | None = None

    def project(self, views: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear(h, views, self.weight_name, self.bias_name)
        bias = views[self.bias_name] if self.bias_name else None
        return F.linear(h, views[self.weight_name], bias)


def _mask_cache_arg(fn: Callable) -> str:
    """The name transformers' mask builders give their KV-cache argument: `cache` in recent
    releases, `past_key_values` before (5.17 and older)."""
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def _call(module: nn.Module, prefix: str, views: dict[str, torch.Tensor], *args, **kwargs):
    """Run `module` with the parameters in `views` whose names start with `prefix`."""
    local = {k[len(prefix) :]: v for k, v in views.items() if k.startswith(prefix)}
    return functional_call(module, local, args, kwargs, strict=False)


def _embedding_ids(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


class ModelAdapter:
    """Finds the segments of one model and builds the per-micro-batch context."""

    def __init__(self, model: PreTrainedModel) -> None:
        model_type = model.config.model_type
        if model_type not in SUPPORTED:
            raise ValueError(
                f"the tiered runtime supports {', '.join(SUPPORTED)}; got {model_type!r}"
            )
        self.model = model
        self.model_type = model_type
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._module_names = {id(m): n for n, m in model.named_modules()}
        self._embedding_ids = _embedding_ids(model)
        self.segments: list[Segment] = (
            self._gpt2_segments() if model_type == "gpt2" else self._llama_segments()
        )
        owned = [id(p) for s in self.segments for _, p, _ in s.params]
        if len(owned) != len(set(owned)) or set(owned) != set(self._names):
            raise AssertionError("segments must own every parameter exactly once")

    # -- helpers ----

    def _own(self, *modules: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
        out = []
        for m in modules:
            for p in m.parameters():
                decay = p.ndim >= 2 and id(p) not in self._embedding_ids
                out.append((self._names[id(p)], p, decay))
        return out

    def _prefix(self, module: nn.Module) -> str:
        return self._module_names[id(module)] + "."

    def _head(self, norm: nn.Module, lm_head: nn.Linear) -> HeadSegment:
        tied = lm_head.weight is self.model.get_input_embeddings().weight
        weight_name = self._names[id(lm_head.weight)]
        params = self._own(norm) + ([] if tied else self._own(lm_head))
        bias_name = self._names[id(lm_head.bias)] if lm_head.bias is not None else None
        if tied and bias_name:
            params += [(bias_name, lm_head.bias, False)]
        return HeadSegment(
            name="head",
            params=params,
            forward=lambda v, h, ctx: _call(norm, self._prefix(norm), v, h),
            borrowed={weight_name: "embed"} if tied else {},
            weight_name=weight_name,
            bias_name=bias_name,
            linear=getattr(lm_head, "functional", None),
        )

    # -- Llama family (Llama, Mistral, Qwen2, Qwen3) ----

    def _llama_segments(self) -> list[Segment]:
        base = self.model.model
        embed_prefix = self._prefix(base.embed_tokens)
        segs: list[Segment] = [
            Segment(
                name="embed",
                params=self._own(base.embed_tokens),
                forward=lambda v, ids, ctx: _call(base.embed_tokens, embed_prefix, v, ids),
            )
        ]
        for i, layer in enumerate(base.layers):
            prefix = self._prefix(layer)
            attn_type = getattr(layer, "attention_type", None) or "full_attention"

            def block(v, h, ctx, layer=layer, prefix=prefix, attn_type=attn_type):
                ring = {} if ctx.ring is None else {"cp_ring": ctx.ring}  # to the attention
                return _call(
                    layer,
                    prefix,
                    v,
                    h,
                    attention_mask=ctx.masks[attn_type],
                    position_ids=ctx.position_ids,
                    position_embeddings=ctx.position_embeddings,
                    **ring,
                )

            segs.append(Segment(name=f"block.{i}", params=self._own(layer), forward=block))
        segs.append(self._head(base.norm, self.model.lm_head))
        return segs

    # -- GPT-2 ------------------------------------------------------------------------------------

    def _gpt2_segments(self) -> list[Segment]:
        tr = self.model.transformer

        def embed(v, ids, ctx):
            # Learned positions: each token's position in its packed example (`embed_context`
            # before the full context exists, the context itself when the backward recomputes).
            positions = ctx.position_ids
            h = _call(tr.wte, self._prefix(tr.wte), v, ids)
            return tr.drop(h + _call(tr.wpe, self._prefix(tr.wpe), v, positions))

        segs: list[Segment] = [
            Segment(name="embed", params=self._own(tr.wte, tr.wpe), forward=embed)
        ]
        for i, blk in enumerate(tr.h):
            prefix = self._prefix(blk)

            def block(v, h, ctx, blk=blk, prefix=prefix):
                ring = {} if ctx.ring is None else {"cp_ring": ctx.ring}  # to the attention
                return _call(
                    blk, prefix, v, h,
                    attention_mask=ctx.masks["full_attention"],
                    position_ids=ctx.position_ids,
                    **ring,
                )

            segs.append(Segment(name=f"block.{i}", params=self._own(blk), forward=block))
        segs.append(self._head(tr.ln_f, self.model.lm_head))
        return segs

    # -- per micro-batch context ----

    def embed_context(self, ids: torch.Tensor, positions: torch.Tensor | None) -> StepContext:
        """What the `embed` segment reads, before `context` can be built from its output: the
        positions of input ids (B, T) (None: 0..T-1 in every row), which GPT-2's learned
        position embedding looks up. No masks: the embedding attends to nothing."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return StepContext(position_ids=positions, masks={})

    def context(
        self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
        ring: Any = None,
    ) -> StepContext:
        """Positions, masks and rotary tables for input ids (B, T) and embeddings (B, T, D),
        built by the same library functions the model's own forward calls. `positions` (B, T):
        each token's position in its packed example; the mask builders turn their resets into
        a block-diagonal causal mask (--data.packing documents)."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        cfg = self.model.config
        position_ids = (torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
                        if positions is None else positions)
        # the mask builders get the positions only where examples are packed: given any, they
        # search them for resets, a host read that waits for the device's queue (per
        # micro-batch); plain rows make the same causal mask without the search
        kwargs = dict(config=cfg, inputs_embeds=hidden, attention_mask=None,
                      position_ids=positions)
        kwargs[_mask_cache_arg(create_causal_mask)] = None  # no KV cache in training
        masks: dict[str, Any] = {"full_attention": create_causal_mask(**kwargs)}
        if getattr(cfg, "sliding_window", None) and self.model_type in LLAMA_FAMILY:
            sliding = create_sliding_window_causal_mask(**kwargs)
            masks["sliding_attention"] = sliding
            if self.model_type == "mistral":  # Mistral applies its window on every layer
                masks["full_attention"] = sliding
        pe = None
        if self.model_type in LLAMA_FAMILY:
            pe = self.model.model.rotary_emb(hidden, position_ids=position_ids)
        return StepContext(position_ids=position_ids, masks=masks, position_embeddings=pe,
                           ring=ring)
