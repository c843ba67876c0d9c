"""Who may use a memory node: a challenge-response over the shared token, on the plain TCP
connection the trainer opens, before any process group forms.

    node    -> trainer: NODE_GREETING, node nonce (32 random bytes)
    trainer -> node:    TRAINER_GREETING, trainer nonce, HMAC-SHA256(token, "trainer" || node
                        nonce || trainer nonce || request), request length (4 bytes), request
                        (JSON: the transport it asks for)
    node    -> trainer: "OK", HMAC-SHA256(token, "node" || trainer nonce || node nonce ||
                        hello), hello length, hello (JSON: capacity, ...)
                     or "NO", reason length, reason (and the node closes the connection)

The token never crosses the wire; each side proves it holds it over a nonce the other chose
(mutual: a trainer does not hand its model's state to a node that cannot prove the token), and
the MACs cover the request and the hello, so neither can be altered on the way. The session's
rendezvous keys derive from both nonces and the token (`session_key`). Nothing is encrypted:
on an untrusted network run the link through an SSH tunnel or a VPN
(docs/guides/memory-node.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

NODE_GREETING = b"tierlm-memory-node/1\n"
TRAINER_GREETING = b"tierlm-trainer/1\n"
NONCE_BYTES = 32
MAC_BYTES = 32
_MAX_JSON_BYTES = 64 * 2**10


class HandshakeRefused(Exception):
    """The peer was refused (node side: the reason it is logged with; trainer side: the reason
    the node gave, or why the node could not be trusted)."""


def load_token(path: str | os.PathLike) -> bytes:
    """The shared secret in `path` (surrounding whitespace dropped). Refused when empty, or
    readable by users other than its owner, as ssh refuses such a key."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        token = p.read_bytes().strip()
    except OSError as e:
        raise ValueError(f"--token-file {path}: cannot read it ({e.strerror})") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"--token-file {path}: readable by other users (mode "
                         f"{stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    if not token:
        raise ValueError(f"--token-file {path} is empty; write a secret into it, e.g. "
                         f"`head -c 32 /dev/urandom | base64 > {path}`")
    return token


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def session_key(token: bytes, node_nonce: bytes, trainer_nonce: bytes) -> str:
    """A key both ends know and an onlooker does not: the prefix of the session's rendezvous
    entries."""
    return _mac(token, b"session", node_nonce, trainer_nonce).hex()[:32]


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        try:
            part = sock.recv(n - len(out))
        except TimeoutError as e:
            raise HandshakeRefused(f"timed out waiting for the {what}") from e
        except ConnectionResetError as e:  # closed with our greeting unread
            raise HandshakeRefused(f"closed the connection during the {what}") from e
        except OSError as e:
            raise HandshakeRefused(f"connection failed during the {what}: {e}") from e
        if not part:
            raise HandshakeRefused(f"closed the connection during the {what}")
        out += part
    return bytes(out)


def _send_json(sock: socket.socket, prefix: bytes, obj: dict) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(prefix + struct.pack("<I", len(raw)) + raw)


def _recv_json(sock: socket.socket, what: str) -> tuple[bytes, dict]:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4, what))
    if n > _MAX_JSON_BYTES:
        raise HandshakeRefused(f"a {what} of {n} bytes")
    raw = _recv_exact(sock, n, what)
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise HandshakeRefused(f"the {what} is not JSON") from e
    if not isinstance(obj, dict):
        raise HandshakeRefused(f"the {what} is not a JSON object")
    return raw, obj


@dataclass(frozen=True)
class Accepted:
    """A trainer the node accepted: what it asked for, and the session's key."""

    request: dict
    key: str


