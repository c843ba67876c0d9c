"""Every check of a run's config, in one place: the config's own (values and combinations of its
fields, `tierlm.config.checks`), then each feature's, from the package that knows the feature:
the distributed strategies (`tierlm.distributed.checks`), the activation-override syntax
(`tierlm.activations.overrides`), the hardware profiles a simulated --device names
(`tierlm.memory.hardware`). The command line, the trainer and the planner check through here, so
no way into a run skips a feature's check, and the config package imports nothing above it.

Torch-free: the command line checks its flags before anything imports torch (`tierlm --help`
and a bad flag answer at once).
"""

from __future__ import annotations

from typing import Any

from tierlm import config
from tierlm.activations.overrides import check_overrides
from tierlm.config import Config
from tierlm.config.run import PLAIN_DEVICES
from tierlm.distributed.checks import validate_distributed


def _check_features(cfg: Config) -> None:
    check_overrides(cfg.activations)
    validate_distributed(cfg)


def validate(cfg: Config) -> None:
    """Values and combinations that cannot work, each error naming the flag to change: the
    config's own checks, then the features'."""
    config.validate(cfg)
    _check_features(cfg)


def check_supported(cfg: Config) -> None:
    """Refuse flags whose feature is not built yet (the simulated devices first)."""
    if cfg.run.device not in PLAIN_DEVICES:
        # memory/'s package imports torch: a run on a plain device is checked without it
        from tierlm.memory.hardware import check_device

        check_device(cfg)
    config.check_supported(cfg)


def check(cfg: Config) -> None:
    """Everything a run's config must pass before anything is built: `validate`, then
    `check_supported`."""
    validate(cfg)
    check_supported(cfg)


def from_dict(data: dict[str, Any], *, origin: str = "config") -> Config:
    """`tierlm.config.from_dict` (which runs the config's own checks), then the features'."""
    cfg = config.from_dict(data, origin=origin)
    _check_features(cfg)
    return cfg


def resolve(config_file: str | None, overrides: dict[str, Any]) -> Config:
    """Defaults < YAML file < dotted overrides (from flags), checked as `validate` does."""
    cfg = config.resolve(config_file, overrides)
    _check_features(cfg)
    return cfg
