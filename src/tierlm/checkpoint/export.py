"""`tierlm export`: a Hugging Face model directory made from a verified checkpoint, streamed."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from tierlm.checkpoint.dcp import DCPTensors
from tierlm.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    read_manifest,
    read_state,
    verify_checkpoint,
)
from tierlm.checkpoint.resume import check_tensor_names, check_weight_names
from tierlm.checkpoint.safetensors_io import TensorFiles, read_in_chunks
from tierlm.finetune.lora import merged_sources
from tierlm.models import build_model
from tierlm.models.export import (
    DEFAULT_MAX_SHARD_BYTES,
    SourceTensor,
    export_dtype,
    natural_key,
    source_dtype,
    write_hf_model,
)
from tierlm.progress import NO_PROGRESS, Progress

_NOT_EXPORTED = re.compile(
    r"(optimizer(-.+)?|rng)\.safetensors|state\.json|__\d+_\d+\.distcp|\.metadata|config\.json|"
    + re.escape(MANIFEST)
)
_EXPORT_GROUP_BYTES = 1 << 30  # tensors read from dcp shards at a time while exporting
_MODEL_SHARD = re.compile(r"model(-.+)?\.safetensors")


def _file_sources(weights: TensorFiles) -> list[SourceTensor]:
    """Each tensor of a checkpoint's model files, read chunk by chunk straight from its file."""
    out = []
    for name in weights:
        f = weights.file_of(name)
        dtype, shape, _, _ = f.entries[name]
        out.append(SourceTensor(name, shape, dtype, functools.partial(read_in_chunks, f, name)))
    return out


def _dcp_sources(weights: DCPTensors, order: list[str]) -> list[SourceTensor]:
    """Each full tensor of an FSDP checkpoint, assembled from every rank's shard. dcp reads
    whole tensors, so they are read in groups of about a GiB, in `order` (the export's), and
    each is dropped once written."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in order:
        if groups[-1] and size + weights.nbytes(name) > _EXPORT_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += weights.nbytes(name)
    group_of = {name: group for group in groups for name in group}
    loaded: dict[str, torch.Tensor] = {}

    def read(chunk: int, name: str) -> Iterator[torch.Tensor]:
        if name not in loaded:
            loaded.clear()
            loaded.update(weights.read(group_of[name]))
        yield loaded.pop(name).reshape(-1)

    return [SourceTensor(name, weights.shape(name), weights.dtype(name),
                         lambda chunk, name=name: read(chunk, name)) for name in order]


def _parameter_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters (tied ones once) of the model config.json describes,
    from a build on the meta device (no memory)."""
    from transformers import AutoConfig

    model = build_model(AutoConfig.from_pretrained(str(path), local_files_only=True),
                        device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def checkpoint_export_dtype(path: Path, dtype: str = "auto") -> torch.dtype:
    """The dtype `export_hf_from_checkpoint` writes: `dtype` (`--export-dtype`), where `auto`
    is the dtype of the weights the run started from (state.json's `source_dtype`; from a
    checkpoint written before it was recorded, the run's --model if still there)."""
    state = read_state(path)
    source = state.get("source_dtype")
    run_config = state.get("run_config") or {}
    lora = (run_config.get("train") or {}).get("finetune") in ("lora", "qlora")
    if source is None and not lora:
        run_model = run_config.get("model") or {}
        source = source_dtype(run_model["path"]) if run_model.get("path") else None
    try:
        return export_dtype(dtype, source)
    except ValueError as exc:
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


def export_hf_from_checkpoint(
    path: Path, out_dir: Path, *, dtype: str = "auto",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: Progress = NO_PROGRESS,
) -> Path:
    """A Hugging Face model directory made from a verified checkpoint, streamed.

    The weights (keyed by parameter name, tied tensors once) go into safetensors shards of
    about `max_shard_bytes`, cast to `dtype` (`--export-dtype`; `auto`: the dtype of the
    weights the run started from, recorded in state.json) a chunk at a time by
    `tierlm.models.export.write_hf_model`, next to config.json (recording that dtype), the
    tokenizer and generation_config.json. No more than a chunk of a tensor is in RAM (an FSDP
    run's dcp shards: about a GiB of full tensors at a time). Written into a temporary sibling
    and renamed into place, like the checkpoint itself. `progress` shows the bytes written.
    """
    verify_checkpoint(path)
    manifest = read_manifest(path)
    state = read_state(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: config.json is unreadable: {exc}") from None
    run_config = state.get("run_config") or {}
    if (run_config.get("train") or {}).get("finetune") in ("lora", "qlora"):
        return _export_lora(path, out_dir, state, config, manifest, dtype, max_shard_bytes,
                            progress)
    weights: TensorFiles | DCPTensors
    if state.get("tensors") == "dcp":
        weights = DCPTensors(path, "model.", 0)
    else:
        weights = TensorFiles(path / n for n in sorted(manifest) if _MODEL_SHARD.fullmatch(n))
        listed = state.get("tensor_names")
        model_files = {k: v for k, v in listed.items() if _MODEL_SHARD.fullmatch(k)} if (
            isinstance(listed, dict)) else listed
        check_tensor_names(path, {"tensor_names": model_files}, weights.names_by_file())
    check_weight_names(_parameter_shapes(path), weights, path)
    sources = (_dcp_sources(weights, sorted(weights, key=natural_key))
               if isinstance(weights, DCPTensors) else _file_sources(weights))
    others = [path / n for n in sorted(manifest)
              if not (_NOT_EXPORTED.fullmatch(n) or _MODEL_SHARD.fullmatch(n))]
    try:
        return write_hf_model(out_dir, sources, config=config, files=others,
                              dtype=checkpoint_export_dtype(path, dtype),
                              max_shard_bytes=max_shard_bytes, progress=progress)
    except ValueError as exc:  # what the checkpoint holds cannot be exported as asked
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


def _export_lora(path: Path, out_dir: Path, state: dict, config: dict, manifest: dict,
                 dtype: str, max_shard_bytes: int, progress: Progress) -> Path:
    """A LoRA run's checkpoint holds its adapters only: the export is the base (--model, or the
    preset from --seed) with them merged in (W + alpha/r * B A), tensor by tensor."""
    adapters = TensorFiles(path / n for n in sorted(manifest) if _MODEL_SHARD.fullmatch(n))
    others = [path / n for n in sorted(manifest)
              if not (_NOT_EXPORTED.fullmatch(n) or _MODEL_SHARD.fullmatch(n))]
    try:
        return write_hf_model(out_dir, merged_sources(state["run_config"], path, adapters),
                              config=config, files=others,
                              dtype=checkpoint_export_dtype(path, dtype),
                              max_shard_bytes=max_shard_bytes, progress=progress)
    except ValueError as exc:
        raise CheckpointError(f"export of checkpoint {path}: {exc}") from exc


