"""The config's own checks: values and combinations of its fields that cannot work, each error
naming the flag to change. Checks that need a feature's knowledge (the distributed strategies,
the activation-override syntax, the hardware profiles) live in that feature's package and run
from `tierlm.plan.checks`, with these."""

from __future__ import annotations

import re
from pathlib import Path

from tierlm.config.errors import ConfigError, NotSupportedYet
from tierlm.config.model import LoraConfig
from tierlm.config.precision import PrecisionConfig, check_precision_flags
from tierlm.config.schema import Config, uses_tiered_runtime
from tierlm.config.units import parse_bytes


def _positive(key: str, value: float, flag: str | None = None) -> None:
    if value <= 0:
        name = flag or key
        raise ConfigError(f"{name}: must be > 0, got {value}")


def _validate_precision(p: PrecisionConfig) -> None:
    _positive("precision.fp8_history", p.fp8_history, "--fp8-history")
    _positive("precision.fp8_input_scale", p.fp8_input_scale)
    _positive("precision.fp8_grad_scale", p.fp8_grad_scale)
    if p.fp8_overflow_steps < 0:
        raise ConfigError(f"precision.fp8_overflow_steps: must be >= 0, got {p.fp8_overflow_steps}")
    if not 0 <= p.fp8_overflow_fraction < 1:
        raise ConfigError("precision.fp8_overflow_fraction: must be in [0, 1)")
    for flag, value in (("--fp8-layers", p.fp8_layers), ("--bf16-layers", p.bf16_layers),
                        ("--fp32-layers", p.fp32_layers)):
        if value is None:
            continue
        try:
            re.compile(value)
        except re.error as exc:
            raise ConfigError(f"{flag}: {value!r} is not a regex: {exc}") from None
    if p.mode != "auto":  # auto is checked once resolved (tierlm.plan.inputs)
        check_precision_flags(p, p.mode)


