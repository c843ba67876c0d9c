"""Typed run configuration: keyword-only dataclasses, YAML files, dotted overrides.

Every field carries a docstring (the string literal under it); the CLI's help text is read from
those docstrings, so the documentation and the parser cannot drift apart. Resolution order:
field defaults < YAML file (``--config``) < command-line flags.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

# Every block's attention and MLP projections: Llama family and GPT-2 module names.
LORA_DEFAULT_TARGETS = (
    r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|c_attn|c_proj|c_fc)"
)
MODEL_SIZES = ("tiny", "small", "125m", "350m", "1b", "3b", "7b", "13b")


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key and what is allowed."""


class NotSupportedYet(ConfigError):
    """The flag names a feature that tierlm does not implement yet."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"not supported yet: {flag} ({why})")


@dataclass(kw_only=True)
class ModelConfig:
    size: Literal["tiny", "small", "125m", "350m", "1b", "3b", "7b", "13b"] = "small"
    """Llama-architecture size preset, used when no `path` is given (--model-size)."""
    path: str | None = None
    """Local Hugging Face checkpoint directory (config.json + safetensors + tokenizer) to
    continue training from; Llama, Qwen2/Qwen3, Mistral and GPT-2 families (--model)."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model directory (auto_map); off unless
    you trust its source (--trust-remote-code)."""


@dataclass(kw_only=True)
class DataConfig:
    train: str | None = None
    """Training data: a .txt, .jsonl, .json or .parquet file, a directory of them, or a directory
    written by datasets' save_to_disk; empty means the built-in Shakespeare corpus (--data)."""
    eval: str | None = None
    """Held-out text in the same formats; empty means the corpus's held-out plays, or the last
    `eval_fraction` of the training documents for user data (--eval-data)."""
    text_field: str = "text"
    """Field of each record (.jsonl, .json, .parquet, Arrow) that holds the text."""
    format: Literal["auto", "text", "chat", "prompt_completion"] = "auto"
    """How records read: text (plain LM), chat (a list of {role, content} messages),
    prompt_completion (prompt + completion, or Alpaca instruction/input/output); auto detects it
    from the first record's fields."""
    train_on: Literal["auto", "all", "completion", "assistant"] = "auto"
    """Tokens the loss covers: assistant turns (chat), the completion (prompt_completion) or all;
    auto: assistant for chat, completion for prompt_completion, all for text."""
    messages_field: str = "messages"
    """Field of a chat record that holds its messages."""
    prompt_field: str = "prompt"
    """Field of a prompt_completion record that holds the prompt."""
    completion_field: str = "completion"
    """Field of a prompt_completion record that holds the completion."""
    chat_template: str | None = None
    """Jinja chat template file for chat data; empty: the model tokenizer's own template."""
    packing: Literal["stream", "documents", "off"] = "stream"
    """stream: examples joined by eos (none added after an example the chat template already
    ends with eos) and cut into seq_len rows (an example may see the one
    before it); documents: the same rows, each example attending only to itself (per-example
    positions, block-diagonal causal mask); off: one example per row, padded, longer ones
    truncated to their first seq_len+1 tokens."""
    seq_len: int = 256
    """Tokens per training sequence (--seq-len)."""
    vocab_size: int = 8192
    """Vocabulary size of the byte-level BPE tokenizer trained when the model brings none."""
    eval_fraction: float = 0.05
    """Share of user documents held out for evaluation when no `eval` data is given."""


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["AdamW", "Lion", "Adafactor", "AdamW8bit", "GaLoreAdamW"] = "AdamW"
    """Optimizer (--opt), the same on the reference trainer and the tiered runtime. AdamW uses
    beta1, beta2 and eps; Lion uses beta1 (the update's interpolation) and beta2 (the moment's
    decay), whose usual values are 0.9 and 0.99 with an lr 3-10x smaller than AdamW's; Adafactor
    ignores betas and eps (torch.optim.Adafactor's beta2_decay -0.8, eps (None, 1e-3), d 1) and
    reads lr as a step relative to each weight's RMS: its usual lr is 1e-2, torch's default (at
    3e-3 it learns visibly slower than AdamW).
    AdamW8bit: AdamW with both moments in 8 bits per element plus an fp32 scale per block of 256
    (2 B/param of state instead of 8). GaLoreAdamW: AdamW whose moments for the linear weights
    live in a rank-`galore_rank` projection of their gradient."""
    lr: float = 1e-3
    """Peak learning rate after warm-up, the same default for every --opt (set it per optimizer:
    Lion's usual lr is 3-10x smaller than AdamW's, Adafactor's about 1e-2) (--lr)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices; norms, biases and embeddings get none."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    galore_rank: int = 128
    """GaLoreAdamW: rank of the moments' projection (full rank where a weight has fewer rows
    or columns)."""
    galore_update_every: int = 200
    """GaLoreAdamW: optimizer steps between refreshes of the projection (an SVD of each
    linear weight's gradient; the first step computes it)."""
    galore_scale: float = 0.25
    """GaLoreAdamW: factor on the update projected back to the weight's shape."""


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = 16
    """Rank r of each adapter: lora_A is (r, in), lora_B is (out, r) (--lora.rank)."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds (alpha / rank) * B A x to the frozen layer's output
    (--lora.alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (peft's lora_dropout); > 0 makes a run depend on the
    random stream, as any dropout does (--lora.dropout)."""
    targets: str = LORA_DEFAULT_TARGETS
    """Regex over module names (re.fullmatch, as peft's target_modules) of the linear layers
    that get adapters; the default: every block's attention and MLP projections of the Llama
    family (q/k/v/o, gate/up/down) and GPT-2 (c_attn, c_proj, c_fc) (--lora.targets)."""


@dataclass(kw_only=True)
class TrainConfig:
    finetune: Literal["full", "lora", "qlora"] = "full"
    """What training updates: full (every parameter), lora (low-rank adapters on the layers
    --lora.targets names, the base frozen; the run writes RUN_DIR/adapter in peft's format and
    its checkpoints hold the adapters only), qlora (lora on a base whose adapted layers' weights
    are stored, streamed and read as NF4 with double-quantised scales: tierlm.models.nf4)
    (--finetune)."""
    max_steps: int = 100
    """Optimizer steps to run (--max-steps)."""
    batch_size: int = 8
    """Sequences per micro-batch (--batch-size)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (--grad-accum-steps)."""
    eval_every: int = 50
    """Evaluate held-out perplexity every N steps (also at step 0 and at the end); 0: only
    at step 0 and at the end (--eval-every)."""
    eval_batches: int = 8
    """Held-out batches (of `batch_size` sequences) per evaluation."""
    save_every: int = 0
    """Write a checkpoint every N steps (and always at the end); 0: only at the end
    (--save-every)."""
    save_final: bool = True
    """Write the checkpoint and the Hugging Face export at the end of the run; false (a
    benchmark) writes neither, and with --save-every 0 the run saves nothing, so the preflight
    reserves no disk for checkpoints or the export (Ctrl-C still saves)."""
    sample_tokens: int = 48
    """Tokens generated for the sample printed at the end; 0 disables it."""
    max_skipped_in_a_row: int = 10
    """Stop with a diagnosis after this many non-finite (skipped) steps in a row; 0: never stop
    (--max-skipped-in-a-row)."""


@dataclass(kw_only=True)
class PrecisionConfig:
    mode: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Compute precision, master weights always fp32: fp32; bf16 (autocast, with embeddings,
    norms and the output head kept in fp32); fp8 (as bf16, plus fp8 matmuls for the attention
    and MLP projections); auto (the default) takes fp8 where the device has fp8 units (CUDA
    sm_89+, or with --fp8-emulate; bf16 at most under --backend fsdp or --finetune
    lora/qlora), else bf16 where it computes bf16 natively, else fp32 (a CPU); `tierlm plan`
    resolves it against the --hardware profile. The run logs and saves what auto resolved to
    (--precision)."""
    fp8_scaling: Literal["dynamic", "delayed", "fixed"] = "dynamic"
    """How fp8 activations and gradients are scaled before the cast: dynamic (by the tensor's
    current amax), delayed (by the largest amax of the last fp8_history steps) or fixed
    (fp8_input_scale, fp8_grad_scale: the troubleshooting switch); weights are always scaled
    by their current amax (--fp8-scaling)."""
    fp8_history: int = 16
    """Delayed scaling: optimizer steps of amax history (--fp8-history)."""
    fp8_input_scale: float = 1.0
    """Fixed scaling: multiplier applied to activations before the E4M3 cast (max 448)."""
    fp8_grad_scale: float = 65536.0
    """Fixed scaling: multiplier applied to output gradients before the E5M2 cast (max 57344);
    gradients of a mean token loss are small, hence the large default."""
    fp8_layers: str | None = None
    """Regex of linear layer names to compute in fp8 besides the default (every linear layer
    in the blocks), e.g. 'lm_head' (--fp8-layers)."""
    bf16_layers: str | None = None
    """Regex of linear layer names to keep in bf16 under --precision fp8, e.g. 'down_proj'
    (--bf16-layers)."""
    fp32_layers: str | None = None
    """Regex of linear layer names to compute in fp32, e.g. 'layers\\.0\\.' (--fp32-layers);
    embeddings, norms and the output head are fp32 anyway."""
    fp8_overflow_steps: int = 16
    """An fp8 layer whose tensors saturate more than fp8_overflow_fraction of their values for
    this many steps in a row is switched to bf16 (logged); 0: never switch."""
    fp8_overflow_fraction: float = 0.001
    """Share of a tensor's values that may saturate in a step before the step counts as an
    overflow step for its layer."""
    fp8_emulate: bool = False
    """Compute fp8 matmuls by dequantising to fp32 and multiplying (same numerics, no speed-up)
    instead of torch._scaled_mm; also lets --precision auto choose fp8 on hardware without fp8
    units (--fp8-emulate)."""
    tf32: bool = False
    """On CUDA, compute fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulate) instead of torch's default IEEE fp32; `tierlm plan` plans fp32 compute at the
    TF32 rate (half the bf16 rate) with it, at the card's IEEE fp32 rate without it, which on
    A100/H100 is 8x slower. No effect on a CPU (--tf32)."""


@dataclass(kw_only=True)
class ActivationConfig:
    policy: Literal["none", "full", "selective", "offload", "dynamic"] = "none"
    """Activation memory per segment: none keeps every activation (a segment streamed by the
    tiered runtime keeps its graph where the device budget holds it, last blocks first, else
    takes dynamic_fallback; under --offload-policy auto, where the plan found room); full
    recomputes each segment from its input in the backward;
    selective keeps matmul and attention outputs and recomputes norms and elementwise ops;
    offload moves saved tensors to host RAM until the backward; dynamic keeps what fits
    --device-budget, last blocks first (--grad-checkpointing)."""
    overrides: str | None = None
    """Per-segment policies as comma-separated pattern=policy pairs, the pattern a regex over
    segment names (embed, block.N), e.g. 'block.[0-3]=full,block.1[01]=keep'; the last match
    wins; policies: keep, selective, full, offload."""
    dynamic_fallback: Literal["full", "offload"] = "full"
    """What dynamic, and none for streamed segments, do with segments whose activations do not
    fit: recompute them (full) or hold them in host RAM (offload)."""


@dataclass(kw_only=True)
class MemoryConfig:
    offload_policy: Literal["none", "auto", "tiered", "host", "disk"] = "none"
    """Where model state lives: none keeps everything on the device (the plain reference
    trainer); host keeps master weights, gradients and AdamW state in RAM and streams weights to
    the device; disk keeps them in files under offload_dir; tiered fills the device, then RAM,
    then disk within the budgets (--offload-policy)."""
    microbatch_order: Literal["microbatch-outer", "layer-outer"] = "microbatch-outer"
    """Tiered runtime: microbatch-outer streams all weights for every micro-batch; layer-outer
    runs each segment for all micro-batches while its weights are on the device
    (--microbatch-order)."""
    boundary_activations: Literal["device", "host"] = "device"
    """Tiered runtime: where each segment's boundary input waits between its forward and its
    backward: on the device, or in host RAM (one copy out as it is produced, one back for the
    backward), so layer-outer holds one segment's micro-batches on the device, not every
    segment's; host needs --grad-checkpointing full, or dynamic, which parks the inputs of the
    segments it recomputes (--boundary-activations; auto decides)."""
    resident: str | None = None
    """Regex of segment names (embed, block.N, head) whose weights stay on the device, e.g.
    'embed|head|block.3[01]' (--resident)."""
    device_budget: str | None = None
    """Device memory the runtime may use for model state and boundary activations, e.g. 8GiB;
    empty: no limit (--device-budget)."""
    host_budget: str | None = None
    """Host RAM the runtime may use for model state and staging, e.g. 48GiB; empty: 0.7 x the
    RAM available at start (container limits included) (--host-budget)."""
    offload_dir: str | None = None
    """Directory for the disk tier's files; empty: RUN_DIR/offload; a relative path is inside
    the run directory, an absolute one is used as given (--offload-dir)."""
    hardware: str = "auto"
    """Hardware profile for the planner: auto (detect this machine), or one of rtx3090,
    rtx4090, rtx4060ti-16g, rtx5090, a100-40g, a100-80g, h100-80g, h200, cpu (--hardware)."""
    gpu_memory: str | None = None
    """GPU memory size overriding the profile's, e.g. 24GiB; a CUDA run also caps its own
    allocations there (set_per_process_memory_fraction), so a larger card models this one
    (--gpu-memory)."""
    host_memory: str | None = None
    """Host RAM size overriding the profile's, e.g. 64GiB (--host-memory)."""
    disk_budget: str | None = None
    """Disk space the disk tier may use, e.g. 200GiB; empty: the profile's, or the free space
    at the offload directory when detected (--disk-budget)."""
    disk_endurance_tbw: float = 600.0
    """Rated endurance of the disk under offload_dir in TB written (TBW, from the drive's
    datasheet; 600 is a 1 TB consumer NVMe's). The plan and every run with disk-tier state report
    the share of it a day of training writes, and warn above 1% a day
    (--disk-endurance-tbw)."""


