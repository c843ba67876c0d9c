"""Disk tier mechanism: the bytes of CPU tensors to and from files on NVMe.

Disk-resident segments keep master weights, gradients and optimizer state in files under the
offload directory. `DiskTier` moves one contiguous CPU tensor to or from one file, split into
chunks issued in parallel on a thread pool (the GIL is released inside `os.pwritev`/`os.preadv`,
so the threads overlap). Where the filesystem allows it, files are opened with O_DIRECT: the page
cache is bypassed (no double buffering of hundreds of GB of state in RAM, no writeback storms),
which requires buffers aligned to ALIGN_BYTES; `aligned_empty` allocates them
(tierlm.memory.buffers). `dd_throughput`, the reference it is compared against, is
tierlm.memory.disk_reference's; both are importable from here too.

This module is mechanism only: which tensors live on disk, and when they move, is the planner's
and the runtime's business.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from tierlm.memory.buffers import ALIGN_BYTES, aligned_empty, mapped_empty, round_up
from tierlm.memory.disk_reference import dd_throughput, drop_page_cache
from tierlm.trace import NO_TRACER, NoTracer, Tracer

__all__ = [
    "ALIGN_BYTES",
    "DiskFullError",
    "DiskIOError",
    "DiskTier",
    "aligned_empty",
    "mapped_empty",
    "dd_throughput",
    "drop_page_cache",
    "supports_direct_io",
]

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has no O_DIRECT


class DiskFullError(OSError):
    """A disk-tier write ran out of space (ENOSPC)."""


class DiskIOError(OSError):
    """Any other disk-tier I/O failure; the message names the file and the operation."""


def _memory(address: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory, without copying. The caller keeps the owner alive."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _pwrite_all(fd: int, bufs: list[memoryview], offset: int) -> None:
    while bufs:
        n = os.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote no bytes")
        offset += n
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def _pread_at_least(fd: int, bufs: list[memoryview], offset: int, need_bytes: int) -> None:
    """Fill `bufs` from `offset`; a short read past `need_bytes` (end of file) is fine."""
    got = 0
    while got < need_bytes:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file after {offset} bytes")
        got += n
        offset += n
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs.pop(0))
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def _preallocate(fd: int, nbytes: int) -> None:
    """Reserve the file's blocks now, so a full disk fails here and not mid-request."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        # No fallocate on this filesystem (glibc's fallback of writing single bytes fails on an
        # O_DIRECT descriptor): the writes themselves will report ENOSPC.
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def supports_direct_io(directory: str | Path) -> bool:
    """Whether files in `directory` accept O_DIRECT (tmpfs before Linux 6.6 refuses it with EINVAL).

    Writes and reads back one aligned block through a probe file, which is then removed.
    """
    if not _O_DIRECT:
        return False
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".tierlm-direct-probe-{os.getpid()}-{threading.get_ident()}"
    out = aligned_empty(ALIGN_BYTES, torch.uint8, pin=False).fill_(0xA5)
    back = aligned_empty(ALIGN_BYTES, torch.uint8, pin=False).zero_()
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        _pwrite_all(fd, [_memory(out.data_ptr(), ALIGN_BYTES)], 0)
        _pread_at_least(fd, [_memory(back.data_ptr(), ALIGN_BYTES)], 0, ALIGN_BYTES)
        return torch.equal(out, back)
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


class _Request:
    """One write or read of a whole tensor: its chunks, and the future they complete together."""

    def __init__(self, op: str, name: str, path: Path, nbytes: int, chunks: int) -> None:
        self.op = op
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.pending = chunks
        self.start_s: float | None = None
        self.error: BaseException | None = None
        self.keepalive: tuple[torch.Tensor, ...] = ()  # memory the chunks' memoryviews point into
        self.lock = threading.Lock()
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()  # bytes already in flight cannot be cancelled
        self.span: Any = None  # the trace event, decided when the request is submitted


