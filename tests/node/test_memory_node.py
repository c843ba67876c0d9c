"""The memory node (tierlm.node): a node process and a trainer on loopback. The node's update
must equal the host tier's bit for bit; refused clients must leave the live session as it was;
a dead trainer frees the node, a dead node raises an error naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.node.auth import NODE_GREETING, load_token
from tierlm.node.client import NodeClient
from tierlm.node.protocol import NodeError, SegmentSpec
from tierlm.optim.build import build_flat_optimizer
from tierlm.optim.flat import advance, new_step_counter, step_count
from tierlm.precision.streaming import ComputeFormat

SRC = Path(__file__).resolve().parents[2] / "src"
TOKEN = b"correct horse battery staple"
CHUNK = 64 * 2**10  # small chunks: a test segment crosses in several, several in flight

# the node, as `tierlm memory-node` runs it, with a small chunk and a short handshake deadline
NODE = """
import logging, sys
from tierlm.node.auth import load_token
from tierlm.node.server import NodeOptions, NodeServer
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
host, port, memory, token_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
NodeServer(NodeOptions(host=host, port=port, memory_bytes=memory, token=load_token(token_file),
                       handshake_timeout_s=2.0, chunk_bytes=65536, inflight=2)).serve_forever()
"""

# a trainer that configures a session and waits to be killed
TRAINER = """
import sys, time, torch
from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.node.client import NodeClient
from tierlm.node.protocol import SegmentSpec
c = NodeClient(sys.argv[1], sys.argv[2].encode(), transport=sys.argv[3], timeout_s=30,
               probe_bytes=4096)
c.configure([SegmentSpec.of("a", FlatLayout([("w", (256, 256), True)]))], OptimConfig())
c.push_grad("a", torch.ones(256 * 256))
print("ready", flush=True)
time.sleep(600)
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback (the node listens on p, its rendezvous on
    p + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            if p >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
        return p
    raise RuntimeError("no free port pair")


def _token_file(tmp_path: Path) -> Path:
    f = tmp_path / "token"
    f.write_bytes(TOKEN + b"\n")
    f.chmod(0o600)
    return f


class Node:
    def __init__(self, tmp_path: Path, memory_bytes: int = 2**30, cli: bool = False,
                 flags: tuple[str, ...] = ()) -> None:
        self.port = free_port_pair()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tmp_path / f"node-{self.port}.log"
        token = _token_file(tmp_path)
        if cli:
            args = ["-m", "tierlm", "memory-node", "--listen", self.address, "--memory",
                    str(memory_bytes), "--token-file", str(token), "--handshake-timeout", "2",
                    *flags]
        else:
            args = ["-c", NODE, "127.0.0.1", str(self.port), str(memory_bytes), str(token)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, *args], env=_env(), stderr=log,
                                         stdout=log)
        self.wait_log("listening on")

    def text(self) -> str:
        return self.log.read_text()

    def wait_log(self, needle: str, count: int = 1) -> None:
        deadline = time.monotonic() + 120  # a bound on a wait, not a timing assertion
        while self.text().count(needle) < count:
            if self.proc.poll() is not None:
                raise AssertionError(f"the node exited:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the node never logged {needle!r}:\n{self.text()}")
            time.sleep(0.05)

    def connect(self, transport: str = "gloo", token: bytes = TOKEN, timeout_s: float = 30,
                **kw) -> NodeClient:
        return NodeClient(self.address, token, transport=transport, timeout_s=timeout_s,
                          probe_bytes=256 * 2**10, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("node"))
    yield n
    n.stop()


# two segments: matrices that decay and vectors that do not (two optimizer groups), one with a
# bf16 / e4m3 compute copy; numels that cross several 64 KiB chunks and end inside one
LAYOUTS = {
    "block0": FlatLayout([("w1", (96, 80), True), ("w2", (80, 96), True), ("norm", (80,), False),
                          ("bias", (96,), False)]),
    "head": FlatLayout([("emb", (300, 40), False), ("proj", (40, 40), True)]),
}
KINDS = {"block0": ["e4m3", "bf16", "fp32", "bf16"], "head": None}


def specs() -> list[SegmentSpec]:
    return [SegmentSpec.of(name, layout, KINDS[name]) for name, layout in LAYOUTS.items()]


