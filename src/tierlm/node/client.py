"""The trainer's side of a memory node session (tierlm.node.server): connect and authenticate,
measure the link, then hand the node segments' state and gradients and take back their
compute copies.

Requests are answered in order, and a client takes one call at a time (calls from several
threads take turns). `step(..., wait=False)` returns once the request is sent, so
the node updates while the trainer computes; its answer is read (and an error raised) before
the next request goes out, which is also what keeps gloo's rendezvous sends from waiting on
each other (tierlm.node.transport). Every wait on the node is bounded by `timeout_s`: a node
that dies or stalls raises `NodeError` naming its address, and the session is then spent.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from tierlm.config import OptimConfig
from tierlm.node.auth import HandshakeRefused, trainer_handshake
from tierlm.node.protocol import NodeError, SegmentSpec, parse_address
from tierlm.node.transport import (
    INFLIGHT,
    GlooTransport,
    LinkError,
    SocketTransport,
    Transport,
    gloo_group,
)

PROBE_BYTES = 16 * 2**20


def _one_at_a_time(method: Callable) -> Callable:
    """A request and its answer are one exchange on the link: calls from several threads (the
    engine's update worker beside its training thread) take turns."""

    @functools.wraps(method)
    def locked(self, *args, **kw):
        with self._lock:
            return method(self, *args, **kw)

    return locked


@dataclass(frozen=True, kw_only=True)
class NodeHello:
    """What the node said at the handshake, and the link rate measured right after it."""

    address: str
    memory_bytes: int
    transport: str
    link_up_bytes_per_s: float | None  # trainer to node (gradients); None: not probed
    link_down_bytes_per_s: float | None  # node to trainer (compute copies)


class NodeClient:
    """One session with a memory node at `address` ('HOST:PORT', the node's --listen)."""

    def __init__(self, address: str, token: bytes, *, transport: str = "gloo",
                 timeout_s: float = 60.0, probe_bytes: int = PROBE_BYTES,
                 inflight: int = INFLIGHT) -> None:
        if transport not in ("gloo", "socket"):
            raise ValueError(f"transport {transport!r}: gloo or socket")
        self.address, self.timeout_s = address, timeout_s
        host, port = parse_address(address, "--memory-node")
        self._pending: deque[str] = deque()
        self._lock = threading.RLock()
        self._broken: str | None = None
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as e:
            raise NodeError(f"memory node {address}: cannot connect: {e}") from e
        try:
            hello, key = trainer_handshake(sock, token, timeout_s, {"transport": transport},
                                           address)
        except HandshakeRefused as e:
            sock.close()
            raise NodeError(str(e)) from None
        # the node's chunk size both ways: it sizes its receive staging by it
        kw = {"chunk_bytes": int(hello["chunk_bytes"]), "inflight": inflight}
        self.t: Transport
        if transport == "socket":
            self.t = SocketTransport(sock, address, **kw)
            self._sock = None
        else:
            self._sock = sock  # held for the session; gloo opens its own connections
            try:
                pg, _ = gloo_group(rank=0, store_host=host, store_port=int(hello["store_port"]),
                                   prefix=key, local_host=sock.getsockname()[0],
                                   timeout_s=timeout_s)
            except RuntimeError as e:
                sock.close()
                raise NodeError(f"memory node {address}: the gloo group did not form: "
                                f"{str(e).splitlines()[0]}") from e
            self.t = GlooTransport(pg, 0, address, **kw)
        up = down = None
        if probe_bytes > 0:
            up, down = self._probe(probe_bytes)
        self.hello = NodeHello(address=address, memory_bytes=int(hello["memory_bytes"]),
                               transport=transport, link_up_bytes_per_s=up,
                               link_down_bytes_per_s=down)

    # -- plumbing ----

    @property
    def bytes_sent(self) -> int:
        """Bytes this session sent to the node (headers and payloads)."""
        return self.t.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.t.bytes_received

    def _fail(self, what: str, e: Exception) -> NodeError:
        self._broken = f"{what}: {e}"
        return NodeError(f"memory node {self.address}: {what} failed: {e} (the session is "
                         "lost; the node frees its state)")

    def _answer(self, op: str) -> dict:
        try:
            header = self.t.recv_header(self.timeout_s)
        except (LinkError, ValueError) as e:
            raise self._fail(op, e) from e
        if header.get("op") != op:
            raise self._fail(op, ValueError(f"answered {header.get('op')!r}"))
        if "error" in header:
            raise NodeError(f"memory node {self.address}: {op}: {header['error']}")
        return header

    @_one_at_a_time
    def wait(self) -> None:
        """Read the answers of the requests sent without waiting (`step(wait=False)`)."""
        while self._pending:
            self._answer(self._pending.popleft())

    def _send(self, header: dict, tensors: Sequence[torch.Tensor] = ()) -> None:
        if self._broken is not None:
            raise NodeError(f"memory node {self.address}: the session is lost "
                            f"({self._broken})")
        self.wait()
        try:
            self.t.send_msg(header, tensors, self.timeout_s)
        except (LinkError, ValueError) as e:
            raise self._fail(header["op"], e) from e

    def _call(self, header: dict, tensors: Sequence[torch.Tensor] = ()) -> dict:
        self._send(header, tensors)
        return self._answer(header["op"])

    def _take(self, header: dict, dsts: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The answer's payload, into `dsts` or fresh tensors."""
        if dsts is None:
            dsts = [torch.empty(n, dtype=d) for d, n in self.t.payload(header)]
        try:
            self.t.recv_into(header, dsts, self.timeout_s)
        except (LinkError, ValueError) as e:
            raise self._fail(header["op"], e) from e
        return list(dsts)

    def _probe(self, nbytes: int) -> tuple[float, float]:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        self._call({"op": "probe_up"}, [buf])
        up = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        self._take(self._call({"op": "probe_down", "nbytes": nbytes}), [buf])
        down = nbytes / (time.perf_counter() - t0)
        return up, down

    @_one_at_a_time
    def measure_link(self, nbytes: int) -> tuple[float, float]:
        """Payload bytes per second to the node and back, moving `nbytes` once each way
        (`tierlm probe --memory-node`)."""
        return self._probe(nbytes)

    # -- the session ----

    @_one_at_a_time
    def configure(self, segments: Sequence[SegmentSpec], optim: OptimConfig) -> int:
        """Place `segments` on the node, with zeroed state and gradients, updated by the flat
        optimizer `optim` builds (tierlm.optim.build). Returns the bytes the node holds for
        them; raises NodeError when they do not fit its --memory."""
        answer = self._call({"op": "configure", "segments": [s.to_json() for s in segments],
                             "optim": asdict(optim)})
        return int(answer["held_bytes"])

    @_one_at_a_time
    def put_state(self, segment: str, tensors: Mapping[str, torch.Tensor],
                  steps: Sequence[float] | None = None) -> None:
        """Set copies of a segment's state: "master", the optimizer's slot names, "grad"; each
        a flat tensor of the copy's dtype and numel (runtime.state's flat buffers). `steps`: the
        per-group optimizer step counts (as `step_count` reads them)."""
        names = list(tensors)
        self._call({"op": "put_state", "segment": segment, "copies": names,
                    "steps": None if steps is None else [float(s) for s in steps]},
                   [tensors[c].reshape(-1) for c in names])

    @_one_at_a_time
    def get_state(self, segment: str, copies: Sequence[str] | None = None,
                  out: Mapping[str, torch.Tensor] | None = None, *,
                  lo: int | None = None, count: int | None = None,
                  ) -> tuple[dict[str, torch.Tensor], list[float]]:
        """A segment's state (default: master and every optimizer slot) and its per-group step
        counts; into `out`'s buffers where given, fresh tensors otherwise. `lo`, `count`: only
        elements [lo, lo + count) of each flat copy (a checkpoint takes a parameter at a time)."""
        header = {"op": "get_state", "segment": segment,
                  "copies": None if copies is None else list(copies)}
        if lo is not None:
            header.update(lo=int(lo), count=int(count))
        answer = self._call(header)
        names = answer["copies"]
        got = self._take(answer, None if out is None else [out[c] for c in names])
        return dict(zip(names, got, strict=True)), [float(s) for s in answer["steps"]]

    @_one_at_a_time
    def push_grad(self, segment: str, grad: torch.Tensor) -> None:
        """Add a flat fp32 gradient (the segment's numel) into the node's accumulated one."""
        self._call({"op": "push_grad", "segment": segment}, [grad.reshape(-1)])

    @_one_at_a_time
    def zero_grad(self, segment: str) -> None:
        """Drop the accumulated gradient (a step skipped for a non-finite norm)."""
        self._call({"op": "zero_grad", "segment": segment})

    @_one_at_a_time
    def step(self, segment: str, *, lr: float, coef: float, step: int | None = None,
             wait: bool = True) -> None:
        """Apply the optimizer update to the accumulated gradient scaled by `coef` (the
        clipping coefficient, an fp32 value) at learning rate `lr`, then zero the gradient.
        `step`: the count the segment's optimizer reaches with this update (1 for the first),
        checked against the node's. `wait=False`: return once sent (the answer is read by the
        next request or `wait()`)."""
        self._send({"op": "step", "segment": segment, "lr": float(lr), "coef": float(coef),
                    "step": step})
        if wait:
            self._answer("step")
        else:
            self._pending.append("step")

    @_one_at_a_time
    def get_compute_copy(self, segment: str, kinds: Sequence[str] | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """The weights the segment computes from, as of the last update: its fp32 master where
        every parameter computes in fp32, else the compute copy's bytes (uint8,
        tierlm.precision.streaming's `ComputeFormat` of the per-parameter `kinds`: fp32, bf16,
        e4m3). `kinds` default the segment's configured ones; others re-encode it."""
        answer = self._call({"op": "get_compute_copy", "segment": segment,
                             "kinds": None if kinds is None else list(kinds)})
        return self._take(answer, None if out is None else [out.reshape(-1)])[0]

    @_one_at_a_time
    def close(self) -> None:
        """End the session: the node frees the state and accepts the next trainer."""
        if self._broken is None:
            try:
                self._call({"op": "close"})
                self._wait_closed()
            except NodeError:
                pass
        self._broken = self._broken or "closed"
        self.t.close()
        if self._sock is not None:
            self._sock.close()

    def _wait_closed(self) -> None:
        """Wait for the node to close the handshake's connection: it does so once it takes the
        next trainer, so a trainer that connects after `close()` returns is not refused as
        busy."""
        sock = self._sock if self._sock is not None else self.t.sock
        sock.settimeout(self.timeout_s)
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
