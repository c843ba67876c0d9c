"""Each segment's state put in place at the engine's setup (Engine.__init__): packed from its
starting weights straight into the tier its placement names, segment by segment, and the
model's parameters emptied once their segment is in place (the engine supplies views of its flat
buffers on every call)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tierlm.activations.saved import FrozenWeights
from tierlm.config import NotSupportedYet, OptimConfig
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.store import Store
from tierlm.memory.tiers import Tier
from tierlm.node.client import NodeClient
from tierlm.node.protocol import SegmentSpec
from tierlm.precision.streaming import slot_kinds
from tierlm.runtime.parts import StepParts
from tierlm.runtime.state import (
    InitialWeights,
    LookupOnce,
    SegmentState,
    init_remote_state,
    init_state,
)


def _empty_parameter(p: torch.nn.Parameter) -> None:
    """Drop `p`'s storage, keeping the Parameter object (ties, modules' references). A meta
    parameter (a skeleton's) moves to the CPU as it empties, so export can later fill it like
    any other (`.data` cannot change a tensor's device; swapping the tensors can)."""
    if p.is_meta:
        torch.utils.swap_tensors(
            p, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=p.requires_grad)
        )
    else:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def place_segments(
    store: Store, parts: StepParts, placements: list[SegmentPlacement],
    initial_weights: InitialWeights, *, device: torch.device,
    update_ranges: Callable[[SegmentState], list[tuple[int, int]]],
    node: NodeClient | None = None, optim: OptimConfig | None = None,
) -> tuple[list[SegmentState], list[SegmentState | None], list[FrozenWeights | None]]:
    """Per segment: its state under its placement; the state the optimizer updates (the
    segment's own, or its adapters on the device; None: nothing of it is trained); and its
    frozen weights' current copy (None without a frozen base). `update_ranges`: the chunks in
    which a disk segment's state is written (Engine._update_ranges). Remote segments' state
    goes to the memory node `node`, configured first with all of them and the run's
    optimizer `optim` (`configure_node`)."""
    frozen_base, optimizer, copies = parts.frozen_base, parts.optimizer, parts.compute_copies
    if any(p.remote for p in placements):
        configure_node(parts, placements, node, optim)
    place_state = copies.init_state if parts.frozen_copy else init_state
    states: list[SegmentState] = []
    trained_states: list[SegmentState | None] = []
    frozen: list[FrozenWeights | None] = []
    trained_layouts = parts.trained_layouts
    for i, (seg, lay, plc) in enumerate(
        zip(parts.adapter.segments, parts.layouts, placements, strict=True)
    ):
        st = SegmentState(index=i, seg=seg, layout=lay, placement=plc,
                          slots=() if frozen_base else optimizer.slots, frozen=frozen_base)
        optim_device = device if plc.state_tier == Tier.DEVICE else torch.device("cpu")
        copies.choose_format(st)
        # packed straight into the segment's tier (or the disk tier's staging), tensor by
        # tensor from the source, before the next segment is read
        source = LookupOnce(initial_weights(seg))
        if plc.remote:  # the master to the node, its compute copy back (init_remote_state)
            init_remote_state(store, st, functools.partial(lay.pack, source), node)
        else:
            place_state(store, st, functools.partial(lay.pack, source), optim_device,
                        update_ranges(st))
            copies.attach(store, st)
        trained: SegmentState | None = None if frozen_base else st
        if frozen_base and trained_layouts[i].numel:
            trained = SegmentState(
                index=i, seg=seg, layout=trained_layouts[i],
                placement=SegmentPlacement(True, Tier.DEVICE), slots=optimizer.slots)
            init_state(store, trained, functools.partial(trained_layouts[i].pack, source),
                       device, [])
        del source  # it holds the tensor packed last: gone before the next segment is read
        trained_states.append(trained)
        frozen.append(FrozenWeights() if frozen_base else None)
        # Modules never own live storage: drop the parameters' memory, the runtime supplies
        # views of its flat buffers on every call.
        for _, p, _ in seg.params:
            _empty_parameter(p)
        states.append(st)
    return states, trained_states, frozen


def remote_kinds(parts: StepParts, layout) -> list[str] | None:
    """The per-parameter compute dtypes a remote segment's copy has (`ComputeCopies`' rule:
    None where every weight computes in fp32 and the master itself streams)."""
    copies = parts.compute_copies
    kinds = slot_kinds(copies.model, layout) if copies.enabled else None
    return None if kinds is None or all(k == "fp32" for k in kinds) else kinds


def configure_node(parts: StepParts, placements: list[SegmentPlacement],
                   node: NodeClient | None, optim: OptimConfig | None) -> None:
    """Give the memory node every remote segment (its flat layout and compute format) and the
    run's optimizer, before any state is placed: the node refuses a session that does not fit
    its --memory here, before the trainer has filled anything. The node builds the same flat
    optimizer from `optim` (tierlm.optim.build) as the host tier, so any of them runs there."""
    if node is None or optim is None:
        raise ValueError("remote placements need a connected memory node (--memory-node) and "
                         "the run's optimizer")
    if parts.frozen_base:
        raise NotSupportedYet("a memory node with --finetune lora/qlora",
                              "the node holds trained state; a frozen base stays local")
    specs = [SegmentSpec.of(seg.name, lay, remote_kinds(parts, lay))
             for seg, lay, p in zip(parts.adapter.segments, parts.layouts, placements,
                                    strict=True) if p.remote]
    node.configure(specs, optim)