class HostSegment:
    """One segment as the host tier holds it and updates it (tierlm.runtime.engine's `_update`
    of a host segment, and `ComputeCopies.refresh`), the reference the node must equal."""

    def __init__(self, name: str, cfg: OptimConfig, master: torch.Tensor) -> None:
        self.layout = LAYOUTS[name]
        self.opt = build_flat_optimizer(cfg)
        self.master = master.clone()
        self.grad = torch.zeros_like(master)
        self.state = {s.name: torch.zeros(s.numel(self.layout), dtype=s.dtype)
                      for s in self.opt.slots}
        self.steps = [new_step_counter() for _ in self.layout.groups()]
        kinds = KINDS[name]
        self.fmt = None if kinds is None else ComputeFormat(self.layout, kinds)
        self.wire = None if self.fmt is None else torch.zeros(self.fmt.nbytes, dtype=torch.uint8)

    def update(self, coef_value: float, lr: float) -> None:
        coef = torch.tensor(coef_value, dtype=torch.float32)
        self.grad.mul_(coef)
        self.opt.update_range(self.layout, 0, self.master, self.grad, self.state, self.steps, lr)
        if self.fmt is not None:
            self.fmt.encode(self.master, self.wire)
        self.grad.zero_()
        advance(self.steps)

    def compute_copy(self) -> torch.Tensor:
        return self.master if self.fmt is None else self.wire


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def run_steps(client: NodeClient, host: dict[str, HostSegment], gen: torch.Generator,
              steps: range, micro_batches: int = 2) -> None:
    """Push `micro_batches` gradients per segment per step (the node accumulates them, as the
    host tier's gradient buffer does) and update both with a clipping coefficient."""
    for k in steps:
        for name, seg in host.items():
            for _ in range(micro_batches):
                g = torch.randn(seg.layout.numel, generator=gen)
                seg.grad.add_(g)
                client.push_grad(name, g)
        coef = float(torch.tensor(0.37 + 0.1 * k, dtype=torch.float32))  # an fp32 value
        lr = 1e-3 * (k + 1)
        for name, seg in host.items():
            client.step(name, lr=lr, coef=coef, step=k + 1, wait=False)
            seg.update(coef, lr)
        client.wait()


def assert_node_equals_host(client: NodeClient, host: dict[str, HostSegment]) -> None:
    for name, seg in host.items():
        got, counts = client.get_state(name)
        assert counts == [step_count(s) for s in seg.steps]
        assert same_bits(got["master"], seg.master), name
        for slot, buf in seg.state.items():
            assert same_bits(got[slot], buf), (name, slot)
        assert same_bits(client.get_compute_copy(name), seg.compute_copy()), name


@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_state_round_trip_is_bit_exact(node, transport):
    gen = torch.Generator().manual_seed(0)
    with node.connect(transport) as c:
        assert c.hello.memory_bytes == 2**30 and c.hello.transport == transport
        assert c.hello.link_up_bytes_per_s > 0 and c.hello.link_down_bytes_per_s > 0
        held = c.configure(specs(), OptimConfig())
        assert held > sum(12 * lay.numel for lay in LAYOUTS.values())
        sent = {}
        for name, layout in LAYOUTS.items():
            n = layout.numel
            # values a float round trip would not keep: NaN payloads, -0.0, denormals
            master = torch.randn(n, generator=gen)
            master[:4] = torch.tensor([float("nan"), -0.0, 1e-45, float("inf")])
            sent[name] = {"master": master, "exp_avg": torch.randn(n, generator=gen),
                          "exp_avg_sq": torch.rand(n, generator=gen)}
            c.put_state(name, sent[name], steps=[7.0] * len(layout.groups()))
        for name in LAYOUTS:
            got, counts = c.get_state(name)
            assert counts == [7.0] * len(LAYOUTS[name].groups())
            assert set(got) == set(sent[name])
            for copy, t in sent[name].items():
                assert same_bits(got[copy], t), (name, copy)
        # a refused request's payload is drained: the session goes on in step
        with pytest.raises(NodeError, match="unknown segment 'nope'"):
            c.put_state("nope", {"master": torch.ones(100_000)})
        with pytest.raises(NodeError, match="does not match the receiving buffers"):
            c.put_state("head", {"master": torch.ones(100_000)})
        with pytest.raises(NodeError, match="is not one tensor like"):
            c.push_grad("head", torch.ones(7))
        with pytest.raises(NodeError, match=r"has no copies \['moment'\]"):
            c.get_state("head", ["moment"])
        # into the caller's buffers (a checkpoint's staging)
        out = {k: torch.empty_like(v) for k, v in sent["head"].items()}
        got, _ = c.get_state("head", out=out)
        assert all(got[k] is out[k] and same_bits(out[k], sent["head"][k]) for k in out)


@pytest.mark.parametrize("opt", ["AdamW", "Lion"])
def test_node_update_equals_the_host_tier(node, opt):
    """Same state, same gradients (two micro-batches), clipping on, three steps: masters,
    optimizer slots, step counts and compute copies (fp32, bf16, e4m3) equal bit for bit."""
    cfg = OptimConfig(name=opt, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    with node.connect("gloo") as c:
        c.configure(specs(), cfg)
        host = {}
        for name, layout in LAYOUTS.items():
            master = torch.randn(layout.numel, generator=gen)
            c.put_state(name, {"master": master})
            host[name] = HostSegment(name, cfg, master)
        run_steps(c, host, gen, range(3))
        assert_node_equals_host(c, host)


def test_intruders_are_refused_and_the_session_goes_on(node, tmp_path):
    """While a trainer's session is live: a wrong token, a second trainer with the right one, a
    client sending garbage, one closing early and one saying nothing are each refused with a
    logged reason, and the live session's results are those of an undisturbed run."""
    cfg = OptimConfig()
    gen = torch.Generator().manual_seed(2)
    before = node.text().count("refused 127.0.0.1:")
    with node.connect("gloo") as c:
        c.configure(specs(), cfg)
        host = {}
        for name, layout in LAYOUTS.items():
            master = torch.randn(layout.numel, generator=gen)
            c.put_state(name, {"master": master})
            host[name] = HostSegment(name, cfg, master)
        run_steps(c, host, gen, range(1))

        with pytest.raises(NodeError, match=f"memory node {node.address}: refused: wrong token"):
            node.connect("gloo", token=b"not the token")
        with pytest.raises(NodeError, match="refused: busy"):
            node.connect("socket")
        with socket.create_connection(("127.0.0.1", node.port)) as s:  # garbage
            assert s.recv(len(NODE_GREETING)) == NODE_GREETING
            s.sendall(os.urandom(200))
        with socket.create_connection(("127.0.0.1", node.port)) as s:  # closes early
            s.recv(8)
        silent = socket.create_connection(("127.0.0.1", node.port))  # says nothing
        node.wait_log("refused 127.0.0.1:", before + 5)
        silent.close()

        run_steps(c, host, gen, range(1, 3))
        assert_node_equals_host(c, host)
    log = node.text()
    assert "wrong token" in log
    assert "busy: serving the trainer at" in log
    assert "does not speak the handshake" in log
    assert "closed the connection during the trainer's greeting" in log
    assert "timed out waiting for the trainer's greeting" in log


def test_calls_from_two_threads_take_turns(tmp_path):
    """The engine may push a gradient from its update worker while the training thread fetches
    a compute copy: each request and its answer stay one exchange. (The socket transport: its
    calls release the GIL, so without the client's lock the threads' messages interleave.)"""
    node = Node(tmp_path)  # its own: a broken exchange may leave the node waiting
    try:
        with node.connect("socket", timeout_s=10) as c:
            c.configure(specs(), OptimConfig())
            gen = torch.Generator().manual_seed(3)
            c.put_state("block0", {"master": torch.randn(LAYOUTS["block0"].numel, generator=gen)})
            want = c.get_compute_copy("block0")
            ones = torch.ones(LAYOUTS["head"].numel)
            errors = []

            def pushes():
                try:
                    for _ in range(20):
                        c.push_grad("head", ones)
                except Exception as e:  # reported below, not lost in the thread
                    errors.append(e)

            switch = sys.getswitchinterval()
            sys.setswitchinterval(1e-6)  # the threads interleave inside the calls
            try:
                t = threading.Thread(target=pushes)
                t.start()
                copies = [c.get_compute_copy("block0") for _ in range(20)]
                t.join()
            finally:
                sys.setswitchinterval(switch)
            assert errors == []
            assert all(same_bits(x, want) for x in copies)
            got, _ = c.get_state("head", ["grad"])
            assert torch.equal(got["grad"], torch.full_like(ones, 20.0))
    finally:
        node.stop()


def test_a_session_that_does_not_fit_is_refused(node):
    big = SegmentSpec.of("big", FlatLayout([("w", (8192, 8192), True)]))  # 1 GiB of state
    with node.connect("socket") as c:
        with pytest.raises(NodeError, match=r"takes 1\.\d+ GiB .* holds 1\.00 GiB .*--memory"):
            c.configure([big], OptimConfig())
        # the session goes on: something that fits
        assert c.configure(specs(), OptimConfig()) > 0


@pytest.mark.parametrize("transport", ["gloo", "socket"])
def test_killed_trainer_frees_the_node_for_the_next(node, transport):
    gone = node.text().count("the trainer is gone")
    ready = node.text().count("ready for the next trainer")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, node.address, TOKEN.decode(), transport], env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "ready", trainer.stderr.read()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        node.wait_log("the trainer is gone", gone + 1)
        node.wait_log("ready for the next trainer", ready + 1)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    with node.connect(transport) as c:  # the node takes the next trainer, with a clean slate
        c.configure(specs(), OptimConfig())
        got, counts = c.get_state("block0")
        assert counts == [0.0, 0.0] and not got["master"].any()


