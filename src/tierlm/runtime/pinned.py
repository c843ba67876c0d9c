"""How much host RAM a run pins: the size of its pinned arena (tierlm.memory.arena).

Pinned are the host buffers PCIe copies read or write: the copy a streamed host-tier segment
crosses from (`runtime.state.pinned_class`), disk loads' staging, a gradient file pass's chunks,
the landing ring, parked boundary inputs and the saved tensors the offload activation policy
keeps on the host (their sizes measured once, tierlm.activations.dynamic.probe_offload_bytes).
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

from collections.abc import Sequence

from tierlm.memory.arena import ArenaReplay, PinnedBytes
from tierlm.memory.placement import SegmentPlacement
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
    where the segment does not offload; tierlm.activations.dynamic.probe_offload_bytes)."""
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

