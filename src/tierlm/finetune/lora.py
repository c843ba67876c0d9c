"""LoRA adapters (--finetune lora) in peft's own layers and file format.

`apply_lora` wraps the model with peft (`get_peft_model`): every module `--lora.targets` names
becomes peft's `lora.Linear`, whose forward adds `(alpha / r) * B A dropout(x)` to the frozen
layer's. Both steppers keep calling the transformers model inside the wrapper (the peft model's
`base_model.model`, changed in place), so segments, checkpoints and the reference trainer see one
set of parameter names: the base's under `<module>.base_layer.` (requires_grad False) and the
adapters' `<module>.lora_A.default.weight` / `lora_B` (requires_grad True). The math is peft's:
the tiered runtime runs the same modules through `functional_call` on its flat buffers.

Adapters are initialised as peft does (A Kaiming-uniform with a = sqrt(5), B zero, so the model
starts as the base), from a generator seeded by --seed, and computed on the CPU whether the model
is real or a meta skeleton, so the reference trainer and the runtime start from the same bits.

The adapter is saved in peft's layout (`adapter_config.json` + `adapter_model.safetensors`,
keys `base_model.model.<module>.lora_A.weight`), so `PeftModel.from_pretrained(base, dir)` loads
it; the Hugging Face export merges it into the base (W + alpha/r * B A), tensor by tensor.
Beside it, `tierlm_adapter.json` says what base it was trained on (`adapter_notes`: under qlora
the NF4 quantisation and the weights it covered).

--finetune qlora is the same adapters on a base whose adapted weights are NF4
(tierlm.precision.nf4): the tiered runtime quantises them at load and each base layer decodes its
own weight per matmul (tierlm.precision.nf4.NF4Linear); a model in RAM (the reference trainer's)
gets them replaced by their NF4 round trip here, so both compute with the same values. Its
adapter loads on that round-tripped base, and its export merges the adapters into it.

Under --precision bf16 the precision policy swaps peft's layers as any others (the base layer
and both adapters of a target become bf16 `PrecisionLinear`s inside peft's `lora.Linear`), so the
adapters' matmuls run under full training's bf16 policy: bf16 operands, fp32 gradients for the
adapters' fp32 masters (their AdamW state fp32 too). The frozen base is held as its layers read
it: bf16 for the blocks' linear layers (NF4 decoded to bf16 under qlora), by the runtime
(tierlm.runtime.frozen) and, in RAM, by `store_frozen_as_computed`.
"""

from __future__ import annotations

import json
import math
import shutil
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tierlm.config import ConfigError, LoraConfig
from tierlm.models.adapters import ModelAdapter, Segment
from tierlm.models.export import SourceTensor, make_temp_dir, publish_dir
from tierlm.models.hf import hf_model_skeleton
from tierlm.models.init import preset_skeleton
from tierlm.models.load import CheckpointWeights
from tierlm.precision import nf4
from tierlm.precision.linear import PrecisionLinear
from tierlm.precision.nf4 import BLOCK, NF4Linear, quantise_in_place, round_trip

ADAPTER = "default"  # peft's adapter name, part of every adapter parameter's name
BASE_LAYER = ".base_layer."
PEFT_PREFIX = "base_model.model."  # what peft's saved keys start with


def _linear_types() -> tuple[type, ...]:
    """A linear layer, as built or as the precision policy (tierlm.precision) or a QLoRA
    runtime (tierlm.precision.nf4.NF4Linear) swapped it."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D, PrecisionLinear, NF4Linear)


def _stored_transposed(layer: nn.Module) -> bool:
    """Whether a linear layer's weight is stored (in, out): GPT-2's Conv1D, swapped or not."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(layer, Conv1D) or getattr(layer, "transposed", False) is True