@dataclass(kw_only=True)
class DistributedConfig:
    nproc: int = 1
    """Processes to train with on this machine: `tierlm train --nproc N` re-runs itself under
    torchrun (gloo on CPU, NCCL on CUDA, one GPU per process); under torchrun the world comes
    from torchrun (--nproc)."""
    backend: Literal["engine", "fsdp"] = "engine"
    """engine: data parallel, every rank runs the tiered runtime on its slice of each batch and
    gradients are synced per segment by --grad-sync; fsdp: PyTorch FSDP2 shards weights,
    gradients and optimizer state over the ranks (--backend)."""
    grad_sync: Literal["dense", "topk", "delayed"] | None = None
    """Gradient sync between ranks: dense all-reduce; topk sends the largest
    --sparse-grad-ratio of each gradient, with error feedback; delayed steps locally and
    averages weights every --sync-every steps; empty: topk when --sparse-grad-ratio is given,
    delayed when --sync-every > 1, else dense (--grad-sync)."""
    grad_sync_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of dense gradient reduction (all-reduce, or FSDP's reduce-scatter): bf16
    halves the bytes and sums in bf16."""
    sparse_grad_ratio: float | None = None
    """Fraction of each gradient's entries that top-k sync sends, as values + indices, e.g.
    0.05 (--sparse-grad-ratio)."""
    sparse_grad_ratio_overrides: str = "embed|wte|wpe|lm_head|norm|ln_=1.0"
    """Top-k ratios per parameter: PATTERN=RATIO pairs separated by commas, the first regex
    found in a parameter's name wins, 1.0 means dense; the default keeps embeddings, the output
    head and norms dense; '' sends every parameter at --sparse-grad-ratio
    (--sparse-grad-ratio-overrides)."""
    error_feedback: bool = True
    """Top-k: keep what was not sent in a per-rank residual that joins the next step's gradient
    (saved in checkpoints)."""
    topk_feedback: Literal["residual", "ef21"] = "residual"
    """Top-k with error feedback: `residual` adds what was not sent to the next step's gradient;
    `ef21` keeps per rank a running estimate of its gradient and sends the top-k of the change,
    and every rank steps with the average of the estimates (dense, so Adam never sees an entry
    that was held back for many steps arrive at once)."""
    sparse_warmup_steps: int = 0
    """Top-k: steps over which the ratio falls geometrically from 1.0 (dense) to its target."""
    sync_every: int = 1
    """Delayed sync: average the ranks' weights every k steps and at the last step
    (--sync-every)."""
    sync_moments: Literal["local", "average"] = "local"
    """Delayed sync: what happens to the optimizer's state (AdamW's moments, Lion's moment,
    Adafactor's statistics) when the weights are averaged: local (each rank keeps its own; no
    extra bytes) or average (averaged too, sent in bf16: with AdamW twice the bytes of a sync)
    (--sync-moments)."""
    context_parallel: int = 1
    """Ranks that share every sequence (--context-parallel N, with --nproc = dp x N): each holds
    a zig-zag share of each row (chunks r and 2N-1-r of 2N) and attention runs as a ring over
    them, so activations per rank fall about as 1/N. Llama family (no sliding windows), the
    reference step or the tiered runtime, dense fp32 gradient sync, fp32 or bf16; --seq-len a
    multiple of 2N."""
    fsdp_cpu_offload: bool = False
    """--backend fsdp: keep the shards of weights, gradients and optimizer state in host RAM
    and update them there (FSDP2 CPUOffloadPolicy)."""
    timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before the run fails (a rank that died
    leaves the others waiting this long)."""


