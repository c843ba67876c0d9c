"""The planner's time model: per-lane seconds of a step (compute, H2D/D2H, disk, the CPU update,
NF4 decode, the context-parallel ring's sends, gradient sync), with overlap as the runtime does
it, and the bottleneck they name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierlm.distributed.context import ring_send_bytes
from tierlm.distributed.sync import DenseSync
from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    KeepGraphs,
    keeps_graph,
)
from tierlm.memory.tiers import Link, Tier
from tierlm.precision.nf4 import decode_traffic_bytes
from tierlm.runtime.byte_replay import _compute_copies, _disk_update_bytes
from tierlm.runtime.shapes import ModelShape, TrainShape
from tierlm.runtime.writeback import WriteBack

MATMUL_EFFICIENCY = 0.45  # achieved / peak matmul rate for transformer blocks (typical MFU)


COPY_EFFICIENCY = 0.9  # pinned copies reach ~90% of the profile's practical rate


def writeback_bytes(
    shape: ModelShape, placements, copies: list[int | None], writeback: WriteBack | None,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
) -> dict[int, int]:
    """Disk-tier segment -> bytes of its update written back behind the step (and held in host
    staging until written): those updated in one chunk (Engine._update_whole: a compute copy's
    segment, an optimizer of whole segments, or one no larger than a chunk), their master and
    slots where the forward reads a compute copy, else the slots. Empty without a deferred
    write-back."""
    if writeback is None or shape.frozen:
        return {}
    return {s: shape.update_state_bytes(s) - (0 if copies[s] is not None else
                                              MASTER_B * shape.numels[s])
            for s, p in enumerate(placements)
            if p.state_tier == Tier.DISK and (copies[s] is not None or shape.optim_whole
                                              or shape.numels[s] <= chunk_numel)}


@dataclass
class UpdateSpan:
    """One segment's update in `_update_chain` (seconds from the window's start): its disk
    reads, CPU work and the writes the forward needs, one after another from `start_s`."""

    seg: int
    start_s: float
    read_s: float
    cpu_s: float
    write_s: float

    @property
    def ready_s(self) -> float:
        """When the next forward of the segment may start."""
        return self.start_s + self.read_s + self.cpu_s + self.write_s


def _update_chain(
    shape: ModelShape, hw: HardwareProfile, placements, copies: list[int | None],
    read_ahead: frozenset[int], deferred: dict[int, int], limit: int | None,
    starts: list[float], late: float,
) -> float:
    """How long the first forward waits for the updates: the updates run one after another in
    forward order from `late` on (each its disk reads, CPU work and the writes the forward
    needs: its compute copy, or its fp32 master), the deferred write-backs one after another
    behind them, the update of a `deferred` segment first waiting until fewer than `limit`
    write-backs are pending; segment s's forward starts at `starts[s]` (seconds into the
    window) and waits for its update. The write-back shares the drive in pieces, so the
    update's own requests are taken as running at the drive's full rate (the step's disk total
    bounds both)."""
    cpu_s = 0.0 if shape.frozen else shape.optim_cpu_cost / hw.cpu_adam_params_per_s
    t, stall, written = late, 0.0, []
    for s, p in enumerate(placements):
        if p.state_tier == Tier.DEVICE:
            continue
        read = write = 0
        if p.remote:  # the gradient to the node, its update there, the compute copy back
            node = _node_rates(hw)
            span = UpdateSpan(s, t, GRAD_B * shape.numels[s] / node.net_Bps,
                              shape.numels[s] * shape.optim_cpu_cost / node.cpu_params_per_s,
                              _copy_bytes(shape, copies, s) / node.net_Bps)
            t = span.ready_s
            stall = max(stall, t - starts[s])
            continue
        if p.state_tier == Tier.DISK:
            read, write = shape.update_disk_bytes(s, copies[s], host_grad=p.host_grad,
                                                  read_ahead=s in read_ahead)
            write -= deferred.get(s, 0)
            if s in deferred and limit is not None and len(written) >= limit:
                t = max(t, written[-limit])
        span = UpdateSpan(s, t, read / hw.disk_read_Bps, shape.numels[s] * cpu_s,
                          write / hw.disk_write_Bps)
        t = span.ready_s
        if s in deferred:
            written.append(max(t, written[-1] if written else 0.0)
                           + deferred[s] / hw.disk_write_Bps)
        stall = max(stall, t - starts[s])
    return stall


@dataclass(frozen=True)
class _NodeRates:
    net_Bps: float
    cpu_params_per_s: float


def _node_rates(hw: HardwareProfile) -> _NodeRates:
    """The memory node's link rate and update rate (the host's where it reports none)."""
    node = hw.memory_node
    if node is None:
        raise ValueError("a remote segment in a plan without a memory node")
    return _NodeRates(node.net_Bps, node.cpu_adam_params_per_s or hw.cpu_adam_params_per_s)


def _copy_bytes(shape: ModelShape, copies: list[int | None], s: int) -> int:
    """What a remote segment's update brings back: its compute copy, or its fp32 weights."""
    return MASTER_B * shape.numels[s] if copies[s] is None else copies[s]