def _base(module: nn.Module) -> nn.Module:
    """A layer as it was before peft wrapped it (the module itself if it is not wrapped)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def lora_targets(model: nn.Module, regex: str) -> list[str]:
    """Names of the linear layers `regex` fully matches (peft's rule for a string), before or
    after `apply_lora` wrapped them."""
    import re

    pattern = re.compile(regex)
    found = [n for n, m in model.named_modules()
             if isinstance(_base(m), _linear_types()) and pattern.fullmatch(n)]
    if not found:
        names = [n for n, m in model.named_modules() if isinstance(m, _linear_types())][:4]
        raise ConfigError(f"--lora.targets {regex!r} matches no linear layer of this model; "
                          f"its names read like {', '.join(names)}")
    return found


def peft_config(model: nn.Module, lora: LoraConfig, base_path: str | None = None):
    """peft's LoraConfig for `model` (GPT-2's Conv1D stores weights (in, out): fan_in_fan_out)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora_targets(model, lora.targets)
    modules = dict(model.named_modules())
    return PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.targets, bias="none", task_type="CAUSAL_LM",
        fan_in_fan_out=any(_stored_transposed(_base(modules[t])) for t in targets),
        base_model_name_or_path=base_path,
    )


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Wrap `model` with peft's LoRA layers in place (real or meta parameters), freeze the base,
    and return the adapters' initial values by parameter name (CPU, fp32). A real model gets
    them copied in; a skeleton's runtime reads them through `LoraWeights`."""
    from peft import get_peft_model

    cfg = peft_config(model, lora)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft's own init draws: the run's stream stays; peft reads transformers' deprecated
        # `is_gradient_checkpointing`, a FutureWarning on every LoRA run that the user can't act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        wrapped = get_peft_model(model, cfg)
    if wrapped.base_model.model is not model:
        raise AssertionError("peft did not wrap the model in place")
    values = initial_adapters(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values and not p.is_meta:
                p.copy_(values[name])
    return values


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """peft's initialisation (A: kaiming_uniform_(a=sqrt(5)), B: zeros) from one generator
    seeded with `seed`, layer by layer in module order."""
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A:
            a = torch.empty(m.lora_A[ADAPTER].weight.shape)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            out[f"{name}.lora_A.{ADAPTER}.weight"] = a
            out[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(m.lora_B[ADAPTER].weight.shape)
    return out


def base_name(name: str) -> str:
    """The base model's name of a frozen parameter of the wrapped model."""
    return name.replace(BASE_LAYER, ".")


def peft_key(name: str) -> str:
    """peft's saved key of an adapter parameter: `base_model.model.` + the name without the
    adapter's name."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


class LoraWeights:
    """The runtime's source of initial weights (runtime.state.InitialWeights) for a wrapped
    skeleton: adapters from `adapters`, the base from `base` (the unwrapped model's source,
    asked under the base's own names)."""

    def __init__(self, base: Callable[[Segment], Mapping[str, torch.Tensor]],
                 adapters: Mapping[str, torch.Tensor]) -> None:
        self.base, self.adapters = base, adapters

    def __call__(self, seg: Segment) -> Mapping[str, torch.Tensor]:
        frozen = [(base_name(n), p, d) for n, p, d in seg.params if n not in self.adapters]
        return _Joined(self.base(replace(seg, params=frozen)), self.adapters,
                       [n for n, _, _ in seg.params])


class _Joined(Mapping[str, torch.Tensor]):
    def __init__(self, base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                 names: list[str]) -> None:
        self._base, self._adapters, self._names = base, adapters, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._adapters:
            return self._adapters[name]
        if name not in self._names:
            raise KeyError(name)
        return self._base[base_name(name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


NOTES_FILE = "tierlm_adapter.json"


def adapter_notes(model: nn.Module, finetune: str) -> dict:
    """What an adapter directory's `tierlm_adapter.json` records beside peft's
    `adapter_config.json`: the base the adapters were trained on. Under qlora the adapted
    layers' base weights were NF4 (tierlm.precision.nf4: blocks of 64 with absmax scales, the
    scales double-quantised to int8 in groups of 256), so the adapters fit that base, and peft
    on the plain base computes something else. A file of its own: peft's loader warns about
    every key its LoraConfig lacks ("upgrade PEFT"), which would be wrong here."""
    quantization = None
    if finetune == "qlora":
        quantization = {
            "format": "nf4", "block_size": nf4.BLOCK, "double_quant": True,
            "scale_format": "int8", "scale_block_size": nf4.SCALE_BLOCK,
            # the base's names (without peft's base_layer): where the round trip goes
            "weights": sorted(base_name(n) for n in nf4.quantised_names(model)),
            "load": "replace each listed weight of the base by tierlm.precision.nf4.round_trip "
                    "of it, then PeftModel.from_pretrained(base, this directory)",
        }
    return {"finetune": finetune, "base_model_quantization": quantization}


def save_adapter(out_dir: Path, model: nn.Module, lora: LoraConfig,
                 weights: Mapping[str, torch.Tensor], base_path: str | None = None, *,
                 finetune: str = "lora") -> Path:
    """Write the adapters `weights` (keyed by the wrapped model's names) as a peft adapter
    directory, into a temporary sibling renamed into place."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    try:
        (tmp / NOTES_FILE).write_text(json.dumps(adapter_notes(model, finetune), indent=2) + "\n")
        peft_config(model, lora, base_path).save_pretrained(str(tmp))
        weights_file = tmp / "adapter_model.safetensors"
        save_file({peft_key(n): t.detach().to("cpu", torch.float32).contiguous()
                   for n, t in weights.items()}, str(weights_file), metadata={"format": "pt"})
        # save_file creates its file 0600: give it the mode the umask gave the directory
        # (less the execute bits), as every other file of the run has
        weights_file.chmod(stat.S_IMODE(tmp.stat().st_mode) & 0o666)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
           fan_in_fan_out: bool) -> torch.Tensor:
    """A target's weight with its adapter folded in, as peft's merge: W + scale * B A (its
    transpose for a Conv1D, whose weight is (in, out))."""
    delta = (b.float() @ a.float()) * scale
    return base.float() + (delta.T if fan_in_fan_out else delta)


class FullFinetune:
    """--finetune full: the model as built, every parameter trained, nothing more to write."""

    def save(self, run_dir: Path, weights: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        return None


class LoraFinetune:
    """--finetune lora or qlora: the model wrapped by `apply_lora`; `save` writes
    RUN_DIR/adapter."""

    def __init__(self, model: nn.Module, lora: LoraConfig, base_path: str | None,
                 method: str = "lora") -> None:
        self.model, self.lora, self.base_path = model, lora, base_path
        self.method = method

    def save(self, run_dir: Path, weights: Callable[[], Mapping[str, torch.Tensor]]) -> Path:
        """`weights`: the stepper's `weights` (the adapters, by parameter name)."""
        return save_adapter(Path(run_dir) / "adapter", self.model, self.lora, weights(),
                            self.base_path, finetune=self.method)


def prepare_finetune(
    method: str, model: nn.Module, lora: LoraConfig, initial_weights, *, seed: int,
    base_path: str | None = None,
) -> tuple[FullFinetune | LoraFinetune, Callable[[Segment], Mapping[str, torch.Tensor]]]:
    """Wrap `model` for `--finetune method` (full: as is) and return what writes the run's
    adapter, and the initial-weights source the tiered runtime reads (a skeleton's base from
    `initial_weights`, its adapters from their seeded initialisation). Under qlora a model in
    RAM computes with its NF4 round trip; a skeleton's base is quantised by the runtime."""
    if method == "full":
        return FullFinetune(), initial_weights
    if method not in ("lora", "qlora"):
        raise ConfigError(f"--finetune {method}: not built; use full, lora or qlora")
    adapters = apply_lora(model, lora, seed=seed)
    if method == "qlora" and not any(p.is_meta for p in model.parameters()):
        quantise_in_place(model)
    return LoraFinetune(model, lora, base_path, method), LoraWeights(initial_weights, adapters)


def store_frozen_as_computed(model: nn.Module) -> int:
    """A LoRA model in RAM (the reference trainer's): every frozen weight and bias a bf16
    precision layer reads (tierlm.precision: the blocks' linear layers under --precision bf16)
    stored in bf16, as the tiered runtime holds its base: the values the layer's cast gives,
    in half the memory. Parameters on the meta device (a skeleton) are left alone. Returns the
    bytes saved."""
    saved = 0
    for m in model.modules():
        if not isinstance(m, PrecisionLinear) or m.compute.name != "bf16":
            continue
        for p in (m.weight, m.bias):
            if p is not None and not p.requires_grad and not p.is_meta \
                    and p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)
                saved += 2 * p.numel()
    return saved


# -- the merged export --------------------------------------------------------------------------


def _base_reader(
    run_config: Mapping, checkpoint: Path
) -> tuple[nn.Module, Callable[[str], torch.Tensor]]:
    """The unwrapped base a LoRA run trained on, as a skeleton and a reader of its fp32 weights
    by name, one tensor at a time: --model's files, or the preset rebuilt from the checkpoint's
    config.json and the run's --seed, segment by segment (models.init)."""
    path = (run_config.get("model") or {}).get("path")
    if path:
        skeleton = hf_model_skeleton(path)
        return skeleton, CheckpointWeights(path, skeleton).read
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True)
    skeleton, weights = preset_skeleton(config, seed=(run_config.get("run") or {}).get("seed", 0))
    owner = {n: seg for seg in ModelAdapter(skeleton).segments for n, _, _ in seg.params}
    last: dict[str, Mapping[str, torch.Tensor]] = {}

    def read(name: str) -> torch.Tensor:
        seg = owner[name]
        if seg.name not in last:  # a segment's weights are drawn together: keep the last one's
            last.clear()
            last[seg.name] = dict(weights(seg))
        return last[seg.name][name].float()

    return skeleton, read


def merged_sources(run_config: Mapping, checkpoint: Path,
                   adapters: Mapping[str, torch.Tensor]) -> list:
    """Export sources (tierlm.models.export.SourceTensor) of the base with the checkpoint's
    `adapters` merged into their targets, each tensor computed when the writer reads it."""
    from transformers.pytorch_utils import Conv1D

    lora = LoraConfig(**(run_config.get("lora") or {}))
    skeleton, read = _base_reader(run_config, checkpoint)
    modules = dict(skeleton.named_modules())
    targets = set(lora_targets(skeleton, lora.targets))
    scale = lora.alpha / lora.rank
    nf4 = (run_config.get("train") or {}).get("finetune") == "qlora"  # the base it trained on

    def source(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SourceTensor:
        module = name.rpartition(".")[0]

        def values(chunk: int) -> Iterator[torch.Tensor]:
            w = read(name)
            if module in targets and name.endswith(".weight"):
                if nf4 and w.numel() % BLOCK == 0:
                    w = round_trip(w)
                w = merged(w, adapters[f"{module}.lora_A.{ADAPTER}.weight"],
                           adapters[f"{module}.lora_B.{ADAPTER}.weight"], scale,
                           isinstance(modules[module], Conv1D))
            yield from w.reshape(-1).split(chunk)

        return SourceTensor(name, shape, dtype, values)

    return [source(n, tuple(p.shape), p.dtype) for n, p in skeleton.named_parameters()]
