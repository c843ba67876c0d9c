"""Checkpoints: safetensors for tensors, JSON for the rest, a checksum manifest, atomic writes.

- format.py: the layout of one checkpoint, its errors, the manifest, verification, listing
- safetensors_io.py: our safetensors writer (hashes while writing) and reader (no mmap)
- publish.py: writing a checkpoint, the atomic rename into place, pruning, crash recovery
- dcp.py: FSDP runs' checkpoints in torch.distributed.checkpoint form
- resume.py: `--resume`, loading, and the checks that a checkpoint fits the run
- export.py: `tierlm export`, a Hugging Face directory streamed from a checkpoint
"""

from tierlm.checkpoint.dcp import DCPTensors, save_sharded_checkpoint
from tierlm.checkpoint.export import checkpoint_export_dtype, export_hf_from_checkpoint
from tierlm.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    CheckpointWriteError,
    TrainState,
    checkpoint_bytes,
    checkpoint_dir,
    list_checkpoints,
    read_state,
    verify_checkpoint,
)
from tierlm.checkpoint.publish import prune_checkpoints, recover_checkpoints, save_checkpoint
from tierlm.checkpoint.resume import (
    check_tensor_format,
    check_weight_names,
    last_good_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    resume_point,
)
from tierlm.checkpoint.safetensors_io import SafetensorsFile, TensorFiles, write_safetensors

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointWriteError",
    "DCPTensors",
    "SafetensorsFile",
    "TensorFiles",
    "TrainState",
    "check_tensor_format",
    "check_weight_names",
    "checkpoint_bytes",
    "checkpoint_dir",
    "checkpoint_export_dtype",
    "export_hf_from_checkpoint",
    "last_good_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_state",
    "recover_checkpoints",
    "resume_point",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "verify_checkpoint",
    "write_safetensors",
]
