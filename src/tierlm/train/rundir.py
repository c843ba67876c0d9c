"""The run directory: usable, one process at a time, one run in it.

A run directory holds one run. Before anything is written into it the directory is created
(an unusable `--out` is a one-line error, not a traceback), locked for the run's life, and
claimed: a directory that already holds a run is refused unless the run continues it
(`--resume`) or replaces it (`--overwrite`, which first deletes the old run's files), so that
metrics, checkpoints and reports of two runs never mix. The disk tier's working files are
deleted when a run ends normally (`OffloadDir`): the checkpoints hold the run's state, and a
resume rewrites the disk tier from them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tierlm.config import Config, ConfigError

LOCK_FILE = ".lock"
# Either means a run trained here. config.yaml alone does not: a run refused before its first
# step (a budget no plan fits, too little disk) leaves only that, and the user reruns the same
# command with other flags.
RUN_MARKERS = ("metrics.jsonl", "checkpoints")
# Everything a run (and `tierlm report`) writes into its directory; `--overwrite` deletes these
# and nothing else, so a directory shared with other files (`--out .`) keeps them.
RUN_OUTPUTS = RUN_MARKERS + ("config.yaml", "hf", "adapter", "report", "tensorboard",
                             "trace.json", "offload")
# report-vs-<other run>, and the temporary siblings of the atomic writers (.hf.tmp-..., ...)
RUN_OUTPUT_PREFIXES = ("report-vs-", ".hf.", ".adapter.")


def run_dir_flag(cfg: Config) -> str:
    """The flag that named the run directory: `--resume DIR`, else `--out`."""
    return "--resume" if cfg.run.resume not in (None, "auto") else "--out"


def make_run_dir(run_dir: Path, flag: str = "--out") -> None:
    """Create `run_dir` (and its parents), or say in one line why it cannot be used."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"{flag} {run_dir}: that is a file, not a directory; choose another "
                          f"{flag}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # /proc/x, a path under a regular file, a read-only parent
        raise ConfigError(f"{flag} {run_dir}: cannot create the run directory "
                          f"({exc.strerror or exc}); choose another {flag}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {run_dir}: the run directory is not writable; choose "
                          f"another {flag}")


def precheck_run_dir(cfg: Config) -> None:
    """What can be refused about the run directory before any process is launched or any
    model built (the trainer checks again under its lock): unusable, or holding a run."""
    flag = run_dir_flag(cfg)
    named = cfg.run.resume if flag == "--resume" else cfg.run.out
    if named:  # else a new directory named by the clock
        make_run_dir(Path(named), flag)
        check_new_run(Path(named), cfg)


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_MARKERS)


def check_new_run(run_dir: Path, cfg: Config) -> None:
    """Refuse to start a new run in a directory that holds one, unless `--resume` continues it
    or `--overwrite` replaces it."""
    if cfg.run.resume or cfg.run.overwrite or not holds_run(run_dir):
        return
    raise ConfigError(
        f"--out {run_dir} already holds a run (its metrics.jsonl or checkpoints); "
        f"continue it with --resume {run_dir} (or --resume auto), or start over with "
        "--overwrite, which deletes it"
    )


def clear_run(run_dir: Path, extra: tuple[Path, ...] = ()) -> int:
    """Delete the outputs of the run in `run_dir` (and `extra` paths inside it, e.g. a relative
    --offload-dir); returns the bytes freed. Other files are left alone."""
    doomed = [run_dir / name for name in RUN_OUTPUTS]
    doomed += [p for p in run_dir.iterdir() if p.name.startswith(RUN_OUTPUT_PREFIXES)]
    inside = run_dir.resolve()
    doomed += [p for p in extra if p.resolve() != inside and p.resolve().is_relative_to(inside)]
    freed = 0
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            freed += tree_bytes(path)
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            freed += path.lstat().st_size
            path.unlink()
    return freed


