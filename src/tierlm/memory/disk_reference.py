"""The disk's reference throughput: what `dd` moves with O_DIRECT in a directory, the ceiling
the disk tier (tierlm.memory.disk) is compared against by `tierlm probe` and the disk benches."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from pathlib import Path


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; False where that is not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _run_timed_s(cmd: list[str]) -> float:
    start_s = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    elapsed_s = time.perf_counter() - start_s
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return elapsed_s


def dd_throughput(
    directory: str | Path, size_bytes: int, *, block_bytes: int = 8 << 20
) -> tuple[float, float]:
    """Sequential O_DIRECT (write, read) throughput of `dd` in `directory`, in bytes/s.

    The ceiling DiskTier is compared against. The write includes its fsync; the page cache is
    dropped before the read where permitted. Needs a filesystem that accepts O_DIRECT.
    """
    dd = shutil.which("dd")
    if dd is None:
        raise RuntimeError("dd_throughput: `dd` is not on PATH")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    count = max(1, math.ceil(size_bytes / block_bytes))
    total_bytes = count * block_bytes
    path = directory / f".tierlm-dd-{os.getpid()}"
    try:
        write = [dd, "if=/dev/zero", f"of={path}", f"bs={block_bytes}", f"count={count}"]
        write_s = _run_timed_s([*write, "oflag=direct", "conv=fsync"])
        drop_page_cache()
        read_s = _run_timed_s(
            [dd, f"if={path}", "of=/dev/null", f"bs={block_bytes}", "iflag=direct"]
        )
    finally:
        path.unlink(missing_ok=True)
    return total_bytes / write_s, total_bytes / read_s
