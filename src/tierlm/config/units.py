"""Byte sizes as flags write them: 8GiB, 512MiB, 2GB."""

from __future__ import annotations

import re

from tierlm.config.errors import ConfigError

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