def tree_bytes(path: Path) -> int:
    """Bytes a directory tree occupies on its disk (allocated blocks, as `du`)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# -- one process per run directory ----

# The locks this process holds, by lock file: a second Trainer of the same process in the same
# directory (a resume in a test) shares the lock; only other processes are kept out.
_HELD: dict[tuple[int, int], list[int]] = {}


@dataclass
class RunDirLock:
    """An exclusive `flock` on RUN_DIR/.lock, which holds the PID of its holder. The kernel
    releases it when the process dies, so a lock file left by a killed run blocks nothing."""

    path: Path
    key: tuple[int, int]
    released: bool = field(default=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[self.key]
            os.close(entry[0])  # closing the last descriptor drops the flock

    def __del__(self) -> None:
        self.release()


def lock_run_dir(run_dir: Path, flag: str = "--out") -> RunDirLock:
    """Hold the run directory for this process, or raise ConfigError naming the PID of the
    process that holds it."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise ConfigError(f"{flag} {run_dir}: cannot write there ({exc.strerror or exc}); "
                          f"choose another {flag}") from None
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if key in _HELD:  # this process holds it already
        os.close(fd)
        _HELD[key][1] += 1
        return RunDirLock(path, key)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"{flag} {run_dir}: another tierlm process (PID {holder}) is running in this run "
            f"directory; wait for it to end or stop it, or choose another {flag}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = [fd, 1]
    return RunDirLock(path, key)


def open_run_dir(run_dir: Path, cfg: Config, offload_dir: Path,
                 log: Callable[[str], None] = print) -> RunDirLock:
    """Create, lock and claim `run_dir` for this run (rank 0 only: the other ranks of a run
    write into the directory rank 0 holds): refused when it holds a run and neither --resume
    nor --overwrite is given; with --overwrite the old run's files are deleted first."""
    flag = run_dir_flag(cfg)
    make_run_dir(run_dir, flag)
    lock = lock_run_dir(run_dir, flag)  # before anything in the directory is read or changed
    try:
        check_new_run(run_dir, cfg)
        if cfg.run.overwrite:
            had_run = holds_run(run_dir)
            freed = clear_run(run_dir, (offload_dir,))
            if had_run or freed:
                log(f"--overwrite: deleted the previous run in {run_dir} "
                    f"({format_bytes(freed)})")
    except BaseException:
        lock.release()
        raise
    return lock


# -- the disk tier's working files ----

@dataclass
class OffloadDir:
    """The disk tier's directory. Its files are working state only (a resume rewrites them
    from the checkpoint), so a run that ends normally deletes them: the default RUN_DIR/offload
    whole (only the disk tier writes there; a crashed run's leftovers go too), any other
    --offload-dir file by file, exactly the files the disk tier wrote (it may hold other
    things, the run directory itself among them), then the folders they leave empty."""

    path: Path
    default: bool
    existed: bool

    @staticmethod
    def note(path: Path, run_dir: Path) -> OffloadDir:
        return OffloadDir(path, path == run_dir / "offload", path.is_dir())

    def remove(self, written: list[Path], log: Callable[[str], None] = print) -> int:
        """Delete the disk tier's files (`written`: the store's `disk_paths()`) and say so in
        one line; returns the bytes freed."""
        if not self.path.is_dir():
            return 0
        if self.default:
            freed = tree_bytes(self.path)
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            freed = 0
            for f in written:
                with contextlib.suppress(OSError):
                    freed += f.lstat().st_blocks * 512
                    f.unlink()
                # the segment folders the files were in, up to the offload directory
                for parent in f.parents:
                    if parent == self.path or not parent.is_relative_to(self.path):
                        break
                    with contextlib.suppress(OSError):
                        parent.rmdir()  # only when empty
            if not self.existed:  # made for this run, and empty now
                with contextlib.suppress(OSError):
                    self.path.rmdir()
        if freed:
            log(f"disk tier: deleted its working files in {self.path} "
                f"({format_bytes(freed)}); the checkpoints hold the run's state")
        return freed
