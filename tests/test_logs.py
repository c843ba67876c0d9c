import logging

from tierlm.logs import quiet_library_noise


def _emitted(name: str, message: str) -> bool:
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger(name)
    handler = _Keep()
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return bool(seen)


def test_known_library_noise_is_dropped_and_other_warnings_kept():
    quiet_library_noise()
    quiet_library_noise()  # idempotent: one filter per logger
    assert len(logging.getLogger("torchao").filters) == 1
    assert not _emitted("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load")
    assert _emitted("torchao", "Failed to load config.json")  # not an extension
    assert _emitted("torchao", "something else went wrong")
    assert not _emitted("torch.utils._pytree",
                        "<enum 'KernelPreference'> is an Enum subclass and is now natively")
    assert _emitted("torch.utils._pytree", "another pytree warning")