def node_times(shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements
               ) -> dict[str, float]:
    """Seconds per step of the remote segments' updates on each memory-node lane: the
    gradients sent (`node_send`), the node's optimizer work (`node_cpu`), the compute copies
    received (`node_recv`). Empty without a memory node."""
    if hw.memory_node is None:
        return {}
    node = _node_rates(hw)
    copies = _compute_copies(shape, train.precision, placements)
    remote = [s for s, p in enumerate(placements) if p.remote]
    return {
        "node_send": sum(GRAD_B * shape.numels[s] for s in remote) / node.net_Bps,
        "node_cpu": sum(shape.numels[s] for s in remote) * shape.optim_cpu_cost
        / node.cpu_params_per_s,
        "node_recv": sum(_copy_bytes(shape, copies, s) for s in remote) / node.net_Bps,
    }


def forward_starts(shape: ModelShape, window: float) -> list[float]:
    """Per segment, when its forward starts in a forward of `window` seconds: at its share of
    the forward's FLOPs before it (the embedding lookup takes none)."""
    fwd = [0] + list(shape.numels[1:-1]) + [shape.numels[-1] + shape.tied_numel]
    return [window * sum(fwd[:s]) / max(1, sum(fwd)) for s in range(len(fwd))]


def _times(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
    keep_resident: KeepGraphs,
    moved: dict[str, int], *, read_ahead: frozenset[int] = frozenset(), groups: int = 1,
    writeback: WriteBack | None = None, chunk_numel: int = STAGING_CHUNK_NUMEL,
) -> dict[str, float]:
    """Seconds per step by resource. `read_ahead`: disk-tier segments whose master and slots the
    last group's backward reads (they count in the sweep's disk, not the update's); `groups`:
    micro-batch groups per step (M for microbatch-outer, 1 for layer-outer): the update of step
    i hides behind the first group's forward of step i+1 (every segment's forward waits for its
    update: `_update_chain`), and the read-ahead runs during the last group's backward;
    `writeback`: the disk-tier master and slots written back behind the step (they must fit the
    step on the one drive, not the window)."""
    tokens = train.tokens_per_step
    block_params = sum(shape.numels[1:-1])
    head_params = shape.numels[-1] + shape.tied_numel
    keep = keeps_graph(placements, keep_resident)
    recomputed = sum(n for n, k in zip(shape.numels[1:-1], keep[1:-1], strict=True) if not k)
    # forward 2 FLOPs/param/token, backward 4; recomputed blocks run their forward twice;
    # attention scores add 2*2*T*D per token per layer forward (causal: half), x3 with backward
    attn = 6 * train.seq_len * train.context_parallel * shape.hidden_size * shape.n_layers
    # a frozen base's weights take no gradient: the backward is 2 FLOPs/param/token; compiled
    # blocks take their measured share of the eager time, counted as eager-rate FLOPs
    block_flops = tokens * ((4 if shape.frozen else 6) * block_params + 2 * recomputed) * (
        compiled_block_factor(train, hw))
    flops = block_flops + tokens * (6 * head_params + attn)
    peak = hw.fp32_compute_flops(tf32=train.tf32) if train.precision == "fp32" else (
        hw.matmul_flops)
    rate = peak * (1.0 if hw.device_is_cpu else MATMUL_EFFICIENCY)
    if hw.device_is_cpu and train.precision == "bf16":
        rate *= 1.5  # measured on the dev CPU: bf16 autocast ~1.5x fp32 (bench/step_time.py)
    compute = flops / rate
    if train.precision == "fp8" and hw.fp8_matmul_flops and not hw.device_is_cpu:
        # the blocks' matmuls (forward, input and weight gradients) run on the fp8 units;
        # attention scores and the head stay bf16
        fp8_rate = hw.fp8_matmul_flops * MATMUL_EFFICIENCY
        compute = block_flops / fp8_rate + (flops - block_flops) / rate
    decode = _decode_s(shape, train, hw, placements, keep_resident)
    compute += decode
    forward = compute * 2 * (block_params + head_params) / (flops / tokens)
    net, net_lane = _net_lane(shape, train, hw, placements, keep_resident, compute,
                              attention_s=tokens * attn / rate)
    sync, sync_exposed = _grad_sync_lane(shape, train, hw, compute, backward_s=compute - forward,
                                         groups=groups, ring_s=net)
    net_lane += sync_exposed
    h2d = moved.get(Link.H2D.value, 0) / (hw.h2d_Bps * COPY_EFFICIENCY)
    d2h = moved.get(Link.D2H.value, 0) / (hw.d2h_Bps * COPY_EFFICIENCY)
    update_read, update_write = _disk_update_bytes(
        shape, _compute_copies(shape, train.precision, placements), placements, read_ahead)
    sweep_disk = (
        (moved.get(Link.DISK_READ.value, 0) - update_read) / hw.disk_read_Bps
        + (moved.get(Link.DISK_WRITE.value, 0) - update_write) / hw.disk_write_Bps
    )
    cpu_params = 0 if shape.frozen else sum(  # a frozen base is never updated
        n for n, p in zip(shape.numels, placements, strict=True)
        if p.state_tier != Tier.DEVICE and not p.remote)  # the node updates remote ones
    update_cpu = cpu_params * shape.optim_cpu_cost / hw.cpu_adam_params_per_s
    update_disk = update_read / hw.disk_read_Bps + update_write / hw.disk_write_Bps
    node = node_times(shape, train, hw, placements)
    # the remote updates run on the same update worker, which waits for each
    update = update_cpu + update_disk + sum(node.values())
    if hw.device_is_cpu:
        # no separate copy engines or GPU: copies and compute share the cores
        sweep = compute + h2d + d2h + sweep_disk + (net_lane - compute)
    else:
        sweep = max(compute, h2d, d2h, sweep_disk, net_lane)
    # the read-ahead starts with the last group's backward; what it has not read by the
    # sweep's end delays the update
    readahead = sum(shape.update_state_bytes(s) for s in read_ahead) / hw.disk_read_Bps
    late = max(0.0, readahead - (compute - forward) / groups)
    # the update of step i runs behind the first group's forward of step i+1, each segment's
    # forward starting at its share of the forward's FLOPs (embed: none); what does not fit
    # stalls it
    window = forward / groups
    starts = forward_starts(shape, window)
    copies = _compute_copies(shape, train.precision, placements)
    deferred = writeback_bytes(shape, placements, copies, writeback, chunk_numel)
    limit = None if writeback is None else writeback.segments
    stall = _update_chain(shape, hw, placements, copies, read_ahead, deferred, limit, starts,
                          late)
    # what the write-back's limit adds to the stall (it waits for the drive)
    ungated = _update_chain(shape, hw, placements, copies, read_ahead, deferred, None, starts,
                            late)
    writeback_s = sum(deferred.values()) / hw.disk_write_Bps
    # one disk serves the sweep, the update and its write-back
    step = max(sweep + stall, sweep_disk + update_disk)
    return {
        "compute": compute,
        "decode": decode,
        "h2d": h2d,
        "d2h": d2h,
        "sweep_disk": sweep_disk,
        "update_disk": update_disk,
        "disk": sweep_disk + update_disk,
        "cpu_update": update_cpu,
        "update": update,
        "writeback": writeback_s,  # part of update_disk, drained behind the step
        "update_ready": update - writeback_s,  # what the forward waits for: CPU, reads, copies
        "writeback_wait": stall - ungated,  # stall added by waiting for the write-back's limit
        "readahead": readahead,
        "update_late": late,  # the update starts this long after the sweep (the read-ahead)
        "net": net,
        "grad_sync": sync,
        "grad_sync_exposed": sync_exposed,
        "net_lane": net_lane,
        "attention": tokens * attn / rate,
        "update_window": window,
        "update_stall": step - sweep,
        "step": step,
        **node,
    }


