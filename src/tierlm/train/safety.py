"""Guards that run with the training loop (ARCHITECTURE.md invariants 3 and 4).

- `NonFiniteGuard`: a non-finite step is already skipped by the runtime (weights and optimizer
  state untouched); after `max_in_a_row` of them the run stops with a diagnosis built from the
  steps it saw (is the loss itself non-finite? did gradient norms blow up first? are the weights
  still finite? which learning rate and precision?).
- `MemoryWatch`: samples this process's RSS (current and peak) and the RAM still available
  every step for the metrics, and warns once when the machine is close to the OOM killer.
- `check_token_stream`: token ids the model cannot embed are rejected naming the document
  (file, or file:line for .jsonl) and the position, before any step runs.
- `storage_failure`: turns a disk-full or I/O error in the middle of a run into a clean stop
  that names the path, the space, and the last good checkpoint (verified).

The error classes below are what the CLI prints as `tierlm: error: ...`.
"""

from __future__ import annotations

import ctypes
import errno
import math
import shutil
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from tierlm.checkpoint import CheckpointWriteError
from tierlm.data import DataError, Document
from tierlm.memory.disk import DiskFullError, DiskIOError
from tierlm.runtime.state import opened


class ReliabilityError(RuntimeError):
    """The run was refused or stopped to protect it; the message says why and what to change."""


class DiskSpaceError(ReliabilityError):
    """Not enough free disk space for the run, before or during training."""


class StorageError(ReliabilityError):
    """A disk write or read failed during training; the run stopped with its checkpoints safe."""


class HostMemoryError(ReliabilityError):
    """The run needs more RAM than the machine has available."""


class NonFiniteError(ReliabilityError):
    """Too many non-finite steps in a row; the message holds the diagnosis."""


# -- numerical faults ----

def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