@dataclass(kw_only=True)
class MonitorConfig:
    tensorboard: bool = False
    """Also write every metric to TensorBoard event files under RUN_DIR/tensorboard; needs the
    optional dependency: pip install 'tierlm[tensorboard]' (--tensorboard)."""
    log_every: int = 10
    """Steps between progress lines when stdout is not a terminal (CI, files); a terminal gets
    a live view redrawn in place."""
    trace_step: int = 0
    """Record a timeline of this optimizer step (1-based): every action, wait, copy, disk
    request and optimizer update with its start and end, beside the planner's predicted
    timeline of the same step, to RUN_DIR/trace.json (Chrome trace format: open it in
    ui.perfetto.dev; `tierlm report` draws it). 0: off. Tiered runtime only
    (--monitor.trace_step)."""


@dataclass(kw_only=True)
class RunConfig:
    out: str | None = None
    """Run directory; empty means runs/<model>-<date>-<time> (--out)."""
    resume: str | None = None
    """Run directory whose newest valid checkpoint to continue from; `auto`: the newest valid
    checkpoint under --out, or a fresh start when there is none, so the same command line can
    be rerun after any crash (--resume)."""
    overwrite: bool = False
    """Start over in a run directory that already holds a run: its config, metrics,
    checkpoints, report, exports and disk-tier files are deleted first (other files are left
    alone). Without it (or --resume) such a directory is refused, so a rerun never mixes two
    runs (--overwrite)."""
    keep_checkpoints: int = 3
    """Keep only the newest N checkpoints (older ones are deleted after each save); 0 keeps
    all (--keep-checkpoints)."""
    seed: int = 0
    """Seed for weights, data order, dropout and sampling (--seed)."""
    device: str = "auto"
    """Device to train on: auto (CUDA when present), cpu, cuda, or sim:PROFILE (e.g.
    sim:rtx4090), the tiered runtime on this machine's CPU with a GPU of that hardware profile
    simulated in virtual time: exact numbers, the simulated step time and its split per lane
    (--device)."""
    compile: Literal["off", "segments"] = "off"
    """segments: torch.compile one block's forward (every block of the model runs the same
    compiled code, its weights passed in, so streaming never recompiles) and the head's chunk
    loss; the first step compiles, later runs read the kernels from the inductor cache under
    tierlm's cache dir. fp32 or bf16 (`auto` stops at bf16), not fp8, not with selective or
    dynamic checkpointing, --backend fsdp or --context-parallel; LoRA, QLoRA and data parallel
    compile (--compile)."""
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype of the weights in the Hugging Face export (RUN_DIR/hf at the end of a run, and
    `tierlm export`); auto: the dtype of the weights the run started from (the --model
    checkpoint's, e.g. bfloat16; float32 for a --model-size preset) (--export-dtype)."""


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and packing."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop length, batching, evaluation and checkpoints."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (--finetune lora)."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric precision."""
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    """Activation memory."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Tiered placement of model state."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-process training."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Live view, metrics and alerts."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory, resume, seed, device and export."""


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
}

