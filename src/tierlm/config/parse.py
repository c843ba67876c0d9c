"""Building a `Config` from YAML and dotted overrides: field defaults < YAML file (``--config``)
< command-line flags. Unknown keys and values of the wrong type are refused naming the key;
`validate` then checks values and combinations."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from tierlm.config.aliases import flag_label
from tierlm.config.checks import validate
from tierlm.config.errors import ConfigError
from tierlm.config.fields import describe_type, type_hints
from tierlm.config.schema import Config


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML or command-line value to the field's type, or raise naming the key."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{flag_label(key)}: got {value!r}, expected {describe_type(tp)}")
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
    """Build a Config from a nested mapping, rejecting unknown keys and bad values, and run the
    config's own checks; `tierlm.plan.checks.from_dict` adds each feature's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(data).__name__}")
    top_hints = type_hints(Config)
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
        hints = type_hints(cls)
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
    """Defaults < YAML file < dotted overrides (from flags), with the config's own checks;
    `tierlm.plan.checks.resolve` adds each feature's."""
    data = load_yaml(config_file) if config_file else {}
    for key, value in overrides.items():
        set_dotted(data, key, value)
    return from_dict(data, origin=str(config_file) if config_file else "config")
