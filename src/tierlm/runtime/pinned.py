"""How much host RAM a run pins: the size of its pinned arena (tierlm.memory.arena).

Pinned are the host buffers PCIe copies read or write: the copy a streamed host-tier segment
crosses from (`runtime.state.pinned_class`), disk loads' staging, a gradient file pass's chunks,
the landing ring, parked boundary inputs and the saved tensors the offload activation policy
keeps on the host (their sizes measured once, `offload_sizes`).
How many of them a step holds at once is a matter of the step's order (a load in flight while a
gradient lands and inputs wait on the host), which
the planner's replay (tierlm.runtime.byte_replay._simulate) already walks with the engine's own walk
and rules. So the arena is sized by that replay, run on a shape made from the engine's own
parts (its flat layouts, its compute copies' exact bytes, its parked inputs): one byte model for
the plan's pinned peak, the placement report preflight checks, and the arena the engine
allocates. The replay cuts its pinned buffers from an arena of offsets with the engine's
allocator in the engine's order (tierlm.memory.arena.ArenaReplay), so the size includes what that
order leaves unusable between buffers: the persistent region is what it pins before the step,
the step's region what the step's buffers reach.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierlm.activations.dynamic import probe_inputs
from tierlm.activations.offload import offloaded_sizes
from tierlm.activations.rerun import recording_paused
from tierlm.activations.saved import storages_of
from tierlm.memory.arena import ArenaReplay, PinnedBytes
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.precision.streaming import ComputeCopies, ComputeFormat, slot_kinds
from tierlm.runtime.byte_replay import _simulate
from tierlm.runtime.options import EngineOptions
from tierlm.runtime.parts import StepParts
from tierlm.runtime.shapes import ModelShape, TrainShape


def step_pinned_bytes(
    parts: StepParts, placements: list[SegmentPlacement], options: EngineOptions, *,
    micro_batches: int, batch_size: int, seq_len: int, parked: frozenset[int] | None = None,
    offloaded: Sequence[Sequence[int]] = (),
) -> PinnedBytes:
    """The pinned bytes (arena footprints) of the engine built from `parts` under `placements`
    and `options`, for a step of `micro_batches` x `batch_size` x `seq_len` tokens: persistent,
    and the step's peak beside them. `parked`: the segments whose boundary input waits on the
    host (Engine.parked_inputs; None: every segment but the first when boundaries go to the
    host, the most any activation policy parks). `offloaded`: per segment but the head, the host
    buffers (bytes, in order) the offload policy cuts from the arena for each micro-batch (()
    where the segment does not offload; `offload_sizes`)."""
    segs = parts.adapter.segments
    layouts = parts.layouts
    optimizer = parts.optimizer
    frozen = parts.frozen_base
    copies = [parts.compute_copies.copy_nbytes(lay) for lay in layouts]
    borrowed = getattr(segs[-1], "borrowed", {})
    trained = [lay for lay in parts.trained_layouts if lay.numel] if frozen else []
    shape = ModelShape(
        names=[s.name for s in segs],
        numels=[lay.numel for lay in layouts],
        tied_numel=sum(slot.numel for slot in layouts[0].slots if slot.name in borrowed),
        hidden_size=parts.hidden_size,
        vocab_size=parts.vocab_size,
        n_layers=len(segs) - 2,
        block_saved_bytes_per_token=0.0,  # workspace on the device: nothing pinned
        head_chunk_tokens=parts.chunk_tokens,
        optim_state_bytes=[0 if frozen else optimizer.state_nbytes(lay) for lay in layouts],
        optim_whole=optimizer.align == 0,
        frozen=frozen,
        trained_numel=sum(lay.numel for lay in trained),
        trained_optim_bytes=sum(optimizer.state_nbytes(lay) for lay in trained),
        base_bytes=copies if parts.frozen_copy else None,
        copy_bytes=None if parts.frozen_copy else copies,
    )
    if parked is None and parts.host_boundaries:
        parked = frozenset(range(1, len(segs) - 1))
    train = TrainShape(batch_size, seq_len, micro_batches)
    arena = ArenaReplay()
    _simulate(shape, train, placements, options.microbatch_order,
              keep_resident=options.keep_resident_activations,
              boundary_host=parts.host_boundaries, chunk_numel=options.staging_chunk_numel,
              readahead=options.readahead, parked=parked if parked is not None else frozenset(),
              arena=arena, offloaded=offloaded)
    return arena.pinned_bytes()



def offload_sizes(
    parts: StepParts, placements: list[SegmentPlacement], offloaded: Sequence[bool],
    weights: Callable[[Any], Mapping[str, torch.Tensor]], options: EngineOptions, *,
    device: torch.device,
) -> tuple[tuple[int, ...], ...]:
    """Per segment but the head, the host buffers (bytes, in order) the `offload` policy takes
    for one micro-batch of the step's shape: `embed` and one block run forward once on the
    device on `weights` (runtime.state.InitialWeights), in the format the engine computes them
    in (a segment whose state is off the device runs from its compute copy, whose weights the
    graph saves as views, not as autocast's casts); every block takes the first block's sizes
    in the same format. () for the segments not `offloaded`."""
    segs = parts.adapter.segments
    cfg = parts.compute_copies
    ids, h, ctx = probe_inputs(parts.adapter.context, device=device,
                               batch_size=options.batch_size, seq_len=options.seq_len,
                               hidden_size=parts.hidden_size, vocab_size=parts.vocab_size)
    measured: dict[tuple[int, bool], tuple[int, ...]] = {}
    out = []
    with recording_paused():  # random inputs: fp8 layers cast them without moving their scales
        for s, off in enumerate(offloaded):
            if not off:
                out.append(())
                continue
            i, layout = min(s, 1), parts.layouts[s]
            fmt = (ComputeFormat(layout, slot_kinds(cfg.model, layout))
                   if placements[s].state_tier != Tier.DEVICE and isinstance(cfg, ComputeCopies)
                   and cfg.copy_nbytes(layout) is not None else None)
            key = (i, fmt is not None)
            if key not in measured:
                seg, layout = segs[i], parts.layouts[i]
                master = layout.pack(weights(seg), torch.empty(layout.numel))
                if fmt is None:
                    flat, views = master.to(device), layout.views
                else:  # the engine's device copy: the encoded compute copy (Engine._weights)
                    fmt = ComputeFormat(layout, slot_kinds(cfg.model, layout))
                    wire = torch.empty(fmt.nbytes, dtype=torch.uint8)
                    fmt.encode(master, wire)
                    flat, views = fmt.flat(wire.to(device)), fmt.views

                def run(w: torch.Tensor, x: torch.Tensor, seg=seg, views=views) -> torch.Tensor:
                    with options.autocast():
                        return seg.forward(views(w), x, ctx)

                x = ids if i == 0 else h
                measured[key] = offloaded_sizes(run, flat, x, storages_of(x, ctx))
            out.append(measured[key])
    return tuple(out)
