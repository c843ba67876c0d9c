"""Moving a memory node's messages: a header (a JSON object) and the tensors it lists, between
the trainer and the node, over gloo point-to-point (`GlooTransport`) or one plain TCP socket
(`SocketTransport`, the baseline, and the transport that passes an SSH tunnel).

Both carry the same framing. A message is a head of `HEAD_BYTES` (the header's length, 8 bytes
little-endian, and the header, zero-padded; a longer header's rest follows), then each tensor's
bytes in order; the header's "tensors" entry lists (dtype, numel) per
tensor, so a receiver can take the payload into buffers it already holds (`recv_into`), add it
into one (`recv_add`: a gradient, through a few chunk-sized staging buffers, never a second
copy of the segment) or drop it (`discard`: a request it refuses). Payloads move in chunks of
`chunk_bytes`, `inflight` of them posted at once.

Gloo's point-to-point is a rendezvous: a send completes only once the peer has posted the
matching receive (a timed-out wait closes the pair). The protocol over it is therefore strictly
ordered (tierlm.node.server): each side sends a message whole and only then waits for the next,
and a request's reply is read before a request that expects a payload back is sent.

Every wait takes `timeout_s` (None: no limit, for a node waiting for its trainer's next
request); a timeout or a lost connection raises `LinkError`.
"""

from __future__ import annotations

import datetime
import json
import socket
import struct
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

import torch

CHUNK_BYTES = 32 * 2**20
HEAD_BYTES = 1024  # a message's first piece: its header's length and (most) headers whole
INFLIGHT = 4
# a node idle between a trainer's requests waits this long (the trainer may be computing a
# step, or writing a checkpoint); a trainer that dies closes the connection and ends the wait
_NO_LIMIT = datetime.timedelta(days=7)

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int32,
    torch.int64, torch.float8_e4m3fn, torch.float8_e5m2)}