class DiskTier:
    """Files under `root` holding tensor bytes, moved by a pool of `threads` I/O threads.

    `write`/`read` return a future that completes when every chunk of the request is done; only
    then may the caller reuse or free the tensor. An I/O error surfaces from `future.result()` as
    DiskFullError (ENOSPC) or DiskIOError. With O_DIRECT (`self.direct`), tensors must start at an
    ALIGN_BYTES-aligned address (use `aligned_empty`, or a slice of one at an aligned offset); files
    are then padded to a multiple of ALIGN_BYTES. Reads never write past `dst.nbytes`.

    Requests on different files may run concurrently; ordering requests on the same file (a read
    after the write it depends on) is the caller's job. Files are scratch: writes are not fsynced
    unless `sync(name)` is called.

    Counters: `bytes_written`/`bytes_read` sum the tensor bytes of completed requests;
    `write_busy_s`/`read_busy_s` sum, per request, the wall time from its first chunk starting to
    its last chunk finishing (overlapping requests are each counted in full).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        threads: int = 4,
        chunk_bytes: int = 8 << 20,
        direct: bool | None = None,
        tracer: Tracer | NoTracer = NO_TRACER,
    ) -> None:
        self.tracer = tracer  # each request is one event, timed in the I/O threads
        if threads < 1:
            raise ValueError(f"DiskTier: threads must be >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"DiskTier: chunk_bytes must be >= 1, got {chunk_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # Chunk boundaries must be valid O_DIRECT offsets.
        self.chunk_bytes = round_up(chunk_bytes, ALIGN_BYTES)
        supported = supports_direct_io(self.root) if direct is not False else False
        if direct and not supported:
            raise DiskIOError(
                errno.EINVAL,
                f"O_DIRECT is not supported on {self.root}; pass direct=None to fall back "
                "to buffered I/O",
                str(self.root),
            )
        self.direct = supported
        self._flags = os.O_RDWR | os.O_CLOEXEC | (_O_DIRECT if self.direct else 0)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierlm-disk")
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._inflight: dict[str, int] = {}
        self._closed = False
        self._bytes_written = 0
        self._bytes_read = 0
        self._write_busy_s = 0.0
        self._read_busy_s = 0.0

    # counters ------------------------------------------------------------------------------

    @property
    def bytes_written(self) -> int:
        return self._bytes_written

    @property
    def bytes_read(self) -> int:
        return self._bytes_read

    @property
    def write_busy_s(self) -> float:
        return self._write_busy_s

    @property
    def read_busy_s(self) -> float:
        return self._read_busy_s

    # public operations ---------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """The file that holds `name`."""
        if not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"DiskTier: name must be a relative path inside root, got {name!r}")
        return self.root / name

    def write(self, name: str, src: torch.Tensor, offset_bytes: int | None = None) -> Future[None]:
        """Write the bytes of contiguous CPU tensor `src` to file `name`: the whole file (created
        or replaced) when `offset_bytes` is None, else into the file at that offset (a multiple
        of ALIGN_BYTES; the file is created or grows if the bytes end past it, never shrinks)."""
        self._check_tensor(src, "write")
        self._check_offset(offset_bytes, "write")
        path = self.path(name)
        nbytes = src.nbytes
        start = offset_bytes or 0
        file_bytes = round_up(start + nbytes, ALIGN_BYTES) if self.direct else start + nbytes
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._begin(name, create=True)
        except OSError as exc:
            return self._failed(exc, "write", path, file_bytes)
        try:
            size = os.fstat(fd).st_size
            if size < file_bytes:
                _preallocate(fd, file_bytes)
            elif size > file_bytes and offset_bytes is None:
                os.ftruncate(fd, file_bytes)
        except OSError as exc:
            self._end(name)
            return self._failed(exc, "write", path, file_bytes)
        pieces, tail_bytes, bounce = self._pieces(src.data_ptr(), nbytes, start)
        if bounce is not None:
            # The partial last block goes through a zero-padded aligned buffer, so O_DIRECT never
            # reads past the end of `src`.
            _memory(bounce.data_ptr(), tail_bytes)[:] = _memory(
                src.data_ptr() + nbytes - tail_bytes, tail_bytes
            )
        req = _Request("write", name, path, nbytes, len(pieces))
        req.keepalive = (src,) if bounce is None else (src, bounce)
        return self._submit(req, [partial(_pwrite_all, fd, bufs, off) for bufs, off, _ in pieces])

    def read(self, name: str, dst: torch.Tensor, offset_bytes: int = 0) -> Future[None]:
        """Fill contiguous CPU tensor `dst` with `dst.nbytes` bytes of file `name` from
        `offset_bytes` on (ALIGN_BYTES-aligned)."""
        self._check_tensor(dst, "read")
        self._check_offset(offset_bytes, "read")
        path = self.path(name)
        nbytes = dst.nbytes
        try:
            fd = self._begin(name, create=False)
        except FileNotFoundError as exc:
            return self._failed(exc, "read", path, nbytes, f"read {path}: no such file")
        except OSError as exc:
            return self._failed(exc, "read", path, nbytes)
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            self._end(name)
            return self._failed(exc, "read", path, nbytes)
        if size < offset_bytes + nbytes:
            self._end(name)
            err = DiskIOError(
                errno.EIO,
                f"read {path}: file is {size} bytes, shorter than the {nbytes} bytes requested "
                f"at offset {offset_bytes}",
                str(path),
            )
            return self._failed(err, "read", path, nbytes)
        pieces, tail_bytes, bounce = self._pieces(dst.data_ptr(), nbytes, offset_bytes)
        req = _Request("read", name, path, nbytes, len(pieces))
        req.keepalive = (dst,) if bounce is None else (dst, bounce)

        def read_piece(bufs: list[memoryview], offset: int, need_bytes: int, last: bool) -> None:
            _pread_at_least(fd, bufs, offset, need_bytes)
            if last and bounce is not None:
                _memory(dst.data_ptr() + nbytes - tail_bytes, tail_bytes)[:] = _memory(
                    bounce.data_ptr(), tail_bytes
                )

        last = len(pieces) - 1
        work = [partial(read_piece, *piece, i == last) for i, piece in enumerate(pieces)]
        return self._submit(req, work)

    def write_sync(self, name: str, src: torch.Tensor) -> None:
        self.write(name, src).result()

    def read_sync(self, name: str, dst: torch.Tensor) -> None:
        self.read(name, dst).result()

    def sync(self, name: str) -> None:
        """fsync file `name`: its completed writes survive a crash of the machine."""
        path = self.path(name)
        try:
            os.fsync(self._fd(name, create=False))
        except OSError as exc:
            raise self._wrap(exc, "sync", path, _size_or_zero(path)) from exc

    def remove(self, name: str) -> None:
        """Delete file `name` (no error if it does not exist)."""
        path = self.path(name)
        with self._lock:
            if self._inflight.get(name):
                raise RuntimeError(f"DiskTier.remove({name!r}) while requests on it are in flight")
            fd = self._fds.pop(name, None)
        try:
            if fd is not None:
                os.close(fd)
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise self._wrap(exc, "remove", path, 0) from exc

    def close(self) -> None:
        """Wait for requests in flight, stop the threads and close the files. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # internals -----------------------------------------------------------------------------

    def _check_tensor(self, t: torch.Tensor, op: str) -> None:
        if t.device.type != "cpu":
            raise ValueError(f"DiskTier.{op} needs a CPU tensor, got one on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"DiskTier.{op} needs a contiguous tensor")
        if self.direct and t.data_ptr() % ALIGN_BYTES:
            raise ValueError(
                f"DiskTier.{op} with O_DIRECT needs a buffer aligned to {ALIGN_BYTES} bytes "
                f"(address {t.data_ptr():#x} is not): allocate it with aligned_empty()"
            )

    def _fd(self, name: str, *, create: bool, begin: bool = False) -> int:
        """The cached descriptor of `name`; with begin=True also count a request in flight on it
        (`remove` refuses while any are: closing the fd under a request could redirect its I/O to
        whatever file reuses the number). Every begin is paired with one `_end`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("DiskTier is closed")
            fd = self._fds.get(name)
            if fd is None:
                flags = self._flags | (os.O_CREAT if create else 0)
                fd = self._fds[name] = os.open(self.path(name), flags, 0o644)
            if begin:
                self._inflight[name] = self._inflight.get(name, 0) + 1
            return fd

    def _begin(self, name: str, *, create: bool) -> int:
        return self._fd(name, create=create, begin=True)

    def _end(self, name: str) -> None:
        with self._lock:
            self._inflight[name] -= 1
            if not self._inflight[name]:
                del self._inflight[name]

    def _check_offset(self, offset_bytes: int | None, op: str) -> None:
        if offset_bytes is not None and (offset_bytes < 0 or offset_bytes % ALIGN_BYTES):
            raise ValueError(f"DiskTier.{op}: offset_bytes must be a non-negative multiple of "
                             f"{ALIGN_BYTES}, got {offset_bytes}")

    def _pieces(
        self, address: int, nbytes: int, start: int = 0
    ) -> tuple[list[tuple[list[memoryview], int, int]], int, torch.Tensor | None]:
        """Split [0, nbytes) into chunks: (buffers, file offset, bytes needed) each, the file
        offsets counted from `start`.

        With O_DIRECT, a partial last block is routed through an aligned bounce buffer (returned
        with its length), appended to the last chunk's buffers.
        """
        direct_bytes = nbytes - nbytes % ALIGN_BYTES if self.direct else nbytes
        pieces = []
        for lo in range(0, direct_bytes, self.chunk_bytes):
            length = min(self.chunk_bytes, direct_bytes - lo)
            pieces.append(([_memory(address + lo, length)], start + lo, length))
        tail_bytes = nbytes - direct_bytes
        bounce = None
        if tail_bytes:
            bounce = aligned_empty(ALIGN_BYTES, torch.uint8, pin=False).zero_()
            tail = _memory(bounce.data_ptr(), ALIGN_BYTES)
            if pieces:
                bufs, lo, need = pieces[-1]
                pieces[-1] = ([*bufs, tail], lo, need + tail_bytes)
            else:
                pieces.append(([tail], start, tail_bytes))
        return pieces, tail_bytes, bounce

    def _submit(self, req: _Request, work: list[Callable[[], None]]) -> Future[None]:
        req.span = self.tracer.open(f"disk {req.op}", req.name, cat="disk", bytes=req.nbytes)
        with self._lock:
            for fn in work:
                self._pool.submit(self._run_piece, req, fn)
        if not work:  # zero bytes
            req.pending = 1
            self._finish_piece(req)
        return req.future

    def _run_piece(self, req: _Request, fn: Callable[[], None]) -> None:
        try:
            with req.lock:
                if req.start_s is None:
                    req.start_s = time.perf_counter()
                failed = req.error is not None
            if not failed:  # after one chunk fails, the rest of the request is skipped
                fn()
        except BaseException as exc:  # every error, whatever its type, must reach the future
            err = self._wrap(exc, req.op, req.path, req.nbytes)
            if err is not exc:
                err.__cause__ = exc
            with req.lock:
                if req.error is None:
                    req.error = err
        finally:
            self._finish_piece(req)

    def _finish_piece(self, req: _Request) -> None:
        with req.lock:
            req.pending -= 1
            if req.pending:
                return
        end_s = time.perf_counter()
        elapsed_s = end_s - req.start_s if req.start_s is not None else 0.0
        if req.error is None and req.start_s is not None:
            req.span.close(req.start_s, end_s)
        req.keepalive = ()
        self._end(req.name)
        with self._lock:
            if req.error is None:
                if req.op == "write":
                    self._bytes_written += req.nbytes
                    self._write_busy_s += elapsed_s
                else:
                    self._bytes_read += req.nbytes
                    self._read_busy_s += elapsed_s
        # the request's own time, from its first chunk starting (not its wait in the queue,
        # which a read issued early, by a prefetch, spends behind the others)
        req.future.busy_s = elapsed_s  # type: ignore[attr-defined]
        if req.error is None:
            req.future.set_result(None)
        else:
            req.future.set_exception(req.error)

    def _failed(
        self, exc: BaseException, op: str, path: Path, nbytes: int, message: str | None = None
    ) -> Future[None]:
        err = self._wrap(exc, op, path, nbytes, message)
        if err is not exc:
            err.__cause__ = exc
        fut: Future[None] = Future()
        fut.set_exception(err)
        return fut

    def _wrap(
        self, exc: BaseException, op: str, path: Path, nbytes: int, message: str | None = None
    ) -> BaseException:
        """Map an OSError to DiskFullError / DiskIOError; anything else passes through."""
        if isinstance(exc, DiskFullError | DiskIOError) or not isinstance(exc, OSError):
            return exc
        if exc.errno == errno.ENOSPC:
            try:
                free = f"{shutil.disk_usage(self.root).free} bytes are"
            except OSError:
                free = "an unknown number of bytes is"
            return DiskFullError(
                errno.ENOSPC,
                f"disk full: {op} of {path} needs {nbytes} bytes but {free} free on that "
                "filesystem; free space there or point --offload-dir at a disk with room",
                str(path),
            )
        reason = exc.strerror or str(exc)
        return DiskIOError(exc.errno, message or f"{op} {path} failed: {reason}", str(path))
