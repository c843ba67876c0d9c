"""The trainer's session with a memory node (--memory-node, tierlm.node): opened once the run
directory is claimed and before the engine places any state, closed at the end and on any
error; a node lost mid-run stops the run with one line that names the node and the newest
checkpoint (`node_failure`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tierlm.config import Config, ConfigError
from tierlm.memory.placement import PlacementReport, gib
from tierlm.node.auth import load_token
from tierlm.node.client import NodeClient
from tierlm.node.protocol import NodeError
from tierlm.plan.inputs import TCP_PAYLOAD_SHARE
from tierlm.train.safety import ReliabilityError, last_good_text

# payload sizes `probe_node` moves each way, each the best of PROBE_REPEATS (the node takes
# probes of at most 64 MiB: tierlm.node.server)
PROBE_MIB = (4, 16, 64)
PROBE_REPEATS = 2


class MemoryNodeError(ReliabilityError):
    """The memory node refused the trainer, or was lost during the run."""


def connect_node(cfg: Config, log: Callable[[str], None]) -> NodeClient | None:
    """The session with --memory-node (None without one): the token read from
    --memory-node-token-file, the transport and the timeout from their flags. Logs what the
    node said at the handshake: its capacity and the link rate measured both ways."""
    mem = cfg.memory
    if mem.memory_node is None:
        return None
    try:
        token = load_token(mem.memory_node_token_file)
    except ValueError as e:  # the node's flag name in its message: the trainer's is this one
        raise ConfigError(str(e).replace("--token-file", "--memory-node-token-file", 1)) from None
    try:
        client = NodeClient(mem.memory_node, token, transport=mem.memory_node_transport,
                            timeout_s=mem.memory_node_timeout)
    except ValueError as e:  # a malformed address
        raise ConfigError(str(e)) from None
    except NodeError as e:
        hint = (" (the token differs from the node's --token-file: check "
                "--memory-node-token-file)" if "wrong token" in str(e) or "token" in str(e)
                else f" (is `tierlm memory-node --listen {mem.memory_node}` running and "
                     "reachable? --memory-node-timeout bounds the wait)")
        raise MemoryNodeError(f"{e}{hint}") from None
    hello = client.hello
    rates = ""
    if hello.link_up_bytes_per_s and hello.link_down_bytes_per_s:
        rates = (f", link {hello.link_up_bytes_per_s / 1e9:.2f} GB/s to the node, "
                 f"{hello.link_down_bytes_per_s / 1e9:.2f} GB/s back")
    log(f"memory node {hello.address}: holds up to {gib(hello.memory_bytes)} "
        f"({hello.transport} transport{rates})")
    return client


def check_node_capacity(report: PlacementReport, node: NodeClient | None) -> None:
    """Refuse a placement whose remote bytes the node's --memory cannot hold, before anything
    is allocated (the node refuses it at `configure` too, with its own count)."""
    if node is None or report.remote_bytes <= node.hello.memory_bytes:
        return
    raise MemoryNodeError(
        f"the segments placed on memory node {node.address} need "
        f"{gib(report.remote_bytes)} (fp32 master, gradient, optimizer state and compute "
        f"copies) and the node holds {gib(node.hello.memory_bytes)}: start it with more "
        "--memory, or put fewer segments on it with --remote")


def node_failure(exc: NodeError, step: int, address: str,
                 last_good: Callable[[], Path | None]) -> MemoryNodeError:
    """The clean stop when the memory node is lost at `step`: what failed, and the newest
    checkpoint (verified), which the lost session cannot have touched."""
    kept = last_good_text(last_good, "the newest checkpoint")
    return MemoryNodeError(
        f"{exc}. Training stopped at step {step}; {kept}. Restart the memory node at "
        f"{address}, then continue with --resume RUN_DIR (the node's state is pushed back "
        "from the checkpoint)")


def node_use_line(node: NodeClient, report: PlacementReport) -> str:
    """What the run keeps on its memory node: the segments whose state it holds and their
    bytes against its memory, or that it holds nothing (the plan fits this machine, or found
    the node's link slower than the disk), so an idle node is never a surprise."""
    remote = [i for i, p in enumerate(report.placements) if p.remote]
    where = f"memory node {node.address}"
    if not remote:
        return (f"{where}: holds no state of this run (the placement keeps every segment on "
                "this machine: --offload-policy auto found it fits here, or that the node's link "
                "is slower than the disk; --remote REGEX with --offload-policy host or tiered "
                "places segments there by hand)")
    return (f"{where}: holds the master and optimizer state of {len(remote)} of "
            f"{len(report.placements)} segments, {gib(report.remote_bytes)} of its "
            f"{gib(node.hello.memory_bytes)}")


def probe_node(address: str, token_file: str, *, transport: str = "socket",
               print_fn: Callable[[str], None] = print) -> int:
    """`tierlm probe --memory-node`: the node's memory and the payload rate each way at a few
    sizes (the best of PROBE_REPEATS), and the `tierlm plan` flags that plan on it; 0, or 2 when
    the node cannot be reached or refuses (one error line naming the node)."""
    try:
        token = load_token(token_file)
    except ValueError as e:
        raise ConfigError(str(e).replace("--token-file", "--memory-node-token-file", 1)) from None
    try:
        client = NodeClient(address, token, transport=transport)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except NodeError as e:
        raise MemoryNodeError(str(e)) from None
    try:
        with client:
            return _measure(client, print_fn)
    except NodeError as e:
        raise MemoryNodeError(str(e)) from None


def _measure(client: NodeClient, print_fn: Callable[[str], None]) -> int:
    """`probe_node`'s measurement on an open session."""
    hello = client.hello
    print_fn(f"memory node {hello.address}: holds up to {gib(hello.memory_bytes)} "
             f"({hello.transport} transport)")
    print_fn("     MiB  to node GB/s  from node GB/s")
    up = down = 0.0
    sizes = [m for m in PROBE_MIB if (m << 20) * 4 <= hello.memory_bytes] or [1]
    for mib in sizes:
        rates = [client.measure_link(mib << 20) for _ in range(PROBE_REPEATS)]
        up, down = max(r[0] for r in rates), max(r[1] for r in rates)
        print_fn(f"  {mib:6d}  {up / 1e9:12.2f}  {down / 1e9:14.2f}")
    line_gbit = min(up, down) / TCP_PAYLOAD_SHARE * 8 / 1e9  # the slower way, as a line rate
    print_fn(f"plan on it with: tierlm plan ... --memory-node-memory "
             f"{hello.memory_bytes / 2**30:.2f}GiB --net-bandwidth {line_gbit:.2f}Gbit "
             "(the slower direction at the largest size; `tierlm plan --memory-node "
             f"{hello.address} --memory-node-token-file FILE` measures it itself)")
    return 0