_BYTE_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
    "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str, key: str = "size") -> int:
    """'1.5GiB' -> 1610612736. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _BYTE_UNITS:
        raise ConfigError(f"{key}: {text!r} is not a size; write e.g. 8GiB, 512MiB or 2GB")
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right under each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_fields() -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field of `Config`."""
    out = []
    top_hints = _hints(Config)
    for section in dataclasses.fields(Config):
        cls = top_hints[section.name]
        hints = _hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f"{section.name}.{f.name}", hints[f.name], default, docs.get(f.name, "")))
    return out


def describe_type(tp: Any) -> str:
    """How a field's allowed values read in an error message."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(parts) + " (or empty)"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise naming the key."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: got {value!r}, expected {describe_type(tp)}")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        for arg in args:
            try:
                return coerce(key, value, arg)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        raise bad
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if not isinstance(value, int | float | str):
            raise bad
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise bad from None
        if not math.isfinite(number):  # nan/inf would slip through every range check
            raise ConfigError(f"{key}: got {value!r}, expected a finite number")
        return number
    if tp is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise bad
    raise bad


def _nearest(name: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def from_dict(data: dict[str, Any], *, origin: str = "config") -> Config:
    """Build a Config from a nested mapping, rejecting unknown keys and bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(data).__name__}")
    top_hints = _hints(Config)
    sections = {}
    for name, value in data.items():
        if name not in top_hints:
            raise ConfigError(
                f"{origin}: unknown section {name!r}{_nearest(str(name), list(top_hints))}; "
                f"allowed: {', '.join(top_hints)}"
            )
        cls = top_hints[name]
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: section {name!r} must be a mapping of keys to values")
        hints = _hints(cls)
        kwargs = {}
        for key, raw in value.items():
            if key not in hints:
                raise ConfigError(
                    f"{origin}: unknown key {name}.{key}{_nearest(str(key), list(hints))}; "
                    f"allowed in {name}: {', '.join(hints)}"
                )
            kwargs[key] = coerce(f"{name}.{key}", raw, hints[key])
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {p}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {p}: expected a mapping of sections at the top level")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    if not name:
        raise ConfigError(f"override {key!r}: expected section.key")
    node = data.setdefault(section, {})
    if not isinstance(node, dict):
        raise ConfigError(f"override {key!r}: section {section!r} is not a mapping")
    node[name] = value


