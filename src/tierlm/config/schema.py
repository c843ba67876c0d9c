"""The whole run's config, one field per section, and what a config implies as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierlm.config.data import DataConfig
from tierlm.config.distributed import DistributedConfig
from tierlm.config.memory import ActivationConfig, MemoryConfig
from tierlm.config.model import LoraConfig, ModelConfig
from tierlm.config.precision import PrecisionConfig
from tierlm.config.run import MonitorConfig, RunConfig
from tierlm.config.training import OptimConfig, TrainConfig


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


def lora_of(cfg: Config) -> LoraConfig | None:
    """The adapters' config under --finetune lora or qlora, else None (full fine-tuning)."""
    return cfg.lora if cfg.train.finetune in ("lora", "qlora") else None


def base_format_of(cfg: Config, precision: str) -> str:
    """How the frozen base is held and streamed (tierlm.runtime.frozen), given the resolved
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
