"""`tierlm memory-node`: the flags, and running the node until it is stopped (Ctrl-C)."""

from __future__ import annotations

import argparse
import logging
import sys

from tierlm.config import ConfigError, parse_bytes
from tierlm.node.auth import load_token


def add_memory_node_parser(sub) -> None:
    p = sub.add_parser(
        "memory-node", help="serve this machine's RAM (and cores) to a trainer as a tier",
        description="Hold the state of the segments a trainer places here (fp32 master, "
        "optimizer slots, accumulated gradient) and apply their optimizer updates; one trainer "
        "at a time, admitted by a challenge-response over a shared token. Nothing is "
        "encrypted: on an untrusted network use an SSH tunnel or a VPN "
        "(docs/guides/memory-node.md).",
    )
    p.add_argument("--listen", required=True, metavar="ADDR:PORT",
                   help="the address and port to listen on (no default: name the interface, "
                   "e.g. 10.0.0.2:29600); the rendezvous takes PORT+1 on the same address")
    p.add_argument("--memory", required=True, metavar="SIZE",
                   help="the RAM a trainer's state may take here, e.g. 128GiB")
    p.add_argument("--token-file", required=True, metavar="F",
                   help="a file holding the shared secret (mode 600), the same file the "
                   "trainer is given")
    p.add_argument("--offload-dir", default=None, metavar="DIR",
                   help="a directory on this machine's disk for state beyond --memory "
                   "(not supported yet: giving it is an error)")
    p.add_argument("--handshake-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a connecting client has to complete the handshake")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                   help="end a session whose trainer sends nothing for S seconds (default: "
                   "wait while its connection is up; a killed trainer ends it at once, but a "
                   "trainer machine that vanishes without closing its connections holds the "
                   "node until this ends it); keep it above the trainer's longest pause "
                   "(evaluation, a checkpoint)")


def _error(msg: str) -> int:
    print(f"tierlm: error: {msg}", file=sys.stderr)
    return 2


def memory_node_main(args: argparse.Namespace) -> int:
    # the protocol and the server import torch (seconds): only for this command, not --help
    from tierlm.node.protocol import parse_address

    if args.offload_dir is not None:
        return _error("memory-node --offload-dir: not supported yet (the node holds its "
                      "segments in RAM only); drop the flag, or give the node more --memory")
    try:
        host, port = parse_address(args.listen, "--listen")
        memory_bytes = parse_bytes(args.memory, "--memory")
        token = load_token(args.token_file)
    except (ValueError, ConfigError) as e:
        return _error(str(e))
    if memory_bytes <= 0:
        return _error(f"--memory {args.memory}: give the node some memory")
    if args.idle_timeout is not None and args.idle_timeout <= 0:
        return _error(f"--idle-timeout {args.idle_timeout}: give a positive number of seconds")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s memory-node: %(message)s")
    from tierlm.node.server import NodeOptions, NodeServer  # torch, as above

    try:
        server = NodeServer(NodeOptions(host=host, port=port, memory_bytes=memory_bytes,
                                        token=token,
                                        handshake_timeout_s=args.handshake_timeout,
                                        idle_timeout_s=args.idle_timeout))
    except OSError as e:
        return _error(f"--listen {args.listen}: cannot listen there: {e.strerror or e}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop()
        return 130
    return 0
