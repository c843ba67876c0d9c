"""Hugging Face checkpoints in and out: local safetensors directories only.

Loading never touches the hub, never runs checkpoint code (``trust_remote_code=False``) and never
unpickles (``.bin`` weights are refused), so opening a downloaded directory cannot execute
anything it ships.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from tierlm.models.export import make_temp_dir, publish_dir

# Our own progress display owns the terminal; transformers' per-shard bars only add noise.
hf_logging.disable_progress_bar()

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

_SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelLoadError(ValueError):
    """A checkpoint directory we refuse to load; the message says what to change."""


def _check_checkpoint_dir(path: Path) -> str:
    """Validate ``path`` before transformers sees it; return its ``model_type``.

    Checking up front turns transformers' generic (often hub-flavoured) errors into ones that
    name the directory and the fix, and guarantees the refusal of pickled weights does not
    depend on transformers' fallback rules.
    """
    if not path.exists():
        raise ModelLoadError(
            f"checkpoint directory {str(path)!r} does not exist; pass a local directory "
            "(hub names are not resolved: download it first, e.g. `hf download <repo> --local-dir`)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"{str(path)!r} is a file; pass the directory that holds config.json")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{str(path)!r} has no config.json; pass the directory written by save_pretrained"
        )
    try:
        config_dict = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {str(config_path)!r}: {err}") from err
    model_type = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{str(config_path)!r} has model_type {model_type!r}; supported model types are: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not any((path / name).is_file() for name in _SAFETENSORS_FILES):
        pickled = [name for name in _PICKLE_FILES if (path / name).is_file()]
        if pickled:
            raise ModelLoadError(
                f"{str(path)!r} only has pickled weights ({', '.join(pickled)}), which we never "
                "load because unpickling can run arbitrary code; convert them to safetensors "
                "(model.safetensors or a model.safetensors.index.json shard set) first"
            )
        raise ModelLoadError(
            f"{str(path)!r} has no weights: expected model.safetensors or "
            "model.safetensors.index.json next to config.json"
        )
    return model_type


def load_hf_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a causal LM from a local safetensors checkpoint directory.

    ``trust_remote_code`` (``--trust-remote-code``) lets transformers import Python code the
    directory ships; it stays off unless the user asks for it.

    ``dtype`` is always applied: transformers 5 otherwise keeps the checkpoint's stored dtype
    (often bf16), which would silently change training precision. The model is returned in
    train mode, like ``build_model``'s, because loading here starts training; transformers
    itself hands it back in eval mode, so call ``.eval()`` before comparing outputs of models
    with dropout (GPT-2's defaults are 0.1).
    """
    path = Path(path)
    _check_checkpoint_dir(path)
    # Loaded on CPU then moved: transformers only honours device_map (or a torch.device
    # context) when `accelerate` is installed, which we do not depend on.
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation="sdpa",
        local_files_only=True,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    # Module.to keeps tied Parameters shared, so ties survive the move.
    model.to(device)
    model.train()
    return model


def hf_model_skeleton(
    path: str | Path, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> PreTrainedModel:
    """The model `load_hf_model` returns, with its parameters on the meta device: names, shapes
    and ties, no weights. Buffers are real, on the CPU, with from_pretrained's values (rotary
    `inv_freq`), so the module runs once its parameters are given tensors. For FSDP ranks that
    take their shards of the weights rank 0 loaded, and for the tiered runtime, which reads the
    weights segment by segment (tierlm.models.load)."""
    path = Path(path)
    _check_checkpoint_dir(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
        )
    _materialise_buffers(model)
    model.train()
    return model


def _materialise_buffers(model: PreTrainedModel) -> None:
    """Give a meta-built model real buffers by from_pretrained's own route: transformers 5 also
    builds on meta, then empties the non-persistent buffers onto their device and lets
    `initialize_weights` compute them (`_init_weights` recomputes rotary tables); on meta
    parameters the weight initialisers do nothing. Persistent buffers would come from the
    checkpoint, which no supported family has; refuse rather than invent their values."""
    persistent = set(model.state_dict()) - {n for n, _ in model.named_parameters(
        remove_duplicate=False)}
    if persistent:
        raise ModelLoadError(
            f"{type(model).__name__} has persistent buffers ({', '.join(sorted(persistent))}), "
            "which the meta-device skeleton cannot fill; load it with load_hf_model"
        )
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    model.initialize_weights()


def _check_ties(model: PreTrainedModel) -> None:
    """Refuse to export a model whose config promises tied embeddings it no longer has.

    A tier manager or optimizer that swaps in a new Parameter for one side of a tie silently
    trains two matrices; saving that under ``tie_word_embeddings=True`` would mislabel it.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or inp.weight is out.weight:
        return
    if inp.weight.shape == out.weight.shape and torch.equal(
        inp.weight.detach().cpu(), out.weight.detach().cpu()
    ):
        return
    raise ValueError(
        "config.tie_word_embeddings is True but the input embedding and LM head no longer share "
        "weights (a Parameter was replaced during training); keep the tie (reassign the same "
        "Parameter, or call model.tie_weights()) or set config.tie_word_embeddings = False "
        "before exporting"
    )


def _fsync_tree(root: Path) -> None:
    # Flush file contents before the rename publishes them; otherwise a crash right after the
    # rename can leave a complete-looking directory with empty files.
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        dir_fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def export_hf(model: PreTrainedModel, tokenizer: Any | None, out_dir: str | Path) -> Path:
    """Write ``model`` (safetensors) and optionally ``tokenizer`` as a Hugging Face directory.

    Everything is written into a sibling temporary directory first and renamed into place, so
    ``out_dir`` is either the old export or the complete new one, never a half-written mix. An
    existing ``out_dir`` is replaced: POSIX cannot rename over a non-empty directory, so the old
    one is moved aside, the new one renamed in, then the old one deleted (a crash between the
    two renames leaves the old export in the ``.old`` sibling).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export target {str(out_dir)!r} exists and is not a directory")
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(
            f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained; wrap a raw "
            "`tokenizers.Tokenizer` in transformers.PreTrainedTokenizerFast(tokenizer_object=...)"
        )
    _check_ties(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent directory keeps the final rename on one filesystem, where it is atomic.
    tmp_dir = make_temp_dir(out_dir.parent, f".{out_dir.name}.tmp-")
    try:
        model.save_pretrained(tmp_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp_dir)
        _fsync_tree(tmp_dir)
        publish_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir
