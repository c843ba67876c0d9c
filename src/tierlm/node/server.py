"""The memory node: another machine's RAM holding segments' fp32 masters, optimizer slots and
accumulated gradients, and its cores applying their updates, for one trainer at a time.

The main thread accepts connections on the --listen address only; each connection's handshake
(tierlm.node.auth) runs in a thread of its own with a deadline, so a client that stalls, sends
garbage or holds the wrong token is refused (and logged) while the live session goes on. An
accepted trainer's session runs in a thread: its transport (gloo, whose group is private to the
session, or the handshake's socket), then its requests in order (tierlm.node.protocol) until it
closes or its connection fails. Then the session's state is dropped and its memory returned to
the system (`malloc_trim`: glibc keeps freed heap otherwise), and the next trainer is accepted.

Sessions run in the node's own process, not a child per session: measured, a gloo group whose
trainer was killed raises on its pending receive at once, and a new group forms in the same
process after it (the tests run several sessions through one node, killed trainers included).
What a child would add is isolation from gloo itself: gloo aborts the process when a message's
size differs from the receive posted for it, which only a trainer that passed the handshake and
then broke the protocol can cause (the greeting carries the protocol version).

The update is the host tier's, step for step (tierlm.runtime.engine's `_update` of a host
segment): the gradient scaled by the clipping coefficient as an fp32 scalar, the run's flat
optimizer (tierlm.optim.build) over the whole segment, the compute copy re-encoded from the new
master (tierlm.precision.streaming), the gradient zeroed, the group counters advanced. Same
kernels on the same bytes: the node's weights equal the host tier's bit for bit.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import socket
import threading
import time
from dataclasses import dataclass, fields

import torch

from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.node.auth import Accepted, HandshakeRefused, node_handshake
from tierlm.node.protocol import SegmentSpec
from tierlm.node.transport import (
    CHUNK_BYTES,
    INFLIGHT,
    GlooTransport,
    LinkError,
    SocketTransport,
    Transport,
    gloo_group,
)
from tierlm.optim.build import build_flat_optimizer
from tierlm.optim.flat import FlatOptimizer, advance, new_step_counter, step_count
from tierlm.precision.streaming import ComputeFormat

log = logging.getLogger("tierlm.node")

PROBE_MAX_BYTES = 64 * 2**20
VERSION = 1


@dataclass(kw_only=True)
class NodeOptions:
    host: str
    """The address to listen on (--listen); the rendezvous store takes `port + 1` on it."""
    port: int
    memory_bytes: int
    """The RAM the sessions' state may take (--memory)."""
    token: bytes
    handshake_timeout_s: float = 10.0
    """How long a connecting client has to complete the handshake."""
    idle_timeout_s: float | None = None
    """End a session whose trainer sends nothing for this long (None: wait while the connection
    stays up; a trainer machine that vanishes without closing its connections, by power loss
    or a cut cable, then holds the node until this ends it)."""
    rendezvous_timeout_s: float = 60.0
    """How long an accepted trainer has to form the gloo group."""
    chunk_bytes: int = CHUNK_BYTES
    inflight: int = INFLIGHT


class SessionError(Exception):
    """A request the node refuses; the session goes on."""


@dataclass
class HeldSegment:
    spec: SegmentSpec
    layout: FlatLayout
    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    steps: list[torch.Tensor]
    compute_format: ComputeFormat | None
    wire: torch.Tensor | None
    wire_fresh: bool = False


def _format(layout: FlatLayout, kinds) -> ComputeFormat | None:
    """The compute format the host tier gives these kinds (None: fp32 throughout, the master is
    what streams)."""
    if kinds is None or all(k == "fp32" for k in kinds):
        return None
    return ComputeFormat(layout, list(kinds))


def segment_nbytes(spec: SegmentSpec, optimizer: FlatOptimizer) -> int:
    """What holding `spec` takes: fp32 master and gradient, the optimizer's slots and the
    compute copy."""
    layout = spec.layout()
    fmt = _format(layout, spec.compute_kinds)
    return (8 * layout.numel + optimizer.state_nbytes(layout)
            + (0 if fmt is None else fmt.nbytes))


def release_memory() -> None:
    """Give freed heap back to the system: glibc keeps it in the process otherwise, and the
    next session's RSS would stack on the last one's."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


class Session:
    """One trainer's state on the node and its requests."""

    def __init__(self, transport: Transport, opts: NodeOptions, peer: str) -> None:
        self.t, self.opts, self.peer = transport, opts, peer
        self.segments: dict[str, HeldSegment] = {}
        self.optimizer: FlatOptimizer | None = None
        # the receive staging of a pushed gradient, and of a refused payload
        self.staging_bytes = opts.inflight * opts.chunk_bytes
        self.held_bytes = 0

    # -- the loop ----

    def serve(self) -> None:
        handlers = {
            "probe_up": self._probe_up, "probe_down": self._probe_down,
            "configure": self._configure, "put_state": self._put_state,
            "get_state": self._get_state, "push_grad": self._push_grad,
            "zero_grad": self._zero_grad, "step": self._step,
            "get_compute_copy": self._get_compute_copy,
        }
        while True:
            # the trainer's pace; a killed trainer's connection drops and ends the wait
            header = self.t.recv_header(self.opts.idle_timeout_s)
            op = header.get("op")
            if op == "close":  # answered once the state is freed (`NodeServer._session`)
                return
            header["_taken"] = False
            try:
                handler = handlers.get(op)
                if handler is None:
                    raise SessionError(f"unknown request {op!r}")
                reply, tensors = handler(header)
            except (SessionError, ValueError, KeyError) as e:
                if not header["_taken"]:
                    self.t.discard(header, None)
                msg = str(e) if not isinstance(e, KeyError) else f"unknown segment {e}"
                log.warning("session %s: %s refused: %s", self.peer, op, msg)
                reply, tensors = {"error": msg}, ()
            self.t.send_msg({"op": op, **reply}, tensors)

    def _take(self, header: dict, receive) -> None:
        """Take the request's payload with `receive(header)`; a payload that does not match
        the buffers is refused before any of it is read, and drained."""
        header["_taken"] = True
        try:
            receive(header)
        except ValueError:
            self.t.discard(header, None)
            raise

    def _take_into(self, header: dict, dsts) -> None:
        self._take(header, lambda h: self.t.recv_into(h, dsts, None))

    def _seg(self, header: dict) -> HeldSegment:
        if self.optimizer is None:
            raise SessionError("no segments yet: configure first")
        return self.segments[header["segment"]]

    # -- requests ----

    def _probe_up(self, header: dict):
        if self.t.payload_nbytes(header) > PROBE_MAX_BYTES:
            raise SessionError(f"a probe is at most {PROBE_MAX_BYTES} bytes")
        header["_taken"] = True
        self.t.discard(header, None)
        return {}, ()

    def _probe_down(self, header: dict):
        n = int(header["nbytes"])
        if not 0 < n <= PROBE_MAX_BYTES:
            raise SessionError(f"a probe is 1 to {PROBE_MAX_BYTES} bytes")
        return {}, (torch.zeros(n, dtype=torch.uint8),)

    def _configure(self, header: dict):
        if self.optimizer is not None:
            raise SessionError("this session is configured already")
        names = {f.name for f in fields(OptimConfig)}
        optim = OptimConfig(**{k: v for k, v in header["optim"].items() if k in names})
        optimizer = build_flat_optimizer(optim)
        specs = [SegmentSpec.from_json(s) for s in header["segments"]]
        if len({s.name for s in specs}) != len(specs):
            raise SessionError("segment names repeat")
        need = self.staging_bytes + sum(segment_nbytes(s, optimizer) for s in specs)
        if need > self.opts.memory_bytes:
            raise SessionError(
                f"the session's state takes {need / 2**30:.2f} GiB ({need} bytes: fp32 master "
                f"and gradient, {optimizer.name} state, compute copies, receive staging) and "
                f"this node holds {self.opts.memory_bytes / 2**30:.2f} GiB "
                f"({self.opts.memory_bytes} bytes): give the node more --memory or place "
                "fewer segments on it")
        for spec in specs:
            layout = spec.layout()
            fmt = _format(layout, spec.compute_kinds)
            self.segments[spec.name] = HeldSegment(
                spec=spec, layout=layout,
                master=torch.zeros(layout.numel), grad=torch.zeros(layout.numel),
                state={s.name: self._new_slot(optimizer, s, layout) for s in optimizer.slots},
                steps=[new_step_counter() for _ in layout.groups()],
                compute_format=fmt,
                wire=None if fmt is None else torch.zeros(fmt.nbytes, dtype=torch.uint8))
        self.optimizer, self.held_bytes = optimizer, need
        log.info("session %s: holding %d segments, %.2f GiB of %.2f GiB (%s)", self.peer,
                 len(specs), need / 2**30, self.opts.memory_bytes / 2**30, optimizer.name)
        return {"held_bytes": need, "memory_bytes": self.opts.memory_bytes}, ()

    @staticmethod
    def _new_slot(optimizer: FlatOptimizer, slot, layout: FlatLayout) -> torch.Tensor:
        buf = torch.empty(slot.numel(layout), dtype=slot.dtype)
        optimizer.init_slot(slot, layout, buf)
        return buf

    def _copies(self, seg: HeldSegment) -> dict[str, torch.Tensor]:
        return {"master": seg.master, **seg.state, "grad": seg.grad}

    def _put_state(self, header: dict):
        seg = self._seg(header)
        copies = self._copies(seg)
        names = list(header["copies"])
        unknown = [c for c in names if c not in copies]
        if unknown:
            raise SessionError(f"segment {seg.spec.name} has no copies {unknown} (has "
                               f"{list(copies)})")
        steps = header.get("steps")
        if steps is not None and len(steps) != len(seg.steps):
            raise SessionError(f"segment {seg.spec.name}: {len(steps)} step counts for "
                               f"{len(seg.steps)} optimizer groups")
        self._take_into(header, [copies[c] for c in names])
        for counter, value in zip(seg.steps, steps or (), strict=False):
            counter.fill_(value)
        seg.wire_fresh = False
        return {}, ()

    def _get_state(self, header: dict):
        seg = self._seg(header)
        names = list(header.get("copies") or ["master", *seg.state])
        copies = self._copies(seg)
        unknown = [c for c in names if c not in copies]
        if unknown:
            raise SessionError(f"segment {seg.spec.name} has no copies {unknown} (has "
                               f"{list(copies)})")
        lo, count = header.get("lo"), header.get("count")
        if lo is None:
            return ({"copies": names, "steps": [step_count(s) for s in seg.steps]},
                    [copies[c] for c in names])
        # a range of elements of each copy (a checkpoint streams a parameter at a time)
        lo, count = int(lo), int(count)
        short = [c for c in names if not 0 <= lo <= lo + count <= copies[c].numel()]
        if short:
            raise SessionError(f"segment {seg.spec.name}: elements [{lo}, {lo + count}) are past "
                               f"the end of {short}")
        return ({"copies": names, "steps": [step_count(s) for s in seg.steps]},
                [copies[c].view(-1)[lo:lo + count] for c in names])

    def _push_grad(self, header: dict):
        seg = self._seg(header)
        self._take(header, lambda h: self.t.recv_add(h, seg.grad, None))
        return {}, ()

    def _zero_grad(self, header: dict):
        self._seg(header).grad.zero_()
        return {}, ()

    def _step(self, header: dict):
        """The host tier's update of one segment (the module's comment)."""
        seg = self._seg(header)
        expect = header.get("step")
        if expect is not None and any(step_count(s) + 1 != expect for s in seg.steps):
            raise SessionError(f"segment {seg.spec.name}: asked for update {expect}, this node "
                               f"has counted {[step_count(s) for s in seg.steps]}")
        # the clipping coefficient as the host tier takes it: an fp32 scalar on the host
        coef = torch.tensor(float(header["coef"]), dtype=torch.float32)
        seg.grad.mul_(coef)
        self.optimizer.update_range(seg.layout, 0, seg.master, seg.grad, seg.state, seg.steps,
                                    float(header["lr"]))
        if seg.compute_format is not None:
            seg.compute_format.encode(seg.master, seg.wire)
            seg.wire_fresh = True
        seg.grad.zero_()
        advance(seg.steps)
        return {"count": [step_count(s) for s in seg.steps]}, ()

    def _get_compute_copy(self, header: dict):
        seg = self._seg(header)
        kinds = header.get("kinds")
        if kinds is not None and list(kinds) != (
                list(seg.compute_format.kinds) if seg.compute_format is not None
                else ["fp32"] * len(seg.layout.slots)):
            self._reformat(seg, kinds)
        if seg.compute_format is None:
            return {"kinds": ["fp32"] * len(seg.layout.slots)}, (seg.master,)
        if not seg.wire_fresh:
            seg.compute_format.encode(seg.master, seg.wire)
            seg.wire_fresh = True
        return {"kinds": list(seg.compute_format.kinds)}, (seg.wire,)

    def _reformat(self, seg: HeldSegment, kinds) -> None:
        """A layer changed its compute dtype (the host tier's `ComputeCopies.refresh`): a new
        format, its copy reallocated within the budget."""
        kinds = list(kinds)
        if len(kinds) != len(seg.layout.slots):
            raise SessionError(f"segment {seg.spec.name}: {len(kinds)} kinds for "
                               f"{len(seg.layout.slots)} parameters")
        fmt = _format(seg.layout, kinds)
        old = 0 if seg.wire is None else seg.wire.numel()
        new = 0 if fmt is None else fmt.nbytes
        if self.held_bytes - old + new > self.opts.memory_bytes:
            raise SessionError(f"segment {seg.spec.name}: a compute copy in {kinds} does not "
                               "fit this node's --memory")
        seg.compute_format, seg.wire_fresh = fmt, False
        seg.wire = None if fmt is None else torch.zeros(new, dtype=torch.uint8)
        self.held_bytes += new - old


