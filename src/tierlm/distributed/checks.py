"""Config checks for the `distributed` section (called from `tierlm.plan.checks.validate`, after
the config's own checks): each error names the flag to change. Checks that need the world size
live in `setup.join_world`."""

from __future__ import annotations

import re
from typing import Any

from tierlm.config import ConfigError, NotSupportedYet


def validate_distributed(cfg: Any) -> None:
    d = cfg.distributed
    if d.sparse_grad_ratio is not None and not 0 < d.sparse_grad_ratio <= 1:
        raise ConfigError(f"--sparse-grad-ratio: must be in (0, 1], got {d.sparse_grad_ratio}")
    for flag, value, low in (
        ("--nproc", d.nproc, 1),
        ("--context-parallel", d.context_parallel, 1),
        ("--sync-every", d.sync_every, 1),
        ("--distributed.sparse_warmup_steps", d.sparse_warmup_steps, 0),
    ):
        if value < low:
            raise ConfigError(f"{flag}: must be >= {low}, got {value}")
    if d.timeout_s <= 0:
        raise ConfigError(f"--distributed.timeout_s: must be > 0, got {d.timeout_s}")
    parse_ratio_overrides(d.sparse_grad_ratio_overrides)
    mode = resolved_mode(d)
    if mode == "topk" and d.sparse_grad_ratio is None:
        raise ConfigError("--grad-sync topk needs --sparse-grad-ratio, e.g. 0.05")
    if mode != "topk" and d.sparse_grad_ratio is not None:
        raise ConfigError(f"--sparse-grad-ratio is for --grad-sync topk, not {mode}")
    if mode != "delayed" and d.sync_every > 1:
        raise ConfigError(f"--sync-every is for --grad-sync delayed, not {mode}")
    if mode != "delayed" and d.sync_moments != "local":
        raise ConfigError(f"--sync-moments is for --grad-sync delayed, not {mode}")
    if d.backend == "fsdp":
        if mode != "dense":
            raise ConfigError(
                f"--grad-sync {mode} runs on --backend engine; FSDP reduces gradients densely"
            )
        if cfg.precision.mode == "fp8":
            raise NotSupportedYet("--precision fp8 with --backend fsdp",
                                  "use fp32 or bf16, or --backend engine")
        if cfg.memory.offload_policy != "none":
            raise ConfigError(
                f"--offload-policy {cfg.memory.offload_policy} is the tiered runtime's; with "
                "--backend fsdp use --distributed.fsdp_cpu_offload to keep shards in RAM"
            )
    elif d.fsdp_cpu_offload:
        raise ConfigError("--distributed.fsdp_cpu_offload needs --backend fsdp")
    if d.context_parallel > 1:
        _validate_context_parallel(cfg, mode)


def _validate_context_parallel(cfg: Any, mode: str) -> None:
    """The combinations --context-parallel is built for (tierlm.distributed.context_step)."""
    d, cp = cfg.distributed, cfg.distributed.context_parallel
    if d.nproc > 1 and d.nproc % cp:  # under torchrun (--nproc 1) join_world checks the world
        raise ConfigError(f"--nproc {d.nproc} is not a multiple of --context-parallel {cp}: "
                          "the ranks form data-parallel groups of --context-parallel ranks")
    if cfg.data.seq_len % (2 * cp):
        raise ConfigError(f"--seq-len {cfg.data.seq_len} is not a multiple of 2 x "
                          f"--context-parallel {cp}: each rank holds two of 2N equal chunks")
    if d.backend == "fsdp":
        raise NotSupportedYet("--context-parallel with --backend fsdp",
                              "context parallel runs on --backend engine")
    if mode != "dense" or d.grad_sync_dtype != "fp32":
        raise NotSupportedYet(f"--context-parallel with --grad-sync {mode} "
                              f"({d.grad_sync_dtype})",
                              "its gradients are all-reduced densely in fp32")
    if cfg.precision.mode == "fp8":
        raise NotSupportedYet("--context-parallel with --precision fp8", "use fp32 or bf16")
    if cfg.data.packing == "documents":
        raise NotSupportedYet("--context-parallel with --data.packing documents",
                              "the ring's causal mask spans the whole row: use stream or off")


def parse_ratio_overrides(text: str, flag: str = "--sparse-grad-ratio-overrides"):
    """'embed|lm_head|norm=1.0,mlp=0.1' -> (('embed|lm_head|norm', 1.0), ('mlp', 0.1))."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        pattern, sep, value = item.rpartition("=")
        try:
            ratio = float(value)
        except ValueError:
            ratio = None
        if not sep or not pattern or ratio is None or not 0 < ratio <= 1:
            raise ConfigError(
                f"{flag}: {item!r} is not PATTERN=RATIO with RATIO in (0, 1], e.g. "
                "'embed|lm_head|norm=1.0,mlp=0.1'"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"{flag}: {pattern!r} is not a regex: {exc}") from None
        out.append((pattern, ratio))
    return tuple(out)


def resolved_mode(dist_cfg: Any) -> str:
    """--grad-sync, or what the other flags imply when it is not given."""
    if dist_cfg.grad_sync is not None:
        return dist_cfg.grad_sync
    if dist_cfg.sparse_grad_ratio is not None:
        return "topk"
    if dist_cfg.sync_every > 1:
        return "delayed"
    return "dense"
