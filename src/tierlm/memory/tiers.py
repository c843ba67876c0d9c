"""Names for where bytes live, what they are, and which link moves them."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    DEVICE = "device"  # the GPU; on a CPU-only machine the CPU itself, accounted separately
    HOST = "host"  # RAM (pinned where CUDA exists)
    DISK = "disk"  # files under the offload directory
    REMOTE = "remote"  # a memory node's RAM (tierlm.node): master and optimizer state only


class TensorClass(StrEnum):
    COMPUTE = "compute"  # weights the matmuls read
    MASTER = "master"  # fp32 weights the optimizer updates
    GRAD = "grad"
    OPTIM = "optim_state"
    ACTIVATION = "activation"  # boundary activations between segments
    STAGING = "staging"  # host buffers that disk reads and writes pass through


class Link(StrEnum):
    H2D = "h2d"
    D2H = "d2h"
    DISK_READ = "disk_read"
    DISK_WRITE = "disk_write"
    NET_SEND = "net_send"  # bytes this rank sends to other ranks (tierlm.distributed)
    NET_RECV = "net_recv"  # bytes this rank receives from other ranks
