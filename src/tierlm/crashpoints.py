"""Named crash points for the kill test (tests/checkpoint/test_kill.py); test-only, inert otherwise.

A few places where a crash is most dangerous call `crash_point(name)`: between the files of a
checkpoint being written (`checkpoint-file`) and right after a disk-tier write was issued, while
its bytes are in flight (`disk-write`). With the environment variable

    TIERLM_CRASH_AT=<name>:<n>

the process sends itself SIGKILL at the n-th time it reaches point <name> (counting from 1), so a
test can kill a training run at exactly those moments instead of hoping a timer lands there.
Without the variable (every real run) a call is one attribute check.
"""

from __future__ import annotations

import os
import signal

ENV = "TIERLM_CRASH_AT"


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    if not name or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV}={spec!r}: expected <point>:<n> with n >= 1")
    return name, int(count)


_target = _parse(os.environ.get(ENV))
_seen: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if TIERLM_CRASH_AT names this point and occurrence."""
    if _target is None or _target[0] != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