class NodeServer:
    """Accepts trainers on one address, serves one at a time."""

    def __init__(self, opts: NodeOptions) -> None:
        self.opts = opts
        self._lock = threading.Lock()
        self._live: str | None = None  # the served trainer's address
        self._store_fd: int | None = None
        self._stopped = threading.Event()
        self.sessions_served = 0
        self.listener = socket.create_server((opts.host, opts.port), reuse_port=False,
                                             family=_family(opts.host))
        self.listener.settimeout(0.5)

    def hello(self) -> dict:
        return {"version": VERSION, "memory_bytes": self.opts.memory_bytes,
                "transports": ["gloo", "socket"], "store_port": self.opts.port + 1,
                "chunk_bytes": self.opts.chunk_bytes, "inflight": self.opts.inflight}

    def serve_forever(self) -> None:
        log.info("memory node listening on %s:%d (rendezvous on port %d), holding up to "
                 "%.2f GiB", self.opts.host, self.opts.port, self.opts.port + 1,
                 self.opts.memory_bytes / 2**30)
        while not self._stopped.is_set():
            try:
                conn, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                raise
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True,
                             name=f"handshake {peer}").start()

    def stop(self) -> None:
        self._stopped.set()
        self.listener.close()

    def _claim(self, peer: str, request: dict) -> str | None:
        transport = request.get("transport")
        if transport not in ("gloo", "socket"):
            return f"unknown transport {transport!r} (this node speaks gloo and socket)"
        with self._lock:
            if self._live is not None:
                return f"busy: serving the trainer at {self._live}"
            fd = None
            if transport == "gloo":
                # the rendezvous store's socket, bound before the trainer is told to go on
                try:
                    s = socket.create_server((self.opts.host, self.opts.port + 1),
                                             family=_family(self.opts.host))
                except OSError as e:
                    return f"cannot listen for the rendezvous on port {self.opts.port + 1}: {e}"
                fd = s.detach()  # the store owns it from here
            self._live, self._store_fd = peer, fd
        return None

    def _release(self) -> None:
        with self._lock:
            self._live = None
            if self._store_fd is not None:  # a store that never formed leaves its socket
                try:
                    socket.socket(fileno=self._store_fd).close()
                except OSError:
                    pass
            self._store_fd = None

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        try:
            accepted = node_handshake(conn, self.opts.token, self.opts.handshake_timeout_s,
                                      self.hello(), lambda req: self._claim(peer, req))
        except HandshakeRefused as e:
            log.warning("refused %s: %s", peer, e)
            conn.close()
            return
        log.info("accepted the trainer at %s (%s transport)", peer,
                 accepted.request["transport"])
        self._session(conn, peer, accepted)

    def _transport(self, conn: socket.socket, peer: str, accepted: Accepted) -> Transport:
        kw = {"chunk_bytes": self.opts.chunk_bytes, "inflight": self.opts.inflight}
        if accepted.request["transport"] == "socket":
            return SocketTransport(conn, peer, **kw)
        fd, self._store_fd = self._store_fd, None
        pg, store = gloo_group(rank=1, store_host=self.opts.host, store_port=self.opts.port + 1,
                               prefix=accepted.key, local_host=self.opts.host,
                               timeout_s=self.opts.rendezvous_timeout_s, listen_fd=fd)
        return GlooTransport(pg, 1, peer, store=store, **kw)

    def _session(self, conn: socket.socket, peer: str, accepted: Accepted) -> None:
        transport = session = None
        start = time.monotonic()
        try:
            transport = self._transport(conn, peer, accepted)
            session = Session(transport, self.opts, peer)
            session.serve()
            session = None
            release_memory()
            # the answer to "close" says the state is freed; the trainer then waits for this
            # connection to close, which happens once the node takes the next trainer
            transport.send_msg({"op": "close"})
            log.info("session %s: closed by the trainer after %.0f s", peer,
                     time.monotonic() - start)
        except LinkError as e:
            log.warning("session %s: ended, the trainer is gone (%s); freeing its state", peer, e)
        except RuntimeError as e:  # the group never formed
            log.warning("session %s: ended: %s", peer, str(e).splitlines()[0] if str(e) else e)
        except Exception:  # a fault of the node's own: logged, and the node serves on
            log.exception("session %s: failed", peer)
        finally:
            session = None
            if isinstance(transport, GlooTransport):
                transport.close()  # its group and store go: the next rendezvous takes the port
            release_memory()
            self.sessions_served += 1
            self._release()
            log.info("ready for the next trainer")
            if transport is not None:
                transport.close()
            conn.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
