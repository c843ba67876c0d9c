"""What the trainer and a memory node say to each other after the handshake
(tierlm.node.auth): the segments a session holds, and the requests.

Requests (the header's "op"; every one is answered, in order, by a header with "error" or the
op's results; a payload rides after its header, tierlm.node.transport):

    probe_up    payload N bytes          -> {}                     (link rate, trainer to node)
    probe_down  nbytes                   -> payload nbytes          (link rate, node to trainer)
    configure   segments, optim          -> held_bytes, memory_bytes
    put_state   segment, copies, steps   + one tensor per copy  -> {}
    get_state   segment, copies or None  -> copies, steps       + one tensor per copy
    push_grad   segment                  + the flat fp32 gradient -> {} (added into the node's)
    zero_grad   segment                  -> {}                     (a skipped step)
    step        segment, lr, coef, step  -> count                  (the optimizer update)
    get_compute_copy  segment, kinds     -> kinds + one tensor     (the weights to compute with)
    close                                -> {}                     (once the state is freed)
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.memory.layout import FlatLayout

KINDS = ("fp32", "bf16", "e4m3")  # a compute copy's per-parameter dtypes (precision.streaming)


class NodeError(RuntimeError):
    """A memory node refused a request, failed, or could not be reached; the message names the
    node's address."""


@dataclass(frozen=True, kw_only=True)
class SegmentSpec:
    """One segment the node holds: its name, its parameters (name, shape, takes weight decay)
    in flat-layout order, and the per-parameter dtypes of the compute copy it serves (None:
    fp32 throughout, the master itself is served)."""

    name: str
    params: tuple[tuple[str, tuple[int, ...], bool], ...]
    compute_kinds: tuple[str, ...] | None = None

    @classmethod
    def of(cls, name: str, layout: FlatLayout,
           compute_kinds: list[str] | tuple[str, ...] | None = None) -> SegmentSpec:
        """The spec of a trainer segment with flat layout `layout` (runtime.state's
        `SegmentState.layout`; its compute format's `kinds`)."""
        return cls(name=name, params=tuple((s.name, tuple(s.shape), s.decay)
                                           for s in layout.slots),
                   compute_kinds=None if compute_kinds is None else tuple(compute_kinds))

    def layout(self) -> FlatLayout:
        return FlatLayout([(n, tuple(shape), decay) for n, shape, decay in self.params])

    def to_json(self) -> dict:
        return {"name": self.name, "params": [[n, list(s), d] for n, s, d in self.params],
                "compute_kinds": None if self.compute_kinds is None else list(self.compute_kinds)}

    @classmethod
    def from_json(cls, obj: dict) -> SegmentSpec:
        kinds = obj.get("compute_kinds")
        if kinds is not None and any(k not in KINDS for k in kinds):
            raise ValueError(f"segment {obj['name']}: compute kinds {kinds} (known: {KINDS})")
        return cls(name=str(obj["name"]),
                   params=tuple((str(n), tuple(int(x) for x in s), bool(d))
                                for n, s, d in obj["params"]),
                   compute_kinds=None if kinds is None else tuple(kinds))


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port); the host is required (no default
    interface: the user names the one to listen on or reach)."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"{flag} {text!r}: write ADDRESS:PORT, e.g. 10.0.0.2:29600 (the port "
                         "and the one after it are used)")
    return host, int(port)