class NonFiniteGuard:
    """Counts skipped (non-finite) steps in a row and stops the run after `max_in_a_row`
    (0: never). When it stops, `weights_finite` is asked for the diagnosis and, if the weights
    are sound, `save` writes a checkpoint of that last good state (past the bad batches)."""

    def __init__(
        self,
        max_in_a_row: int,
        *,
        precision: str,
        grad_clip: float,
        weights_finite: Callable[[], bool],
        save: Callable[[], Any] = lambda: None,
    ) -> None:
        self.max_in_a_row = max_in_a_row
        self.precision = precision
        self.grad_clip = grad_clip
        self.weights_finite = weights_finite
        self.save = save
        self.recent: deque[dict[str, Any]] = deque(maxlen=max(max_in_a_row, 0) + 20)
        self.in_a_row = 0

    def observe(self, rec: dict[str, Any]) -> None:
        self.recent.append(rec)
        self.in_a_row = self.in_a_row + 1 if rec["skipped"] else 0
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            weights_ok = self.weights_finite()
            if weights_ok:
                self.save()
            raise NonFiniteError(self.diagnose(weights_ok))

    def diagnose(self, weights_ok: bool) -> str:
        recs = list(self.recent)
        bad, before = recs[-self.in_a_row :], recs[: -self.in_a_row]
        first, last = bad[0]["step"], bad[-1]["step"]
        lines = [
            f"{len(bad)} steps in a row ({first}..{last}) had a non-finite gradient and were "
            f"skipped; the weights and optimizer state are still those after step {first - 1}."
        ]
        causes = []
        if not weights_ok:
            causes.append(
                "the weights themselves hold inf/NaN, so every forward pass fails: resume from "
                "an earlier checkpoint (they are kept by --keep-checkpoints)"
            )
        elif all(not _finite(r["loss"]) for r in bad):
            causes.append(
                "the loss is already non-finite in the forward pass although the weights are "
                "finite: suspect the data of these steps (check --data) or an activation "
                "overflow" + (f" in {self.precision}" if self.precision != "fp32" else "")
            )
        else:
            causes.append(
                "the loss is finite but its gradient overflows in the backward pass"
                + ("" if self.grad_clip > 0 else "; gradient clipping is off (optim.grad_clip)")
            )
        norms = [r["grad_norm"] for r in before if _finite(r["grad_norm"])]
        if len(norms) >= 4 and norms[-1] > 10 * min(norms[: len(norms) // 2]):
            causes.append(
                f"gradient norms grew from {min(norms[: len(norms) // 2]):.3g} to "
                f"{norms[-1]:.3g} before the failure: the run is diverging"
            )
        lr = bad[-1].get("lr")
        if lr is not None:
            causes.append(f"the learning rate was {lr:.3g}: try a lower --lr or a longer warm-up")
        if self.precision == "fp8":
            causes.append("fp8 scales may overflow: try --precision bf16")
        elif self.precision == "bf16":
            causes.append("bf16 has a narrow mantissa: check with --precision fp32")
        lines.append("Diagnosis: " + "; ".join(causes) + ".")
        lines.append(
            ("A checkpoint of the last good state was written; f" if weights_ok else "F")
            + "ix the cause and continue with --resume RUN_DIR (--max-skipped-in-a-row 0 never "
            "stops)."
        )
        return " ".join(lines)


def all_finite(shards: Iterable[tuple[str, Any, Any]]) -> bool:
    """Whether every weight is finite, streamed shard by shard (`stepper.state_shards()`)."""
    for _, weights, _ in shards:
        for t in weights.values():
            with opened(t) as values:  # a disk-tier tensor is read one at a time
                if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                    return False
    return True


# -- host memory ----

def _status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def malloc_trim() -> None:
    """Give glibc's freed heap back to the kernel (it keeps freed blocks otherwise)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def map_large_buffers(threshold_bytes: int = 128 << 10) -> None:
    """Serve every allocation above `threshold_bytes` with a mapping of its own, unmapped when
    freed (glibc otherwise raises that threshold as buffers are freed and keeps them in a heap
    that fragments). It makes every such buffer a fresh zeroed mapping, a tax on each step
    (1.25-1.43x a reference step on 135M, bench/allocator.py), so only where it buys a budget:
    a tiered run on a CPU with a --device-budget, whose "device" is host RAM: torch's compute
    buffers there are the device tier's and must leave RSS as the budget says. Process-wide
    and for good (glibc has no way back to its dynamic threshold)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes)


def rss_bytes() -> int:
    return _status_bytes("VmRSS") or psutil.Process().memory_info().rss


class MemoryWatch:
    """Per-step host memory numbers for the metrics, and one loud warning (plus a heap trim)
    when the RAM still available drops under `low_fraction` of the total.

    RSS follows the ledger because the runtime's host buffers (the store's state, the pinned
    arena's blocks, offloaded activations; tierlm.memory.disk.mapped_empty) are mappings of
    their own, unmapped when freed, while torch's own buffers keep glibc's defaults: its heap
    reuses a freed activation's memory for the next step's without faulting fresh zeroed pages
    (a process-wide lower mmap threshold would, every step). What that heap keeps is given back
    at phase boundaries (`trim`: after setup, after a checkpoint or an export), when RAM runs
    low, and after every step where the device tier itself is host RAM (`trim_each_step`: a
    tiered run on a CPU, whose compute buffers are the device tier's and held to its budget)."""

    def __init__(self, log: Callable[[str], None], low_fraction: float = 0.05) -> None:
        self.log = log
        self.low_fraction = low_fraction
        self.warned = False
        self.trim_each_step = False  # set by the trainer once it knows where the device tier is
        self.start_rss_bytes = rss_bytes()  # the program itself, before any data or model

    def trim(self) -> None:
        """At a phase boundary (after setup: the model as built was handed to the runtime and
        freed; after a checkpoint or an export: their staging was freed)."""
        malloc_trim()

    def sample(self) -> dict[str, int | None]:
        if self.trim_each_step:
            malloc_trim()
        vm = psutil.virtual_memory()
        rec = {
            "rss_bytes": _status_bytes("VmRSS"),
            "rss_peak_bytes": _status_bytes("VmHWM"),
            "ram_available_bytes": vm.available,
        }
        if vm.available < self.low_fraction * vm.total:
            malloc_trim()
            if not self.warned:
                self.warned = True
                self.log(
                    f"WARNING: host RAM nearly exhausted ({vm.available / 2**30:.2f} GiB of "
                    f"{vm.total / 2**30:.2f} GiB available, this process holds "
                    f"{(rec['rss_bytes'] or 0) / 2**30:.2f} GiB): the OOM killer may end the "
                    "run; lower --host-budget so more state goes to the disk tier"
                )
        else:
            self.warned = False
        return rec


# -- input data ----

def check_token_stream(
    ids: torch.Tensor, vocab_size: int, docs: Sequence[Document], eos_id: int, source: str
) -> None:
    """Reject ids the embedding cannot take (out of vocabulary, or non-finite / fractional in a
    float stream), naming the document (file, or file:line) and the token's position in it."""
    flat = ids.flatten()
    bad = (flat < 0) | (flat >= vocab_size)
    if flat.is_floating_point():
        bad |= ~torch.isfinite(flat) | (flat != flat.round())
    if not bool(bad.any()):
        return
    pos = int(bad.nonzero()[0, 0])
    eos_before = (flat[:pos] == eos_id).nonzero()
    doc_index = eos_before.numel()  # each document's tokens end with one eos
    start = int(eos_before[-1, 0]) + 1 if doc_index else 0
    where = docs[doc_index].name if doc_index < len(docs) else f"{source} (after the last document)"
    value = flat[pos].item()
    raise DataError(
        f"{source}: token id {value} in {where} (token index {pos - start} in that document, "
        f"position {pos} of the token stream) is not a valid id for the model's vocabulary of "
        f"{vocab_size}; the tokenizer does not match the model (use the model's own tokenizer, "
        "or resize its embeddings)"
    )


# -- storage failures during the run ----

_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


def is_storage_failure(exc: BaseException) -> bool:
    """Disk-tier errors, failed checkpoint writes, and any OSError of a full or failing disk."""
    return isinstance(exc, DiskFullError | DiskIOError | CheckpointWriteError) or (
        isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS
    )


def last_good_text(last_good: Callable[[], Path | None], name: str) -> str:
    """What a stopped run says of its newest checkpoint (`last_good` finds and verifies it):
    `name` PATH is intact and verified, none was written yet, or the verification failed."""
    try:
        path = last_good()
    except Exception as verify_exc:  # verification itself failed: say so, do not hide it
        return f"the checkpoints could not be verified ({verify_exc})"
    return (f"{name} {path} is intact and verified" if path is not None
            else "no checkpoint had been written yet")


def storage_failure(
    exc: BaseException, step: int, run_dir: Path, last_good: Callable[[], Path | None]
) -> ReliabilityError:
    """The clean stop for a disk-full or I/O error at `step`: the original message (the disk
    tier's and the checkpoint writer's name the path and the bytes; a bare OSError gets the run
    directory and its free space added), what happened to the run, and the last good
    checkpoint, verified."""
    what = str(exc)
    if not isinstance(exc, DiskFullError | DiskIOError | CheckpointWriteError):
        where = getattr(exc, "filename", None) or run_dir
        try:
            free = f"{shutil.disk_usage(where).free / 2**20:.1f} MiB"
        except OSError:
            free = "an unknown amount"
        what = f"{what} (writing under {where}, {free} free there)"
    kept = last_good_text(last_good, "the last good checkpoint")
    full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
    cls = DiskSpaceError if full else StorageError
    return cls(
        f"{what}. Training stopped at step {step}; {kept}. "
        "Fix the disk, then continue with --resume RUN_DIR"
    )


# -- interrupts ----

class DeferredInterrupt:
    """Ctrl-C (SIGINT) or SIGTERM during a step is held until the step is complete, so the
    checkpoint written on the way out is a consistent state (a step cut in half would leave
    some segments updated and others not, and the data position ahead of the step counter).
    `check()` between steps raises KeyboardInterrupt if one arrived; a second signal stops the
    process at once, without a checkpoint. Installed only in the main thread."""

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.log = log
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.log("second interrupt: stopping now without a checkpoint (the last one is kept)")
            raise SystemExit(130)
        self.requested = True
        self.log("interrupt: finishing this step, then writing a checkpoint "
                 "(interrupt again to stop at once)")

    def check(self) -> None:
        if self.requested:
            raise KeyboardInterrupt

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