def validate(cfg: Config) -> None:
    """Value checks and combinations that cannot work; each error names the flag to change. The
    features' own checks of their sections run after these, from `tierlm.plan.checks.validate`."""
    _positive("data.seq_len", cfg.data.seq_len, "--seq-len")
    _positive("train.batch_size", cfg.train.batch_size, "--batch-size")
    _positive("train.grad_accum_steps", cfg.train.grad_accum_steps, "--grad-accum-steps")
    _positive("train.max_steps", cfg.train.max_steps, "--max-steps")
    _positive("train.eval_batches", cfg.train.eval_batches)
    _positive("monitor.log_every", cfg.monitor.log_every)
    _check_trace_step(cfg)
    _positive("optim.lr", cfg.optim.lr, "--lr")
    _positive("optim.galore_rank", cfg.optim.galore_rank)
    _positive("optim.galore_update_every", cfg.optim.galore_update_every)
    _positive("memory.disk_endurance_tbw", cfg.memory.disk_endurance_tbw, "--disk-endurance-tbw")
    if cfg.data.vocab_size < 260:
        raise ConfigError("data.vocab_size: must be >= 260 (256 bytes + special tokens)")
    if not 0 < cfg.data.eval_fraction < 1:
        raise ConfigError("data.eval_fraction: must be between 0 and 1")
    allowed = {"text": ("all",), "chat": ("assistant", "all"),
               "prompt_completion": ("completion", "all")}.get(cfg.data.format)
    if allowed and cfg.data.train_on not in ("auto", *allowed):
        raise ConfigError(f"--data.train_on {cfg.data.train_on} does not apply to "
                          f"--data.format {cfg.data.format}; use {' or '.join(allowed)}")
    for key, value in (
        ("train.eval_every", cfg.train.eval_every),
        ("train.save_every", cfg.train.save_every),
        ("train.sample_tokens", cfg.train.sample_tokens),
        ("train.max_skipped_in_a_row", cfg.train.max_skipped_in_a_row),
        ("run.keep_checkpoints", cfg.run.keep_checkpoints),
        ("optim.warmup_steps", cfg.optim.warmup_steps),
        ("optim.weight_decay", cfg.optim.weight_decay),
        ("optim.grad_clip", cfg.optim.grad_clip),
    ):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio: must be between 0 and 1")
    for key, beta in (("optim.beta1", cfg.optim.beta1), ("optim.beta2", cfg.optim.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    for key, flag in (
        ("device_budget", "--device-budget"),
        ("host_budget", "--host-budget"),
        ("gpu_memory", "--gpu-memory"),
        ("host_memory", "--host-memory"),
        ("disk_budget", "--disk-budget"),
    ):
        value = getattr(cfg.memory, key)
        if value is not None and parse_bytes(value, flag) <= 0:
            raise ConfigError(f"{flag}: must be > 0, got {value}")
    if cfg.memory.resident is not None:
        try:
            re.compile(cfg.memory.resident)
        except re.error as exc:
            raise ConfigError(
                f"--resident: {cfg.memory.resident!r} is not a regex: {exc}"
            ) from None
    tiered = uses_tiered_runtime(cfg)
    if not tiered:
        for flag, value in (
            ("--resident", cfg.memory.resident),
            ("--device-budget", cfg.memory.device_budget),
            ("--host-budget", cfg.memory.host_budget),
            ("--offload-dir", cfg.memory.offload_dir),
        ):
            if value is None:
                continue
            if flag.endswith("-budget"):  # a budget is what auto plans within
                raise ConfigError(
                    f"{flag} needs the tiered runtime; add --offload-policy auto (the planner "
                    "places model state on the device, in RAM and on disk within the budgets), "
                    "or choose it: tiered, host or disk"
                )
            raise ConfigError(
                f"{flag} needs the tiered runtime; add --offload-policy tiered, host or disk"
            )
        if cfg.memory.microbatch_order != "microbatch-outer":
            raise ConfigError(
                "--microbatch-order layer-outer needs the tiered runtime; add "
                "--offload-policy tiered, host or disk"
            )
        if cfg.memory.boundary_activations != "device":
            raise ConfigError(
                "--boundary-activations host needs the tiered runtime; add "
                "--offload-policy tiered, host or disk"
            )
        if cfg.memory.speculative_update == "on":
            raise ConfigError(
                "--speculative-update on needs disk-tier state; add --offload-policy auto, "
                "tiered or disk"
            )
    if cfg.memory.speculative_update == "on" and cfg.distributed.nproc > 1:
        raise ConfigError(
            "--speculative-update on needs one process (a speculation reads the gradient "
            "before the sync across ranks averages it); pass --speculative-update off"
        )
    elif cfg.memory.boundary_activations == "host" and (
        cfg.activations.policy not in ("full", "dynamic")
        or (cfg.activations.overrides and cfg.activations.policy != "dynamic")
    ) and cfg.memory.offload_policy != "auto":
        raise ConfigError(
            "--boundary-activations host needs --grad-checkpointing full or dynamic (a kept "
            "graph pins the boundary input on the device; dynamic parks the inputs of the "
            "segments it recomputes); pass both, or --boundary-activations device"
        )
    _validate_lora(cfg.lora)
    if cfg.run.resume == "auto" and not cfg.run.out:
        raise ConfigError("--resume auto needs --out: the run directory to continue or start")
    if cfg.run.resume and cfg.run.overwrite:
        raise ConfigError(f"--overwrite deletes the run --resume {cfg.run.resume} would "
                          "continue; give one of them")
    offload = cfg.memory.offload_dir
    if offload and not Path(offload).is_absolute() and ".." in Path(offload).parts:
        raise ConfigError(
            f"--offload-dir {offload}: a relative offload directory lives inside the run "
            "directory and may not contain '..'; give an absolute path to put it elsewhere"
        )
    _validate_precision(cfg.precision)


def _validate_lora(lora: LoraConfig) -> None:
    _positive("lora.rank", lora.rank, "--lora.rank")
    _positive("lora.alpha", lora.alpha, "--lora.alpha")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"--lora.dropout: must be in [0, 1), got {lora.dropout}")
    try:
        re.compile(lora.targets)
    except re.error as exc:
        raise ConfigError(f"--lora.targets: {lora.targets!r} is not a regex: {exc}") from None


def _check_trace_step(cfg: Config) -> None:
    step = cfg.monitor.trace_step
    if step < 0:
        raise ConfigError(f"--monitor.trace_step: must be >= 0 (0: off), got {step}")
    if step > cfg.train.max_steps:
        raise ConfigError(f"--monitor.trace_step {step} is past the run's last step "
                          f"(--max-steps {cfg.train.max_steps}); pick a step in 1..max-steps")
    if step and not uses_tiered_runtime(cfg):
        raise ConfigError("--monitor.trace_step traces the tiered runtime's actions and moves; "
                          "add --offload-policy host, disk or tiered (the reference trainer "
                          "has one opaque step), or drop --monitor.trace_step")
    if step and cfg.distributed.backend == "fsdp":
        raise ConfigError("--monitor.trace_step traces the tiered runtime, not FSDP; drop "
                          "--monitor.trace_step or use --backend engine")


def _check_memory_node(cfg: Config) -> None:
    """The memory node's flags (tierlm.node; the trainer's side: tierlm.runtime's remote
    segments): what needs a node, what a node needs, and the combinations not built yet."""
    mem = cfg.memory
    wants = ("--remote" if mem.remote is not None else
             "--offload-policy remote" if mem.offload_policy == "remote" else None)
    plan_flags = [flag for flag, value in (("--memory-node-memory", mem.memory_node_memory),
                                           ("--net-bandwidth", mem.net_bandwidth))
                  if value is not None]
    # `tierlm plan` takes these alone (tierlm.plan.inputs.check_trainable leaves them out): the
    # size and link of a node that is not there yet. A run with a node measures both at the
    # handshake; given, they cap the node's memory the plan fills and replace the measured link
    if plan_flags and mem.memory_node is None:
        raise ConfigError(f"{plan_flags[0]} on a training run describes its memory node: name "
                          "the node with --memory-node ADDRESS:PORT, or use `tierlm plan` to "
                          "plan a node that is not there yet")
    if mem.memory_node is None:
        if wants:
            raise ConfigError(f"{wants} puts model state on a memory node: name it with "
                              "--memory-node ADDRESS:PORT (and --memory-node-token-file)")
        return
    if not mem.memory_node_token_file:
        raise ConfigError(f"--memory-node {mem.memory_node} needs --memory-node-token-file: the "
                          "file holding the secret the node was started with (its --token-file)")
    _positive("memory.memory_node_timeout", mem.memory_node_timeout, "--memory-node-timeout")
    if mem.remote is not None:
        try:
            re.compile(mem.remote)
        except re.error as exc:
            raise ConfigError(f"--remote: {mem.remote!r} is not a regex: {exc}") from None
    if mem.offload_policy == "none":
        raise ConfigError("--memory-node with --offload-policy none: the reference trainer "
                          "keeps every byte on the device; use --offload-policy auto, host, "
                          "tiered, disk or remote")
    if mem.offload_policy == "auto":  # the planner chooses what goes to the node
        if mem.remote is not None:
            raise ConfigError("--remote with --offload-policy auto: the planner chooses the "
                              "segments the node holds; drop --remote, or choose them with "
                              "--offload-policy host, tiered or disk")
    elif wants is None:
        raise ConfigError(f"--memory-node {mem.memory_node}: no state goes to it; choose the "
                          "segments with --remote REGEX, --offload-policy remote, or let the "
                          "planner choose with --offload-policy auto")
    dist = cfg.distributed
    if dist.nproc > 1 or dist.backend == "fsdp" or dist.context_parallel > 1:
        raise NotSupportedYet("a memory node with --nproc > 1, --context-parallel or "
                              "--backend fsdp", "a node serves one trainer process")
    if cfg.train.finetune != "full":
        raise NotSupportedYet(f"a memory node with --finetune {cfg.train.finetune}",
                              "the node holds trained state; a frozen base stays local")


def check_supported(cfg: Config) -> None:
    """Refuse flags whose feature is not built yet, instead of silently ignoring them (--device is
    checked against the hardware profiles by `tierlm.memory.hardware.check_device`)."""
    _check_memory_node(cfg)
    if cfg.train.finetune in ("lora", "qlora") and (
        cfg.distributed.backend == "fsdp" or cfg.distributed.nproc > 1
    ):
        raise NotSupportedYet(f"--finetune {cfg.train.finetune} with --nproc > 1 or --backend "
                              "fsdp", "LoRA runs in one process; drop --nproc, "
                              "--context-parallel and --backend fsdp")
    if cfg.distributed.backend == "fsdp" and cfg.activations.policy != "none":
        raise NotSupportedYet(
            f"--grad-checkpointing {cfg.activations.policy} with --backend fsdp",
            "use --grad-checkpointing none, or --backend engine",
        )
