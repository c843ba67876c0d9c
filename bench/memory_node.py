#!/usr/bin/env python3
"""The memory node's link on loopback (issue T, item 3 / bench, the link part): how fast a
segment's state crosses to a node and back over gloo point-to-point and over the plain-socket
baseline, against a local memcpy of the same bytes.

A node runs in a second process on 127.0.0.1 (tierlm.node.server, its default 32 MiB chunks,
4 in flight); this process is the trainer. Per size, one segment of that many fp32 bytes:
`put_state` of its master (trainer to node, received straight into the node's buffer) and
`get_state` of it (node to trainer, into a buffer held here), each timed end to end, request
and answer included; memcpy is `dst.copy_(src)` of the same bytes here. Medians of --repeats,
memcpy and the transports interleaved within each repeat. Loopback on one machine measures the
stacks' cost, not a network: on a 2-core machine both processes share the cores.

    python bench/memory_node.py --sizes-mib 1 16 256 --repeats 3

Results: docs/results/memory-node.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.node.client import NodeClient
from tierlm.node.protocol import SegmentSpec

TOKEN = b"bench token"
NODE = """
import logging, sys
from tierlm.node.server import NodeOptions, NodeServer
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
NodeServer(NodeOptions(host="127.0.0.1", port=int(sys.argv[1]), memory_bytes=int(sys.argv[2]),
                       token=sys.argv[3].encode())).serve_forever()
"""


def port_pair() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p


def connect(address: str, transport: str) -> NodeClient:
    deadline = time.monotonic() + 60
    while True:
        try:
            return NodeClient(address, TOKEN, transport=transport, timeout_s=120,
                              probe_bytes=0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    port = port_pair()
    address = f"127.0.0.1:{port}"
    biggest = max(args.sizes_mib) * 2**20
    memory = 6 * biggest + 2**30  # master, gradient, two AdamW slots, staging
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    with tempfile.TemporaryFile() as log:
        node = subprocess.Popen([sys.executable, "-c", NODE, str(port), str(memory),
                                 TOKEN.decode()], env=env, stderr=log)
        try:
            rows = run(address, args.sizes_mib, args.repeats)
        finally:
            node.kill()
            node.wait()
    print(f"loopback, medians of {args.repeats}; GB/s = 1e9 bytes/s; up = trainer to node "
          "(put_state), down = node to trainer (get_state)")
    print(f"{'MiB':>5} {'memcpy':>8} {'socket up':>10} {'socket dn':>10} {'gloo up':>8} "
          f"{'gloo dn':>8} {'gloo/socket up':>15} {'gloo/socket dn':>15} "
          f"{'socket/memcpy':>14}")
    for mib, r in rows:
        print(f"{mib:>5} {r['memcpy']:>8.2f} {r['socket_up']:>10.2f} {r['socket_down']:>10.2f} "
              f"{r['gloo_up']:>8.2f} {r['gloo_down']:>8.2f} "
              f"{r['gloo_up'] / r['socket_up']:>15.2f} "
              f"{r['gloo_down'] / r['socket_down']:>15.2f} "
              f"{max(r['socket_up'], r['socket_down']) / r['memcpy']:>14.2f}")
    rtt = {t: statistics.median(r[f"{t}_rtt"] for _, r in rows) for t in ("socket", "gloo")}
    print(f"a request without payload, answered (median): socket {rtt['socket']:.2f} ms, "
          f"gloo {rtt['gloo']:.2f} ms")


def run(address: str, sizes_mib: list[int], repeats: int) -> list[tuple[int, dict]]:
    return [(mib, measure(address, mib * 2**20, repeats)) for mib in sizes_mib]


def measure(address: str, nbytes: int, repeats: int) -> dict[str, float]:
    """GB/s of memcpy, and of each transport up and down, for one segment of `nbytes`: each
    repeat times all of them in turn (the node serves one trainer at a time, so each repeat
    opens a session per transport; a warm-up round trip first touches the node's pages)."""
    n = nbytes // 4
    layout = FlatLayout([("w", (n,), True)])
    tiny = FlatLayout([("w", (16,), True)])
    src = torch.randn(n)
    dst = torch.empty(n)
    dst.copy_(src)
    times: dict[str, list[float]] = {}

    def timed(key: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)

    for _ in range(repeats):
        timed("memcpy", lambda: dst.copy_(src))
        for transport in ("socket", "gloo"):
            with connect(address, transport) as c:
                c.configure([SegmentSpec.of("seg", layout), SegmentSpec.of("tiny", tiny)],
                            OptimConfig())
                c.put_state("seg", {"master": src})
                c.get_state("seg", ["master"], out={"master": dst})
                timed(f"{transport}_up", lambda c=c: c.put_state("seg", {"master": src}))
                dst.zero_()
                timed(f"{transport}_down",
                      lambda c=c: c.get_state("seg", ["master"], out={"master": dst}))
                if not torch.equal(dst, src):
                    raise AssertionError(f"{transport}: the state came back changed")
                for _ in range(10):  # a request without payload: the link's latency
                    timed(f"{transport}_rtt", lambda c=c: c.zero_grad("tiny"))
    out = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    for t in ("socket", "gloo"):
        out[f"{t}_rtt"] = statistics.median(times[f"{t}_rtt"]) * 1e3  # ms
    return out


if __name__ == "__main__":
    main()
