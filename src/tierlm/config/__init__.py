"""Typed run configuration: keyword-only dataclasses, YAML files, dotted overrides.

Every field carries a docstring (the string literal under it); the CLI's help text is read from
those docstrings, so the documentation and the parser cannot drift apart. Resolution order:
field defaults < YAML file (``--config``) < command-line flags.

- model, data, training, precision, memory, distributed, run: the sections' dataclasses
- schema: `Config`, one field per section, and what a config implies as a whole
- aliases: the seed-compatible flags; fields: the schema read back (flags, help, docs/cli.md)
- parse: YAML and dotted overrides to a `Config`; units: byte sizes
- checks: the config's own checks of values and combinations

This package imports nothing of tierlm: the checks that need a feature's knowledge live in that
feature's package, and `tierlm.plan.checks` runs them with these.
"""

from tierlm.config.aliases import SEED_FLAGS
from tierlm.config.checks import check_supported, validate
from tierlm.config.data import DataConfig
from tierlm.config.distributed import DistributedConfig
from tierlm.config.errors import ConfigError, NotSupportedYet
from tierlm.config.fields import describe_type, field_docs, leaf_fields
from tierlm.config.memory import ActivationConfig, MemoryConfig
from tierlm.config.model import LORA_DEFAULT_TARGETS, MODEL_SIZES, LoraConfig, ModelConfig
from tierlm.config.parse import coerce, from_dict, load_yaml, resolve, set_dotted, to_dict
from tierlm.config.precision import PrecisionConfig, check_precision_flags, mode_only_flags
from tierlm.config.run import MonitorConfig, RunConfig
from tierlm.config.schema import Config, base_format_of, lora_of, uses_tiered_runtime
from tierlm.config.training import OptimConfig, TrainConfig
from tierlm.config.units import parse_bytes

__all__ = [
    "LORA_DEFAULT_TARGETS",
    "MODEL_SIZES",
    "SEED_FLAGS",
    "ActivationConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "MonitorConfig",
    "NotSupportedYet",
    "OptimConfig",
    "PrecisionConfig",
    "RunConfig",
    "TrainConfig",
    "base_format_of",
    "check_precision_flags",
    "check_supported",
    "coerce",
    "describe_type",
    "field_docs",
    "from_dict",
    "leaf_fields",
    "load_yaml",
    "lora_of",
    "mode_only_flags",
    "parse_bytes",
    "resolve",
    "set_dotted",
    "to_dict",
    "uses_tiered_runtime",
    "validate",
]