def ring_kv_bytes(shape: ModelShape, train: TrainShape, placements,
                  keep_resident: KeepGraphs) -> int:
    """What one context-parallel rank sends through the ring per step (the formula of
    tierlm.distributed.context): every block's K/V in the forward, again in the backward with
    dK/dV sent home, and the forward's once more for each block that recomputes (streamed, or
    resident without its graph). K/V travel in the compute precision, dK/dV in fp32."""
    if train.context_parallel == 1:
        return 0

    recomputed = sum(not k for k in keeps_graph(placements, keep_resident)[1:-1])
    kw = dict(cp=train.context_parallel, batch=train.batch_size, local_len=train.seq_len,
              kv_heads=shape.kv_heads or 1, head_dim=shape.head_dim or shape.hidden_size,
              element_bytes=4 if train.precision == "fp32" else 2)
    return train.micro_batches * (ring_send_bytes(**kw, layers=shape.n_layers)
                                  + ring_send_bytes(**kw, layers=recomputed, backward=False))


def _net_lane(shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
              keep_resident: KeepGraphs, compute: float, *,
              attention_s: float) -> tuple[float, float]:
    """(seconds the ring's K/V take to send, the sweep's `net` lane). Each ring step posts the
    next K/V block before computing attention against the current one, so the sends hide
    behind attention only: the lane is the compute with the attention stretched to the sends'
    time where they take longer."""
    net = ring_kv_bytes(shape, train, placements, keep_resident) / hw.net_Bps
    return net, compute + max(0.0, net - attention_s)