class LinkError(ConnectionError):
    """The connection to the peer failed, or a wait on it ran past its timeout."""


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (gloo refuses fp8; every dtype moves
    as bytes)."""
    if not t.is_contiguous():
        raise ValueError("a payload tensor must be contiguous (a copy would double its memory)")
    return t.reshape(-1).view(torch.uint8)


def _timedelta(timeout_s: float | None) -> datetime.timedelta:
    return _NO_LIMIT if timeout_s is None else datetime.timedelta(seconds=timeout_s)


class Transport(ABC):
    """One session's connection to the peer. `bytes_sent` / `bytes_received` count every byte
    of headers and payloads this side moved."""

    name = ""

    def __init__(self, *, chunk_bytes: int = CHUNK_BYTES, inflight: int = INFLIGHT) -> None:
        if chunk_bytes % 16:  # a chunk ends on a whole element of every dtype
            raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of 16")
        self.chunk_bytes, self.inflight = chunk_bytes, inflight
        self.bytes_sent = self.bytes_received = 0

    # -- the primitives: post a send or a receive of one uint8 buffer, wait for it ----

    @abstractmethod
    def _post_send(self, buf: torch.Tensor, timeout_s: float | None) -> object: ...

    @abstractmethod
    def _post_recv(self, buf: torch.Tensor, timeout_s: float | None) -> object: ...

    @abstractmethod
    def _wait(self, handle: object, timeout_s: float | None) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    # -- framing ----

    @staticmethod
    def _chunks(buf: torch.Tensor, chunk: int) -> list[torch.Tensor]:
        return [buf[lo : lo + chunk] for lo in range(0, buf.numel(), chunk)]

    def _pipeline(self, post: Callable[[int], object], n: int, timeout_s: float | None,
                  done: Callable[[int], None] | None = None) -> None:
        """Post operations 0..n-1 with at most `inflight` outstanding, waiting for the oldest
        (and running `done` on it) before posting more."""
        window: deque[tuple[int, object]] = deque()
        for k in range(n):
            if len(window) == self.inflight:
                j, h = window.popleft()
                self._wait(h, timeout_s)
                if done is not None:
                    done(j)
            window.append((k, post(k)))
        while window:
            j, h = window.popleft()
            self._wait(h, timeout_s)
            if done is not None:
                done(j)

    def send_msg(self, header: dict, tensors: Sequence[torch.Tensor] = (),
                 timeout_s: float | None = None) -> None:
        """Send `header` and `tensors` (listed in the header as they go)."""
        header = {**header, "chunk": self.chunk_bytes,
                  "tensors": [[str(t.dtype).removeprefix("torch."), t.numel()] for t in tensors]}
        raw = json.dumps(header).encode()
        # A fixed-size head (the header's length and its first bytes), then the rest of a long
        # header: gloo matches a receive to one send of the same size, and each message is a
        # rendezvous of its own, so a short request or answer is one message.
        first = struct.pack("<q", len(raw)) + raw[: HEAD_BYTES - 8]
        pieces = [torch.frombuffer(bytearray(first.ljust(HEAD_BYTES, b"\0")), dtype=torch.uint8)]
        if len(raw) > HEAD_BYTES - 8:
            pieces.append(torch.frombuffer(bytearray(raw[HEAD_BYTES - 8 :]), dtype=torch.uint8))
        pieces += [c for t in tensors for c in self._chunks(as_bytes(t), self.chunk_bytes)]
        self._pipeline(lambda k: self._post_send(pieces[k], timeout_s), len(pieces), timeout_s)
        self.bytes_sent += sum(p.numel() for p in pieces)

    def recv_header(self, timeout_s: float | None) -> dict:
        """The next message's header; its payload must then be taken (`recv_into`, `recv_add`
        or `discard`) before anything else is received."""
        head = torch.empty(HEAD_BYTES, dtype=torch.uint8)
        self._wait(self._post_recv(head, timeout_s), timeout_s)
        raw = bytes(head.numpy())
        (n,) = struct.unpack("<q", raw[:8])
        if not 0 < n < 2**30:
            raise LinkError(f"a message header of {n} bytes: the peer does not speak this "
                            "protocol")
        raw = raw[8 : 8 + n]
        self.bytes_received += HEAD_BYTES
        if n > HEAD_BYTES - 8:
            rest = torch.empty(n - (HEAD_BYTES - 8), dtype=torch.uint8)
            self._wait(self._post_recv(rest, timeout_s), timeout_s)
            raw += bytes(rest.numpy())
            self.bytes_received += rest.numel()
        return json.loads(raw)

    def _chunk_of(self, header: dict) -> int:
        """The sender's chunk size; staging is sized by it, so it may not exceed ours."""
        chunk = int(header["chunk"])
        if not 0 < chunk <= self.chunk_bytes or chunk % 16:
            raise ValueError(f"a payload in chunks of {chunk} bytes (this side takes up to "
                             f"{self.chunk_bytes})")
        return chunk

    @staticmethod
    def payload(header: dict) -> list[tuple[torch.dtype, int]]:
        """(dtype, numel) of each tensor the message carries."""
        return [(DTYPES[d], n) for d, n in header["tensors"]]

    @staticmethod
    def payload_nbytes(header: dict) -> int:
        return sum(d.itemsize * n for d, n in Transport.payload(header))

    def recv_into(self, header: dict, dsts: Sequence[torch.Tensor],
                  timeout_s: float | None) -> None:
        """Receive the payload straight into `dsts` (one per tensor, same dtype and numel)."""
        want = self.payload(header)
        if len(want) != len(dsts) or any(
                (d, n) != (t.dtype, t.numel()) for (d, n), t in zip(want, dsts, strict=False)):
            raise ValueError(f"payload {header['tensors']} does not match the receiving buffers "
                             f"{[(str(t.dtype), t.numel()) for t in dsts]}")
        chunk = int(header["chunk"])
        pieces = [c for t in dsts for c in self._chunks(as_bytes(t), chunk)]
        self._pipeline(lambda k: self._post_recv(pieces[k], timeout_s), len(pieces), timeout_s)
        self.bytes_received += sum(p.numel() for p in pieces)

    def recv_add(self, header: dict, dst: torch.Tensor, timeout_s: float | None) -> None:
        """Receive one tensor of `dst`'s dtype and numel and add it into `dst` chunk by chunk
        (elementwise, so the sum is the one a whole-tensor add gives)."""
        if self.payload(header) != [(dst.dtype, dst.numel())]:
            raise ValueError(f"payload {header['tensors']} is not one tensor like "
                             f"({dst.dtype}, {dst.numel()})")
        flat = dst.reshape(-1)
        per = self._chunk_of(header) // dst.element_size()
        n = -(-flat.numel() // per)
        ring = [torch.empty(min(per, flat.numel()), dtype=dst.dtype)
                for _ in range(min(self.inflight, n))]

        def post(k: int) -> object:
            m = min(per, flat.numel() - k * per)
            return self._post_recv(as_bytes(ring[k % len(ring)][:m]), timeout_s)

        def done(k: int) -> None:
            m = min(per, flat.numel() - k * per)
            flat[k * per : k * per + m].add_(ring[k % len(ring)][:m])

        self._pipeline(post, n, timeout_s, done)
        self.bytes_received += dst.numel() * dst.element_size()

    def discard(self, header: dict, timeout_s: float | None) -> None:
        """Receive and drop the payload (a refused request's), keeping the stream in step."""
        sizes = [d.itemsize * n for d, n in self.payload(header)]
        chunk = self._chunk_of(header)
        ring = [torch.empty(chunk, dtype=torch.uint8) for _ in range(self.inflight)]
        # each tensor is chunked on its own, as the sender cut it
        cuts = [min(chunk, size - lo) for size in sizes for lo in range(0, size, chunk)]
        self._pipeline(lambda k: self._post_recv(ring[k % len(ring)][: cuts[k]], timeout_s),
                       len(cuts), timeout_s)
        self.bytes_received += sum(sizes)


class SocketTransport(Transport):
    """One TCP socket (the connection the handshake authenticated): the baseline, and the one
    transport an SSH tunnel forwards (gloo opens connections of its own)."""

    name = "socket"

    def __init__(self, sock: socket.socket, peer: str, **kw) -> None:
        super().__init__(**kw)
        self.sock, self.peer = sock, peer
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a peer machine that vanishes without closing (power loss, a cut cable) is noticed in
        # about two minutes, not the system's default two hours
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

    def _post_send(self, buf: torch.Tensor, timeout_s: float | None) -> object:
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(memoryview(buf.numpy()))
        except OSError as e:  # socket.timeout is an OSError
            raise LinkError(f"send to {self.peer} failed: {e or 'timed out'}") from e
        return None

    def _post_recv(self, buf: torch.Tensor, timeout_s: float | None) -> object:
        view = memoryview(buf.numpy())
        try:
            self.sock.settimeout(timeout_s)
            got = 0
            while got < len(view):
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise LinkError(f"{self.peer} closed the connection")
                got += n
        except OSError as e:
            if isinstance(e, LinkError):
                raise
            why = f"timed out after {timeout_s} s" if isinstance(e, TimeoutError) else e
            raise LinkError(f"receive from {self.peer} failed: {why}") from e
        return None

    def _wait(self, handle: object, timeout_s: float | None) -> None:
        return None  # a socket's send and receive are done when posted

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class GlooTransport(Transport):
    """Point-to-point over a process group of its own (rank 0 the trainer, rank 1 the node):
    never the default group, so a trainer that runs data parallel keeps its own, and a node can
    drop one session's group and build the next in the same process (measured: a group whose
    peer was killed raises on its pending receive at once, and a new group forms after it)."""

    name = "gloo"

    def __init__(self, pg, rank: int, peer: str, store=None, **kw) -> None:
        super().__init__(**kw)
        self.pg, self.rank, self.peer = pg, rank, peer
        self.store = store  # the node's store server: kept for the session
        self.other = 1 - rank

    def _post_send(self, buf: torch.Tensor, timeout_s: float | None) -> object:
        try:
            return self.pg.send([buf], self.other, 0), buf
        except RuntimeError as e:
            raise LinkError(f"send to {self.peer} failed: {_first_line(e)}") from e

    def _post_recv(self, buf: torch.Tensor, timeout_s: float | None) -> object:
        try:
            return self.pg.recv([buf], self.other, 0), buf
        except RuntimeError as e:
            raise LinkError(f"receive from {self.peer} failed: {_first_line(e)}") from e

    def _wait(self, handle: object, timeout_s: float | None) -> None:
        work, _ = handle  # the buffer rides along so it outlives the operation
        try:
            work.wait(_timedelta(timeout_s))
        except RuntimeError as e:
            raise LinkError(f"{self.peer}: {_first_line(e)}") from e

    def close(self) -> None:
        self.pg = None  # the group's connections close with its last reference
        self.store = None


def _first_line(e: BaseException) -> str:
    """gloo's message without its source path prefix and traceback tail."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]


def gloo_group(*, rank: int, store_host: str, store_port: int, prefix: str, local_host: str,
               timeout_s: float, listen_fd: int | None = None):
    """Form the two-rank gloo group of one session. The node (rank 1) serves the rendezvous
    store on `listen_fd`, a socket it bound to its --listen address and port + 1 itself, so the
    store listens on no other interface (a TCPStore left to bind its own port takes every
    interface); the trainer connects to it. `prefix` (from the handshake, known only to the
    two ends) keys the session's entries. Gloo's own connections bind to `local_host`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 1:
        store = dist.TCPStore(store_host, store_port, 2, True, timeout, wait_for_workers=False,
                              master_listen_fd=listen_fd)
    else:
        store = dist.TCPStore(store_host, store_port, 2, False, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, opts)
    return pg, store
