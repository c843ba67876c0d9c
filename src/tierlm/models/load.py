"""Streamed loading of Hugging Face checkpoints: the tiered runtime's initial weights read from
the directory's safetensors files one tensor at a time, never the whole model in RAM.

`from_pretrained` materialises every weight before the runtime sees any (a 7B model: 27 GB of
fp32). Here the model is a skeleton (`hf_model_skeleton`: parameters on the meta device, real
buffers) and the runtime asks `CheckpointWeights` for one segment's tensors while it builds that
segment's flat buffers; each tensor is read from its memory-mapped file, converted to the fp32
master dtype and released before the next is read, so the peak is one segment's flat buffer and
one tensor above what the tiers hold.

Checkpoint keys map onto the model's parameter names as transformers maps them: a key may lack
the model's `base_model_prefix` (GPT-2 checkpoints store `h.0...` for `transformer.h.0...`) or
carry one the model does not expect. A tied output embedding absent from the file takes the
input embedding's tensor (the model names the tie once). Tensors the model does not use (GPT-2's
`attn.bias` masks) are skipped; those transformers would warn about are listed in `unexpected`.
Every parameter is checked for presence and shape when the source is built, from the files'
headers alone, so a wrong checkpoint fails before any tier is written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel

from tierlm.models.adapters import Segment
from tierlm.models.hf import ModelLoadError
from tierlm.progress import NO_PROGRESS, Phase, Progress

# patterns transformers drops silently besides the model's own `_keys_to_ignore_on_load_unexpected`
# (rotary tables and position ids that older checkpoints stored as persistent buffers)
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it. `model.safetensors` wins over an
    index, as in transformers."""
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    index_path = path / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ModelLoadError(f"cannot read the shard index {str(index_path)!r}: {err}") from err
    files = {name: path / name for name in set(weight_map.values())}
    for name, file in files.items():
        if not file.is_file():
            raise ModelLoadError(f"{str(index_path)!r} names shard {name!r}, which is missing")
    return {key: files[name] for key, name in weight_map.items()}


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # safetensors' names


def _model_key(key: str, model_keys: set[str], prefix: str) -> str:
    """transformers' rule (core_model_loading.rename_source_key): strip the base model prefix
    when the model knows the key without it, add it when the model knows the key with it."""
    if prefix:
        if key.startswith(prefix + ".") and key[len(prefix) + 1 :] in model_keys:
            return key[len(prefix) + 1 :]
        if f"{prefix}.{key}" in model_keys:
            return f"{prefix}.{key}"
    return key


class CheckpointWeights:
    """The runtime's per-segment source of initial weights (runtime.state.InitialWeights), read
    from the safetensors checkpoint at `path` for `model` (a skeleton or a full module: only
    its names and shapes are used). `progress` shows the bytes read: a phase that opens at the
    first read and closes when every parameter has been read once (a tensor read again, by
    `--grad-checkpointing dynamic`'s probe, counts once)."""

    def __init__(self, path: str | Path, model: PreTrainedModel, *,
                 progress: Progress = NO_PROGRESS) -> None:
        self.path = Path(path)
        self._progress = progress
        self._phase: Phase | None = None
        self._unread: set[str] = set()
        key_files = checkpoint_files(self.path)
        headers: dict[str, tuple[tuple[int, ...], str]] = {}  # key -> (shape, dtype)
        for file in sorted(set(key_files.values())):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    info = f.get_slice(key)
                    headers[key] = (tuple(info.get_shape()), info.get_dtype())
        all_names: dict[int, list[str]] = {}  # a parameter -> every name it has (ties)
        for name, p in model.named_parameters(remove_duplicate=False):
            all_names.setdefault(id(p), []).append(name)
        model_keys = {n for names in all_names.values() for n in names}
        prefix = getattr(model, "base_model_prefix", "") or ""
        by_model_key: dict[str, str] = {}
        unexpected = []
        for key in sorted(key_files):
            mapped = _model_key(key, model_keys, prefix)
            if mapped in model_keys:
                by_model_key.setdefault(mapped, key)
            else:
                unexpected.append(key)
        ignored = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
                   *_ALWAYS_IGNORED]
        self.unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignored)]
        """Checkpoint tensors the model has no use for (transformers warns about them too)."""

        self._source: dict[str, tuple[str, Path]] = {}  # parameter name -> (key, file)
        for name, p in model.named_parameters():
            key = next((by_model_key[n] for n in all_names[id(p)] if n in by_model_key), None)
            if key is None:
                raise ModelLoadError(
                    f"{str(self.path)!r}: the model's parameter {name!r} (shape "
                    f"{tuple(p.shape)}) is not in the checkpoint; is this directory's "
                    "config.json the one its weights were saved with?"
                )
            shape, dtype = headers[key]
            if shape != tuple(p.shape):
                raise ModelLoadError(
                    f"{str(self.path)!r}: tensor {key!r} ({key_files[key].name}) has shape "
                    f"{shape} ({dtype}), but the model's parameter {name!r} has shape "
                    f"{tuple(p.shape)}; the weights do not match config.json"
                )
            self._source[name] = (key, key_files[key])
        self._unread = set(self._source)
        self._file_bytes = {name: math.prod(headers[key][0]) * _DTYPE_BYTES.get(headers[key][1], 4)
                            for name, (key, _) in self._source.items()}
        self.nbytes = sum(self._file_bytes.values())
        """Bytes of the parameters' tensors in the checkpoint's files."""

    def __call__(self, seg: Segment) -> Mapping[str, torch.Tensor]:
        return _SegmentTensors(self, [name for name, _, _ in seg.params])

    def read(self, name: str) -> torch.Tensor:
        """Parameter `name` as an fp32 CPU tensor. The file is opened for this tensor alone:
        a handle kept open would keep every page read through its mapping resident, and the
        whole checkpoint would end up counted in the process's memory."""
        key, file = self._source[name]
        if self._phase is None:
            self._phase = self._progress.phase(f"load weights from {self.path}", self.nbytes,
                                               "bytes")
        with safe_open(file, framework="pt", device="cpu") as f:
            # a copy in fp32 before the mapping goes away (bf16/fp16 widen exactly)
            tensor = f.get_tensor(key).to(torch.float32, copy=True)
        if name in self._unread:
            self._unread.discard(name)
            self._phase.advance(self._file_bytes[name])
            if not self._unread:
                self._phase.close()
        return tensor


class _SegmentTensors(Mapping[str, torch.Tensor]):
    """One segment's initial weights, each read when looked up (`FlatLayout.pack` copies it
    into the flat buffer and drops it before reading the next)."""

    def __init__(self, source: CheckpointWeights, names: list[str]) -> None:
        self._source, self._names = source, names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._source.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
