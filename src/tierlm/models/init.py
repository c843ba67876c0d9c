"""Preset weights initialised segment by segment: the tiered runtime's initial weights for a
preset, bit for bit what `build_model(config, seed=s)` gives, without the whole model in RAM.

`build_model` runs transformers' construction on the CPU: a 7B preset is 27 GB of fp32 before
the runtime streams it to its tiers. Here the model is a skeleton (`preset_skeleton`: parameters
on the meta device, real buffers) and `PresetWeights` replays transformers' initialisation one
segment at a time on freshly allocated CPU tensors, with torch's global CPU generator carried
from segment to segment, so every draw lands where the whole-model build puts it.

The order of draws that build (transformers 5, Llama family; read in `PreTrainedModel.post_init`,
`init_weights`, `initialize_weights`/`smart_apply`, measured with a dispatch-mode log):

1. the base model (`model.model`) is constructed: every `nn.Linear`/`nn.Embedding` draws its
   torch default init (`reset_parameters`), in construction order (= module pre-order);
2. the base model's own `post_init` initialises it in post-order (`_init_weights`: embedding
   and linears from a normal, norms ones); these are the values the model keeps;
3. the remaining children (`lm_head`) are constructed (torch default init), then the outer
   model's `post_init` initialises them; `tie_weights` then makes a tied head share the input
   embedding, so a tied head's draws only move the generator.

Step 1's draws come before the embedding's kept values and cover every block, so the `embed`
segment first replays step 1 on throwaway tensors, one module at a time (as much generator work
as the whole-model build does, at most one module's memory). Steps 2 and 3 follow segment order
(`embed`, `block.0`, ..., `head`), which `PresetWeights` checks when it is built. A segment may be
asked for again or out of order (the dynamic activation policy measures `embed` and `block.0`
first): the generator state at each segment's start is kept (5 KB each) and segments not yet
reached are replayed. Each call leaves the global generator where the whole-model build has it
after that segment, so after `head` it is where `build_model` leaves it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from tierlm.models.adapters import LLAMA_FAMILY, ModelAdapter, Segment
from tierlm.models.hf import _materialise_buffers


@dataclass(frozen=True)
class _Step:
    """Run `fn` on `module` with fresh CPU parameters; `keep`: its values are the model's."""

    module: nn.Module
    prefix: str  # the module's qualified name + "."
    fn: Callable[[nn.Module], object]
    keep: bool


def preset_skeleton(
    config: PretrainedConfig, *, dtype: torch.dtype = torch.float32, seed: int | None = None
) -> tuple[PreTrainedModel, PresetWeights]:
    """The model `build_model(config, dtype=dtype, seed=seed)` returns, with its parameters on
    the meta device (buffers real), and the source of its initial weights
    (runtime.state.InitialWeights) that the runtime reads segment by segment."""
    if seed is not None:
        torch.manual_seed(seed)  # as build_model: the CPU and every CUDA generator
    start = torch.get_rng_state()
    model = _meta_model(config, dtype)
    _materialise_buffers(model)  # on meta parameters the initialisers draw nothing
    model.train()
    return model, PresetWeights(config, dtype=dtype, rng_state=start)


def _meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    # copied: from_config writes the attention implementation back into its config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype
        )