def _sync_segments(shape: ModelShape) -> tuple[list, list[int]]:
    """What the gradient sync exchanges: per segment its parameters as (name, numel), and the
    entries of every optimizer state slot; a frozen base's ranks exchange the adapters only."""
    if shape.frozen:
        return [(("adapters", shape.trained_numel),)], []
    segments = shape.param_numels or [(("", n),) for n in shape.numels]
    return list(segments), [n for seg in shape.optim_slot_numels or () for n in seg]


def grad_sync_bytes(shape: ModelShape, train: TrainShape) -> float:
    """What one rank sends per step, on average, to keep its weights equal to the other
    `train.nproc - 1` ranks' (data parallel x context parallel): the sync strategy's own count
    (tierlm.distributed.sync: the bytes `Comm` records in the ledger as net_send)."""
    if train.nproc == 1:
        return 0.0

    segments, slots = _sync_segments(shape)
    return (train.grad_sync or DenseSync()).send_bytes(segments, train.nproc, slots)


def _grad_sync_lane(shape: ModelShape, train: TrainShape, hw: HardwareProfile, compute: float,
                    *, backward_s: float, groups: int, ring_s: float) -> tuple[float, float]:
    """(seconds the gradient sync's sends take per step, the part of them the step waits for).
    Dense and top-k start a segment's exchange as soon as its gradient is complete, during the
    last micro-batch group's backward: they hide behind that backward, sharing the link with
    the ring's K/V of that time (the ring's sends spread over the sweep as the compute is),
    except the exchange of the segment whose gradient completes last (the embedding's), which
    the update waits for. Delayed sync averages after the step: all of it is waited for."""
    sync_s = grad_sync_bytes(shape, train) / hw.net_Bps
    if not sync_s:
        return 0.0, 0.0

    sync = train.grad_sync or DenseSync()
    if not sync.overlaps_backward:
        return sync_s, sync_s
    last_s = sync.send_bytes(_sync_segments(shape)[0][:1], train.nproc) / hw.net_Bps
    window = backward_s / groups
    free = max(0.0, window - ring_s * window / compute)
    return sync_s, last_s + max(0.0, sync_s - last_s - free)


