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
from tierlm.train.safety import ReliabilityError


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
    try:
        path = last_good()
        kept = (f"the newest checkpoint {path} is intact and verified" if path is not None
                else "no checkpoint had been written yet")
    except Exception as verify_exc:  # verification itself failed: say so, do not hide it
        kept = f"the checkpoints could not be verified ({verify_exc})"
    return MemoryNodeError(
        f"{exc}. Training stopped at step {step}; {kept}. Restart the memory node at "
        f"{address}, then continue with --resume RUN_DIR (the node's state is pushed back "
        "from the checkpoint)")