class PresetWeights:
    """Segment -> its initial weights as `build_model` would draw them from the generator state
    `rng_state` (the state right after `torch.manual_seed(seed)`)."""

    def __init__(
        self, config: PretrainedConfig, *, dtype: torch.dtype, rng_state: torch.Tensor
    ) -> None:
        if config.model_type not in LLAMA_FAMILY:
            raise ValueError(
                f"segment-by-segment initialisation follows the Llama family's construction "
                f"order; {config.model_type!r} is not one of {', '.join(LLAMA_FAMILY)}"
            )
        # A private skeleton to run the steps on: the caller's may have modules swapped
        # (precision) or parameters emptied by the runtime. Only names and structure are used.
        self._model = _meta_model(config, dtype)
        adapter = ModelAdapter(self._model)
        self.segment_names = [s.name for s in adapter.segments]
        self._chunks = _chunks(_program(self._model), adapter.segments)
        # generator state at the start of segment i, filled as segments are reached
        self._starts: dict[int, torch.Tensor] = {0: rng_state.clone()}

    def __call__(self, seg: Segment) -> Mapping[str, torch.Tensor]:
        index = self.segment_names.index(seg.name)
        # replay (and discard) the segments between the last known start and this one
        reached = max(i for i in self._starts if i <= index)
        for i in range(reached, index):
            self._run(i, keep=False)
        values = self._run(index, keep=True)
        names = [name for name, _, _ in seg.params]
        missing = [n for n in names if n not in values]
        if missing:
            raise AssertionError(f"segment {seg.name!r}: no initial value for {missing}")
        return {n: values[n] for n in names}

    def _run(self, index: int, *, keep: bool) -> dict[str, torch.Tensor]:
        torch.set_rng_state(self._starts[index])
        values: dict[str, torch.Tensor] = {}
        for step in self._chunks[index]:
            out = _materialised(step)
            if keep and step.keep:
                values.update(out)
        self._starts[index + 1] = torch.get_rng_state()
        return values


def _materialised(step: _Step) -> dict[str, torch.Tensor]:
    """Run the step on fresh CPU tensors in place of the module's own (meta) parameters and
    return them by qualified name; the module keeps its meta parameters."""
    module = step.module
    own = {n: p for n, p in module._parameters.items() if p is not None}
    fresh = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
             for n, p in own.items()}
    module._parameters.update(fresh)
    try:
        with torch.no_grad():
            step.fn(module)
    finally:
        module._parameters.update(own)
    return {step.prefix + n: p.detach() for n, p in fresh.items()}


def _program(model: PreTrainedModel) -> list[_Step]:
    """transformers' construction of `model` as steps, in the order it draws (module doc)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}

    def with_params(modules):
        return [m for m in modules if any(p is not None for p in m._parameters.values())]

    def resets(root: nn.Module) -> list[_Step]:  # torch's default init, construction order
        return [_Step(m, names[id(m)] + ".", type(m).reset_parameters, keep=False)
                for m in with_params(root.modules()) if hasattr(m, "reset_parameters")]

    def inits(root: nn.Module, owner: PreTrainedModel) -> list[_Step]:  # post_init, post-order
        return [_Step(m, names[id(m)] + ".", owner._init_weights, keep=True)
                for m in with_params(_post_order(root))]

    base = model.base_model
    steps: list[_Step] = []
    rest: list[nn.Module] = []
    for child in model.children():
        if child is base:
            steps += resets(base) + inits(base, base)
        else:
            steps += resets(child)
            rest.append(child)
    for child in rest:
        steps += inits(child, model)
    if with_params([model]):
        raise ValueError(f"{type(model).__name__} holds parameters of its own; the "
                         "segment-by-segment initialisation does not know their order")
    return steps


def _post_order(module: nn.Module) -> list[nn.Module]:
    """`smart_apply`'s order: children first, then the module."""
    out: list[nn.Module] = []
    for child in module.children():
        out += _post_order(child)
    return [*out, module]


def _chunks(steps: list[_Step], segments: list[Segment]) -> list[list[_Step]]:
    """Split the steps into one run per segment: a kept step goes to the segment that owns its
    parameters; others (draws whose values are overwritten or tied away) go with the segment
    in progress. Kept steps must come in segment order, or no split reproduces the build."""
    owner = {name: i for i, s in enumerate(segments) for name, _, _ in s.params}
    chunks: list[list[_Step]] = [[] for _ in segments]
    current = 0
    for step in steps:
        owners = {owner[step.prefix + n] for n in step.module._parameters
                  if step.prefix + n in owner} if step.keep else set()
        if len(owners) > 1 or (owners and min(owners) < current):
            raise ValueError(
                f"initialising {step.prefix[:-1]!r} draws out of segment order "
                f"({', '.join(segments[i].name for i in sorted(owners))} after "
                f"{segments[current].name}); build the model whole with build_model"
            )
        current = max(owners, default=current)
        chunks[current].append(step)
    return chunks