# a dead peer reads the same on both transports (the connection drops); a stalled one takes each
# transport's own timeout
@pytest.mark.parametrize(("transport", "fault"),
                         [("gloo", "killed"), ("gloo", "stalled"), ("socket", "stalled")])
def test_a_dead_or_stalled_node_raises_an_error_naming_it(tmp_path, transport, fault):
    """SIGKILL: the connection drops; SIGSTOP: the node says nothing and the trainer's
    `timeout_s` ends the wait. Either way the trainer gets a NodeError naming the node, and the
    session is spent."""
    node = Node(tmp_path)
    try:
        c = NodeClient(node.address, TOKEN, transport=transport, timeout_s=3, probe_bytes=4096)
        c.configure(specs(), OptimConfig())
        c.push_grad("head", torch.ones(LAYOUTS["head"].numel))
        node.proc.send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        if fault == "killed":
            node.proc.wait()
        with pytest.raises(NodeError, match=f"memory node {node.address}: .* failed") as err:
            c.step("head", lr=1e-3, coef=1.0)
            c.get_compute_copy("head")
        if fault == "stalled":
            assert "timed out" in str(err.value).lower(), err.value
        with pytest.raises(NodeError, match=f"memory node {node.address}: the session is lost"):
            c.get_compute_copy("head")
        c.close()
    finally:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)
        node.stop()


def test_a_silent_trainer_is_let_go_after_the_idle_timeout(tmp_path):
    """`--idle-timeout`: a trainer that says nothing that long (its machine gone without
    closing the connection looks the same) loses its session, and the node takes the next."""
    node = Node(tmp_path, cli=True, flags=("--idle-timeout", "1"))
    try:
        c = node.connect("gloo")
        c.configure(specs(), OptimConfig())
        node.wait_log("ready for the next trainer")  # the node ended the silent session
        with pytest.raises(NodeError, match=f"memory node {node.address}: .* failed"):
            c.get_compute_copy("head")
        c.close()
        with node.connect("socket") as c2:
            assert c2.configure(specs(), OptimConfig()) > 0
    finally:
        node.stop()


def test_node_peak_rss_stays_within_its_memory(tmp_path):
    """`tierlm memory-node --memory 512MiB`, a session of ~200 MiB of state and a few steps:
    the node's peak RSS (VmHWM) stays under --memory plus 1 GiB."""
    memory = 512 * 2**20
    node = Node(tmp_path, memory_bytes=memory, cli=True)
    try:
        layout = FlatLayout([("w", (2048, 2048), True), ("b", (2048,), False)])  # 4.2M params
        segs = [SegmentSpec.of(f"s{i}", layout) for i in range(3)]  # 3 x 4 x 4.2M x 4 B
        with node.connect("gloo") as c:
            c.configure(segs, OptimConfig())
            g = torch.ones(layout.numel)
            for k in range(2):
                for s in segs:
                    c.push_grad(s.name, g)
                    c.step(s.name, lr=1e-3, coef=1.0, step=k + 1)
                    c.get_compute_copy(s.name)
            c.get_state("s0")
        status = Path(f"/proc/{node.proc.pid}/status").read_text()
        hwm_kib = int(next(line.split()[1] for line in status.splitlines()
                           if line.startswith("VmHWM:")))
        assert hwm_kib * 1024 <= memory + 2**30, f"peak RSS {hwm_kib} KiB"
    finally:
        node.stop()


def test_memory_node_flags(tmp_path, capsys):
    from tierlm.cli import main

    token = _token_file(tmp_path)
    base = ["memory-node", "--listen", "127.0.0.1:29999", "--memory", "1GiB"]
    assert main([*base, "--token-file", str(token), "--offload-dir", str(tmp_path)]) == 2
    assert "--offload-dir: not supported yet" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    assert main([*base, "--token-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err
    token.chmod(0o644)
    assert main([*base, "--token-file", str(token)]) == 2
    assert "readable by other users" in capsys.readouterr().err
    token.chmod(0o600)
    assert main(["memory-node", "--listen", "29999", "--memory", "1GiB", "--token-file",
                 str(token)]) == 2
    assert "--listen '29999': write ADDRESS:PORT" in capsys.readouterr().err
    assert load_token(token) == TOKEN
