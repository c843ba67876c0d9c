"""The seed-compatible flags (`--lr`, `--model-size`, ...): aliases onto config fields."""

from __future__ import annotations

# Seed-compatible flags: first-class aliases onto config fields (not a second parser).
SEED_FLAGS: dict[str, str] = {
    "--model-size": "model.size",
    "--model": "model.path",
    "--precision": "precision.mode",
    "--fp8-scaling": "precision.fp8_scaling",
    "--fp8-history": "precision.fp8_history",
    "--fp8-layers": "precision.fp8_layers",
    "--bf16-layers": "precision.bf16_layers",
    "--fp32-layers": "precision.fp32_layers",
    "--fp8-emulate": "precision.fp8_emulate",
    "--tf32": "precision.tf32",
    "--grad-checkpointing": "activations.policy",
    "--offload-policy": "memory.offload_policy",
    "--opt": "optim.name",
    "--batch-size": "train.batch_size",
    "--grad-accum-steps": "train.grad_accum_steps",
    "--sparse-grad-ratio": "distributed.sparse_grad_ratio",
    "--sparse-grad-ratio-overrides": "distributed.sparse_grad_ratio_overrides",
    "--nproc": "distributed.nproc",
    "--context-parallel": "distributed.context_parallel",
    "--backend": "distributed.backend",
    "--grad-sync": "distributed.grad_sync",
    "--sync-every": "distributed.sync_every",
    "--sync-moments": "distributed.sync_moments",
    "--lr": "optim.lr",
    "--max-steps": "train.max_steps",
    "--finetune": "train.finetune",
    "--seq-len": "data.seq_len",
    "--data": "data.train",
    "--eval-data": "data.eval",
    "--out": "run.out",
    "--resume": "run.resume",
    "--overwrite": "run.overwrite",
    "--seed": "run.seed",
    "--save-every": "train.save_every",
    "--eval-every": "train.eval_every",
    "--device": "run.device",
    "--compile": "run.compile",
    "--microbatch-order": "memory.microbatch_order",
    "--boundary-activations": "memory.boundary_activations",
    "--speculative-update": "memory.speculative_update",
    "--resident": "memory.resident",
    "--device-budget": "memory.device_budget",
    "--host-budget": "memory.host_budget",
    "--offload-dir": "memory.offload_dir",
    "--tensorboard": "monitor.tensorboard",
    "--keep-checkpoints": "run.keep_checkpoints",
    "--max-skipped-in-a-row": "train.max_skipped_in_a_row",
    "--trust-remote-code": "model.trust_remote_code",
    "--hardware": "memory.hardware",
    "--gpu-memory": "memory.gpu_memory",
    "--host-memory": "memory.host_memory",
    "--disk-budget": "memory.disk_budget",
    "--disk-endurance-tbw": "memory.disk_endurance_tbw",
    "--export-dtype": "run.export_dtype",
    "--memory-node": "memory.memory_node",
    "--memory-node-token-file": "memory.memory_node_token_file",
    "--memory-node-transport": "memory.memory_node_transport",
    "--memory-node-timeout": "memory.memory_node_timeout",
    "--remote": "memory.remote",
    "--memory-node-memory": "memory.memory_node_memory",
    "--net-bandwidth": "memory.net_bandwidth",
}

_FLAG_FOR = {dotted: flag for flag, dotted in SEED_FLAGS.items()}


def flag_label(key: str) -> str:
    """How an error names config key `key`: with the short flag a user types where one exists
    (`--offload-policy / memory.offload_policy`), so it reads right on the command line and in a
    YAML file."""
    flag = _FLAG_FOR.get(key)
    return f"{flag} / {key}" if flag else key
