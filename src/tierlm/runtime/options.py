"""What a tiered run asks for: `EngineOptions`, which `plan_step` (tierlm.runtime.plan) turns into
the engine's StepPlan, and whose other fields the engine reads through the plan's `options`.
Below the plan and the pinned-bytes rule, which both read it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierlm.activations.chunked_loss import sum_cross_entropy
from tierlm.config import ActivationConfig
from tierlm.memory.placement import (
    STAGING_CHUNK_NUMEL,
    KeepGraphs,
    PlacementReport,
    SegmentPlacement,
)
from tierlm.memory.tiers import Tier
from tierlm.node.client import NodeClient
from tierlm.runtime.grad_sync import NO_SYNC, GradSync
from tierlm.runtime.placement import PlacementPolicy
from tierlm.runtime.readahead import ReadAhead
from tierlm.runtime.sequence_share import WHOLE_SEQUENCE, SequenceShare
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, WriteBack
from tierlm.trace import NO_TRACER, NoTracer, Tracer


@dataclass(kw_only=True)
class EngineOptions:
    """What a tiered run asks for. `plan_step` reads the fields that choose (policy, resident,
    the budgets, placements, activations, keep_resident_activations, check_placement) and
    turns them into a StepPlan; the engine reads only the others, through the plan's
    `options`."""

    policy: PlacementPolicy | str = "none"
    """The placement policy (tierlm.runtime.placement: AllDevice, HostState, DiskState, Tiered,
    or the planner's tierlm.plan.policy.Auto), or its --offload-policy name."""
    microbatch_order: str = "microbatch-outer"
    """microbatch-outer or layer-outer."""
    resident: str | None = None
    """Regex of segment names whose compute weights stay on the device."""
    remote: str | None = None
    """Regex of segment names whose master and optimizer state live on the memory node
    (--remote): their placements become remote host-tier state (`place`); needs `node`."""
    node: NodeClient | None = None
    """The memory node's connected session (tierlm.node.client), which holds the master and
    optimizer state of remote segments and runs their updates; None: no node (a remote
    placement is then refused)."""
    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    disk_budget_bytes: int | None = None
    """What the disk tier may hold (--disk-budget); None: no limit beyond the free space."""
    activation_budget_bytes: int | None = None
    """Device bytes `dynamic` may spend on activations beyond what the ledger holds (a plan's
    device budget less its ledger peak); None: the device budget less the placement."""
    offload_dir: str | None = None
    placements: list[SegmentPlacement] | None = None
    """A placement per segment chosen by the planner; None: derive it from `policy`."""
    grad_clip: float = 1.0
    """Global-norm clipping bound; 0 disables it."""
    loss_chunk_tokens: int | None = None
    """Tokens per cross-entropy chunk at the head; None: ~16M logits per chunk."""
    chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = sum_cross_entropy
    """(logits, targets) -> a chunk's summed loss at the head: the compiled one under
    --compile segments (tierlm.runtime.compile); the blocks compile in the model itself."""
    batch_size: int = 1
    seq_len: int = 1
    micro_batches: int = 1
    """Shape of the step, for the activation reserve in the placement."""
    activations: ActivationConfig | None = None
    """Activation policy per segment (tierlm.activations); None: the planner's choice in
    keep_resident_activations (True: resident segments keep their graph, streamed ones
    recompute; False: every segment recomputes; a flag per segment: those that keep)."""
    keep_resident_activations: KeepGraphs = True
    offload_graphs: tuple[bool, ...] = ()
    """With the planner's choice (`activations` None): per segment, those whose saved tensors
    wait in host RAM from the forward to the backward (the `offload` policy) instead of being
    recomputed; () or False: as `keep_resident_activations` says (tierlm.plan.search)."""
    boundary_tier: Tier = Tier.DEVICE
    """Where a segment's boundary input waits between its forward and its backward: on the
    device, or in host RAM (copied there as it is produced, dropped from the device once the
    segment's forward has read it, brought back for its backward). On host, layer-outer holds
    two segments' micro-batches on the device instead of every segment's. Needs the `full`
    activation policy, or `dynamic`, which parks the inputs of the segments it recomputes: a
    kept graph pins its input on the device."""
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    check_placement: Callable[[PlacementReport], None] = lambda report: None
    """Called with the placement before anything is allocated or written (the trainer's
    free-space and host-memory checks refuse an impossible run here)."""
    grad_sync: GradSync = NO_SYNC
    """Data parallelism (tierlm.runtime.grad_sync; the strategies: tierlm.distributed.sync):
    started on each segment's complete gradient, overlapping the rest of the backward, and
    waited for before the norm is taken."""
    sequence_share: SequenceShare = WHOLE_SEQUENCE
    """The tokens of each row this rank trains on (context parallel: its zig-zag share, and the
    ring its attention runs over: tierlm.distributed.context.ZigzagShare)."""
    tracer: Tracer | NoTracer = NO_TRACER
    """The step timeline (tierlm.trace): actions, waits, copies, disk requests and
    updates, recorded while the trainer arms it for --monitor.trace_step."""
    staging_chunk_numel: int = STAGING_CHUNK_NUMEL
    """fp32 elements per chunk in which disk-tier state crosses host staging (a multiple of
    1024, so chunk offsets suit O_DIRECT)."""
    base_format: str = "fp32"
    """How a frozen base (--finetune lora/qlora) is held, moved and read: fp32 (its master),
    bf16 (--finetune lora under bf16: its compute copy alone), or nf4 (--finetune qlora:
    each base layer decodes its weight on the device per matmul); tierlm.runtime.frozen."""
    readahead: ReadAhead | None = None
    """Read disk-tier segments' master and slots into host staging during the backward, so the
    update finds them in RAM (tierlm.runtime.readahead; the planner sets it); None: off."""
    writeback: WriteBack | None = DEFAULT_WRITEBACK
    """Write a disk-tier segment's master and slots back behind the step, its update ending
    once its compute copy (or, computing from fp32, its master) is on disk; at most
    `segments` write-backs pending (tierlm.runtime.writeback; the planner sets it). None: the
    update writes everything back before it ends."""
    speculative_updates: bool = False
    """Issue each disk-tier segment's update as its gradient's final landing of the step is
    done, with the clipping coefficient taken as 1, writing its master, slots and compute copy
    to a second set of files; once the global norm is read it is kept where the coefficient is
    exactly 1, else dropped and the update run as without the option (a skipped step drops it).
    Exact either way; disk holds one more set of those files per disk-tier segment."""
    held_gradients: int = 1
    """Speculative updates: the most complete gradients kept in host RAM for them at once. The
    final landing into a gradient file also leaves the whole gradient in host staging, which
    its speculation takes instead of reading the file back and frees; a landing waits for the
    speculation this many before it to end first (tierlm.runtime.schedule.held_before). One
    takes no more RAM than the update reading the file did; the planner sets more where host
    RAM has room (a backward that outruns the update worker then waits less)."""
