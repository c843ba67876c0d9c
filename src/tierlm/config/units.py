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


# a rate's prefix: decimal (G = 10^9) or binary (Gi = 2^30)
_RATE_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
                "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_BIT_UNITS = ("bit", "bits", "bit/s", "bits/s", "bps", "b/s", "be")  # 'be': 10GbE
_BYTE_UNITS_PER_S = ("B", "B/s", "Bps", "byte/s", "bytes/s")


def parse_bandwidth(text: str, key: str = "--net-bandwidth") -> float:
    """A link rate in bytes per second: '25Gbit', '25Gb/s', '10GbE' (bits: lower-case b) or
    '3GB/s', '3GiB/s' (bytes: upper-case B). A bare number is refused: bits or bytes would be
    a guess."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?([a-zA-Z/]+)\s*", str(text))
    unit = match.group(3) if match else ""
    bits = unit.lower() in _BIT_UNITS and not unit.startswith("B")
    if not match or not (bits or unit in _BYTE_UNITS_PER_S):
        raise ConfigError(f"{key}: {text!r} is not a link rate; write e.g. 25Gbit, 10GbE "
                          "(bits per second) or 3GB/s (bytes per second)")
    rate = float(match.group(1)) * _RATE_PREFIX[(match.group(2) or "").lower()]
    if rate <= 0:
        raise ConfigError(f"{key}: {text!r}: the link rate must be above 0")
    return rate / 8 if bits else rate