def resolve(config_file: str | None, overrides: dict[str, Any]) -> Config:
    """Defaults < YAML file < dotted overrides (from flags)."""
    data = load_yaml(config_file) if config_file else {}
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return from_dict(data, origin=str(config_file) if config_file else "config")


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


_FP8 = ("fp8",)
_LOW = ("bf16", "fp8")


def mode_only_flags(p: PrecisionConfig) -> list[tuple[str, tuple[str, ...]]]:
    """The precision flags `p` sets that only mean something under some compute precisions:
    (the flag as the user gave it, those precisions)."""
    d = PrecisionConfig()
    table = (
        ("--fp8-layers", p.fp8_layers, d.fp8_layers, _FP8),
        ("--bf16-layers", p.bf16_layers, d.bf16_layers, _LOW),
        ("--fp32-layers", p.fp32_layers, d.fp32_layers, _LOW),
        ("--fp8-scaling " + p.fp8_scaling, p.fp8_scaling, d.fp8_scaling, _FP8),
        ("--fp8-history", p.fp8_history, d.fp8_history, _FP8),
        ("--precision.fp8_input_scale", p.fp8_input_scale, d.fp8_input_scale, _FP8),
        ("--precision.fp8_grad_scale", p.fp8_grad_scale, d.fp8_grad_scale, _FP8),
        ("--precision.fp8_overflow_steps", p.fp8_overflow_steps, d.fp8_overflow_steps, _FP8),
        ("--precision.fp8_overflow_fraction", p.fp8_overflow_fraction,
         d.fp8_overflow_fraction, _FP8),
        ("--fp8-emulate", p.fp8_emulate, d.fp8_emulate, _FP8),
    )
    return [(flag, modes) for flag, value, default, modes in table if value != default]


