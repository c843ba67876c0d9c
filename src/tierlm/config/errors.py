"""The config's errors: the CLI prints them as one line `tierlm: error: ...`."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key and what is allowed."""


class NotSupportedYet(ConfigError):
    """The flag names a feature that tierlm does not implement yet."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"not supported yet: {flag} ({why})")

