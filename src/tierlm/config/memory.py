"""Sections `activations` and `memory`: activation memory per segment, and where model state
lives (the tiered runtime's placement, budgets and hardware profile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ActivationConfig:
    policy: Literal["none", "full", "selective", "offload", "dynamic"] = "none"
    """Activation memory per segment: none keeps every activation (a segment streamed by the
    tiered runtime keeps its graph where the device budget holds it, last blocks first, else
    takes dynamic_fallback; under --offload-policy auto, where the plan found room); full
    recomputes each segment from its input in the backward;
    selective keeps matmul and attention outputs and recomputes norms and elementwise ops;
    offload moves saved tensors to host RAM until the backward; dynamic keeps what fits
    --device-budget, last blocks first (--grad-checkpointing)."""
    overrides: str | None = None
    """Per-segment policies as comma-separated pattern=policy pairs, the pattern a regex over
    segment names (embed, block.N), e.g. 'block.[0-3]=full,block.1[01]=keep'; the last match
    wins; policies: keep, selective, full, offload."""
    dynamic_fallback: Literal["full", "offload"] = "full"
    """What dynamic, and none for streamed segments, do with segments whose activations do not
    fit: recompute them (full) or hold them in host RAM (offload)."""


@dataclass(kw_only=True)
class MemoryConfig:
    offload_policy: Literal["none", "auto", "tiered", "host", "disk", "remote"] = "none"
    """Where model state lives: none keeps everything on the device (the plain reference
    trainer); host keeps master weights, gradients and AdamW state in RAM and streams weights to
    the device; disk keeps them in files under offload_dir; tiered fills the device, then RAM,
    then disk within the budgets; remote keeps every segment's master and optimizer state on
    the memory node (--memory-node) but the --resident ones (--offload-policy)."""
    microbatch_order: Literal["microbatch-outer", "layer-outer"] = "microbatch-outer"
    """Tiered runtime: microbatch-outer streams all weights for every micro-batch; layer-outer
    runs each segment for all micro-batches while its weights are on the device
    (--microbatch-order)."""
    boundary_activations: Literal["device", "host"] = "device"
    """Tiered runtime: where each segment's boundary input waits between its forward and its
    backward: on the device, or in host RAM (one copy out as it is produced, one back for the
    backward), so layer-outer holds one segment's micro-batches on the device, not every
    segment's; host needs --grad-checkpointing full, or dynamic, which parks the inputs of the
    segments it recomputes (--boundary-activations; auto decides)."""
    speculative_update: Literal["auto", "on", "off"] = "auto"
    """Tiered runtime: start each disk-tier segment's update as soon as its gradient is
    complete, with the clipping coefficient taken as 1, writing its new state beside the old
    (a second set of its files on disk), and keep it once the global norm says the coefficient
    is 1 (else it is redone as usual); exact either way. auto: where the planner finds it
    faster and the disk budget holds the second set (--offload-policy auto; off otherwise); on:
    every disk-tier segment (--speculative-update)."""
    resident: str | None = None
    """Regex of segment names (embed, block.N, head) whose weights stay on the device, e.g.
    'embed|head|block.3[01]' (--resident)."""
    device_budget: str | None = None
    """Device memory the runtime may use for model state and boundary activations, e.g. 8GiB;
    empty: no limit (--device-budget)."""
    host_budget: str | None = None
    """Host RAM the runtime may use for model state and staging, e.g. 48GiB; empty: 0.7 x the
    RAM available at start (container limits included) (--host-budget)."""
    offload_dir: str | None = None
    """Directory for the disk tier's files; empty: RUN_DIR/offload; a relative path is inside
    the run directory, an absolute one is used as given (--offload-dir)."""
    hardware: str = "auto"
    """Hardware profile for the planner: auto (detect this machine), or one of rtx3090,
    rtx4090, rtx4060ti-16g, rtx5090, a100-40g, a100-80g, h100-80g, h200, cpu (--hardware)."""
    gpu_memory: str | None = None
    """GPU memory size overriding the profile's, e.g. 24GiB; a CUDA run also caps its own
    allocations there (set_per_process_memory_fraction), so a larger card models this one
    (--gpu-memory)."""
    host_memory: str | None = None
    """Host RAM size overriding the profile's, e.g. 64GiB (--host-memory)."""
    disk_budget: str | None = None
    """Disk space the disk tier may use, e.g. 200GiB; empty: the profile's, or the free space
    at the offload directory when detected (--disk-budget)."""
    disk_endurance_tbw: float = 600.0
    """Rated endurance of the disk under offload_dir in TB written (TBW, from the drive's
    datasheet; 600 is a 1 TB consumer NVMe's). The plan and every run with disk-tier state report
    the share of it a day of training writes, and warn above 1% a day
    (--disk-endurance-tbw)."""
    memory_node: str | None = None
    """A memory node's ADDRESS:PORT (its `tierlm memory-node --listen`): another machine's RAM
    holds the master and optimizer state of the segments placed there, and its cores run their
    update; empty: no node (--memory-node)."""
    memory_node_token_file: str | None = None
    """File with the secret shared with the memory node (its --token-file); readable by its
    owner only (--memory-node-token-file)."""
    memory_node_transport: Literal["socket", "gloo"] = "socket"
    """How tensors cross to the memory node: a TCP socket, or gloo point-to-point over TCP
    (--memory-node-transport)."""
    memory_node_timeout: float = 120.0
    """Seconds the trainer waits for the memory node to answer before it stops with an error
    naming the node and the last checkpoint (--memory-node-timeout)."""
    remote: str | None = None
    """Regex of segment names (embed, block.N, head) whose master and optimizer state live on
    the memory node, e.g. 'block.[0-9]', beside the offload policy's tiers (host, tiered,
    disk); empty: the offload policy decides (--remote)."""
    memory_node_memory: str | None = None
    """RAM of the memory node the plan may fill, e.g. 128GiB: with --memory-node, at most what
    the node offers; without, `tierlm plan` plans a node that is not there yet
    (--memory-node-memory)."""
    net_bandwidth: str | None = None
    """Link rate to the memory node for the plan, e.g. 25Gbit or 3GB/s; empty: measured at the
    node's handshake, or `tierlm probe --memory-node` (--net-bandwidth)."""