def check_precision_flags(p: PrecisionConfig, mode: str, auto_why: str | None = None) -> None:
    """Refuse a flag that the compute precision `mode` would silently ignore. `auto_why`: `mode`
    is what --precision auto resolved to, and why (the error says so)."""
    for flag, modes in mode_only_flags(p):
        if mode in modes:
            continue
        wanted = " or ".join(modes)
        if auto_why is None:
            raise ConfigError(f"{flag} has no effect with --precision {mode}; use --precision "
                              f"{wanted}")
        raise ConfigError(f"{flag} has no effect: --precision auto resolved to {mode} here "
                          f"({auto_why}); add --precision {wanted}, or drop {flag.split()[0]}")


def validate(cfg: Config) -> None:
    """Value checks and combinations that cannot work; each error names the flag to change."""
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
    if cfg.activations.overrides:
        from tierlm.activations.overrides import parse_overrides

        try:
            parse_overrides(cfg.activations.overrides)
        except ValueError as exc:
            raise ConfigError(f"--activations.overrides: {exc}") from None
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
    ratio = cfg.distributed.sparse_grad_ratio
    if ratio is not None and not 0 < ratio <= 1:
        raise ConfigError(f"--sparse-grad-ratio: must be in (0, 1], got {ratio}")
    from tierlm.distributed.checks import validate_distributed

    validate_distributed(cfg)
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