def compiled_block_factor(train: TrainShape, hw: HardwareProfile) -> float:
    """The blocks' compute time under `train`'s compile choice over the eager time: the
    compiled block's measured ratio (`tierlm probe --compile segments`) when the run compiles
    and the profile holds one, else 1.0."""
    if train.compiled and hw.compiled_block_time_ratio is not None:
        return hw.compiled_block_time_ratio
    return 1.0


def compiled_block_source(train: TrainShape, hw: HardwareProfile) -> str | None:
    """Where `compiled_block_factor` came from, for the plan's output (None: compile off)."""
    if not train.compiled:
        return None
    factor = compiled_block_factor(train, hw)
    if hw.compiled_block_time_ratio is None:
        return (f"compile: segments; blocks' compute x{factor:.2f} (not probed: run `tierlm "
                "probe --compile segments` on the training machine and plan with --hardware "
                "auto)")
    return (f"compile: segments; blocks' compute x{factor:.2f} of eager (probed: "
            f"{hw.compiled_block_probe or 'tierlm probe --compile segments'})")


def _decode_s(shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
              keep_resident: KeepGraphs) -> float:
    """Seconds per step a QLoRA base spends decoding NF4 weights on the device (part of its
    compute): each matmul decodes its weight (tierlm.precision.nf4.NF4Linear) in every micro-batch's
    forward and backward, and once more where the segment recomputes its forward; a memory-bound
    pass at `decode_traffic_bytes` per weight over the device's memory bandwidth."""
    if not shape.base_nf4_numels:
        return 0.0

    dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32
    decodes = sum(n * (2 + (not k)) for n, k in zip(
        shape.base_nf4_numels, keeps_graph(placements, keep_resident), strict=True))
    rate = hw.device_memory_Bps * (1.0 if hw.device_is_cpu else COPY_EFFICIENCY)
    return train.micro_batches * decode_traffic_bytes(decodes, dtype) / rate


def _bottleneck(t: dict[str, float]) -> str:
    """The resource whose time sets the step: the sweep's longest lane, plus the share of the
    update stall each of the update's parts causes."""
    stall = t["update_stall"] - t["writeback_wait"]  # the rest waits for the drive
    ready = t["update_ready"]  # the CPU work and the disk work the forward waits for
    share = stall / ready if ready > 0 else 0.0
    node = sum(t.get(k, 0.0) for k in ("node_send", "node_cpu", "node_recv"))
    ready_disk = ready - t["cpu_update"] - node
    # the net lane includes the compute: named where the sends outlast what hides them, after
    # whichever of its two parts adds more
    net = t["net_lane"] if t["net_lane"] > t["compute"] else 0.0
    ring_over = t["net_lane"] - t["compute"] - t["grad_sync_exposed"]
    parts = {
        "compute": t["compute"],
        "PCIe (H2D/D2H)": max(t["h2d"], t["d2h"]),
        "interconnect (ring K/V)": net if ring_over >= t["grad_sync_exposed"] else 0.0,
        "interconnect (gradient all-reduce)": net if ring_over < t["grad_sync_exposed"] else 0.0,
        "disk": max(t["sweep_disk"] + share * ready_disk + t["writeback_wait"],
                    t["disk"] if t["disk"] >= t["step"] else 0.0),
        "CPU optimizer update": share * t["cpu_update"],
        "memory node (network and its update)": share * node,
    }
    return max(parts, key=parts.get)  # type: ignore[arg-type]