def node_handshake(sock: socket.socket, token: bytes, timeout_s: float, hello: dict,
                   claim) -> Accepted:
    """The node's side, on a connection it accepted. `claim(request)` takes the node for this
    trainer (None) or says why not (a trainer is already served); it is asked only once the
    trainer has proved the token, and before the trainer is told it may go on. Raises
    `HandshakeRefused` with the reason to log; the trainer is told it too where it spoke the
    protocol."""
    sock.settimeout(timeout_s)
    node_nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        sock.sendall(NODE_GREETING + node_nonce)
    except OSError as e:
        raise HandshakeRefused(f"connection failed during the greeting: {e}") from e
    greeting = _recv_exact(sock, len(TRAINER_GREETING), "trainer's greeting")
    if greeting != TRAINER_GREETING:
        raise HandshakeRefused(f"does not speak the handshake (greeting {greeting[:16]!r})")
    trainer_nonce = _recv_exact(sock, NONCE_BYTES, "trainer's nonce")
    mac = _recv_exact(sock, MAC_BYTES, "trainer's proof")
    raw, request = _recv_json(sock, "trainer's request")

    def refuse(reason: str) -> HandshakeRefused:
        try:
            _send_json(sock, b"NO", {"reason": reason})
        except OSError:
            pass
        return HandshakeRefused(reason)

    if not hmac.compare_digest(mac, _mac(token, b"trainer", node_nonce, trainer_nonce, raw)):
        raise refuse("wrong token")
    busy = claim(request)
    if busy is not None:
        raise refuse(busy)
    hello_raw = json.dumps(hello).encode()
    try:
        sock.sendall(b"OK" + _mac(token, b"node", trainer_nonce, node_nonce, hello_raw)
                     + struct.pack("<I", len(hello_raw)) + hello_raw)
    except OSError as e:
        raise HandshakeRefused(f"connection failed sending the hello: {e}") from e
    return Accepted(request, session_key(token, node_nonce, trainer_nonce))


def trainer_handshake(sock: socket.socket, token: bytes, timeout_s: float, request: dict,
                      address: str) -> tuple[dict, str]:
    """The trainer's side: (the node's hello, the session's key). Raises `HandshakeRefused`
    naming the node `address` when the node refuses or cannot prove the token."""
    sock.settimeout(timeout_s)
    try:
        greeting = _recv_exact(sock, len(NODE_GREETING), "node's greeting")
        if greeting != NODE_GREETING:
            if greeting.startswith(NODE_GREETING.split(b"/")[0] + b"/"):
                raise HandshakeRefused(f"it speaks another protocol ({greeting.strip()!r}; this "
                                       f"trainer {NODE_GREETING.strip()!r}): run the same "
                                       "tierlm version on both machines")
            raise HandshakeRefused("it is not a tierlm memory node (unknown greeting)")
        node_nonce = _recv_exact(sock, NONCE_BYTES, "node's nonce")
        trainer_nonce = secrets.token_bytes(NONCE_BYTES)
        raw = json.dumps(request).encode()
        sock.sendall(TRAINER_GREETING + trainer_nonce
                     + _mac(token, b"trainer", node_nonce, trainer_nonce, raw)
                     + struct.pack("<I", len(raw)) + raw)
        status = _recv_exact(sock, 2, "node's answer")
        if status == b"NO":
            _, answer = _recv_json(sock, "node's reason")
            raise HandshakeRefused(f"refused: {answer.get('reason')}")
        if status != b"OK":
            raise HandshakeRefused(f"unknown answer {status!r}")
        mac = _recv_exact(sock, MAC_BYTES, "node's proof")
        hello_raw, hello = _recv_json(sock, "node's hello")
        if not hmac.compare_digest(mac, _mac(token, b"node", trainer_nonce, node_nonce,
                                             hello_raw)):
            raise HandshakeRefused("it could not prove it holds the token: check "
                                   "--memory-node-token-file on both machines")
    except HandshakeRefused as e:
        raise HandshakeRefused(f"memory node {address}: {e}") from None
    except OSError as e:
        raise HandshakeRefused(f"memory node {address}: handshake failed: {e}") from e
    return hello, session_key(token, node_nonce, trainer_nonce)