def lora_of(cfg: Config) -> LoraConfig | None:
    """The adapters' config under --finetune lora or qlora, else None (full fine-tuning)."""
    return cfg.lora if cfg.train.finetune in ("lora", "qlora") else None


def base_format_of(cfg: Config, precision: str) -> str:
    """How the frozen base is held and streamed (tierlm.models.frozen), given the resolved
    compute `precision`: nf4 under --finetune qlora (decoded to what the layers compute in),
    its bf16 compute copy under --finetune lora in bf16, else fp32."""
    if cfg.train.finetune == "qlora":
        return "nf4"
    return "bf16" if cfg.train.finetune == "lora" and precision == "bf16" else "fp32"


def uses_tiered_runtime(cfg: Config) -> bool:
    """Whether the run needs the tiered runtime (tierlm.runtime.Engine) rather than the plain
    reference step: any offload policy, or an activation policy the reference does not have
    (it has none and full; the runtime with everything resident stands in for it)."""
    return (
        cfg.memory.offload_policy != "none"
        or cfg.activations.policy not in ("none", "full")
        or bool(cfg.activations.overrides)
    )


def _check_device(cfg: Config) -> None:
    device = cfg.run.device
    if device in ("auto", "cpu", "cuda"):
        return
    from tierlm.memory.hardware import PROFILES

    names = ", ".join(f"sim:{p}" for p in PROFILES)
    if not device.startswith("sim:"):
        raise ConfigError(f"--device {device}: one of auto, cpu, cuda, or a simulated GPU "
                          f"({names})")
    if device[len("sim:"):] not in PROFILES:
        raise ConfigError(f"--device {device}: no hardware profile of that name; one of {names}")
    if not uses_tiered_runtime(cfg):
        raise ConfigError(f"--device {device} simulates the tiered runtime's step: pass "
                          "--offload-policy auto, host, disk or tiered")
    if cfg.distributed.nproc > 1 or cfg.distributed.context_parallel > 1:
        raise NotSupportedYet(f"--device {device} with --nproc or --context-parallel",
                              "the simulated device runs one process")


def check_supported(cfg: Config) -> None:
    """Refuse flags whose feature is not built yet, instead of silently ignoring them."""
    _check_device(cfg)
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
