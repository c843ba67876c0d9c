"""Hardware profiles: memory sizes and the rates the planner's time model needs.

A profile is detected (torch.cuda, psutil, the offload directory's free space, and the numbers
`tierlm probe` measured on this machine), named (`--hardware rtx4090`), or given piece by piece
(`--gpu-memory 24GiB --host-memory 64GiB --disk-budget 200GiB`). Nominal numbers are datasheet
peaks; the planner applies its own efficiency factors (see planner.py), and `tierlm probe`
replaces them with measurements where it can.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierlm.config import Config, ConfigError, NotSupportedYet, uses_tiered_runtime
from tierlm.config.run import PLAIN_DEVICES
from tierlm.paths import cache_dir

GiB = 2**30
GB = 10**9
T = 10**12


@dataclass(frozen=True, kw_only=True)
class MemoryNodeProfile:
    """A memory node as the planner sees it (tierlm.node: another machine's RAM holds the
    master and optimizer state of the segments placed there, its cores update them)."""

    memory_bytes: int  # the node's RAM the plan may fill (--memory-node-memory, or its hello)
    net_Bps: float  # payload bytes per second each way on the link (full duplex)
    # the node's AdamW-equivalent update rate; None: the host's (`cpu_adam_params_per_s`)
    cpu_adam_params_per_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    gpu_memory_bytes: int  # device tier capacity (on "cpu": RAM set aside as the device tier)
    host_memory_bytes: int
    disk_budget_bytes: int
    h2d_Bps: float  # host -> device copy rate (pinned memory)
    d2h_Bps: float
    disk_read_Bps: float  # NVMe sequential read with O_DIRECT
    disk_write_Bps: float
    host_copy_Bps: float  # RAM memcpy (read + write)
    matmul_flops: float  # dense matmul rate in the compute precision (bf16 on GPUs)
    fp8_matmul_flops: float | None  # None: no fp8 units
    cpu_adam_params_per_s: float  # fused AdamW over fp32 state on the CPU
    # device memory bandwidth, bytes read + written per second (datasheet peak on GPUs; on
    # "cpu", `tierlm probe` measures it as the NF4 decode sees it): what QLoRA's per-matmul
    # NF4 decode is bound by
    device_memory_Bps: float
    device_is_cpu: bool = False
    # device -> device rate per direction (the context-parallel ring's K/V); None: no direct
    # path (GeForce cards: no NVLink, no P2P), so messages go through host memory (`net_Bps`)
    interconnect_Bps: float | None = None
    # --compile segments: a compiled block's forward+backward time over the eager one's, and
    # what was measured (`tierlm probe --compile segments`); None: not measured
    compiled_block_time_ratio: float | None = None
    compiled_block_probe: str | None = None
    # IEEE fp32 matmul rate on the CUDA cores (datasheet, or `tierlm probe` on a GPU with TF32
    # off): torch computes fp32 matmuls this way unless TF32 is enabled (--tf32). None: unknown
    # (a CPU profile, where matmul_flops is already the fp32 rate)
    fp32_matmul_flops: float | None = None
    # a memory node beside this machine (None: none); the plan fills it in from the run's
    # flags or the node's handshake (tierlm.plan.inputs.hardware_for)
    memory_node: MemoryNodeProfile | None = None

    def fp32_compute_flops(self, *, tf32: bool) -> float:
        """Peak rate of the fp32 matmuls a run computes: TF32 tensor cores (half the bf16
        rate) where --tf32 enabled them, else the IEEE fp32 rate. A GPU profile that does not
        know its IEEE rate is planned as TF32, the optimistic bound, as before."""
        if self.device_is_cpu:
            return self.matmul_flops
        if tf32 or self.fp32_matmul_flops is None:
            return self.matmul_flops / 2
        return self.fp32_matmul_flops

    def with_overrides(self, **kw) -> HardwareProfile:
        return dataclasses.replace(self, **{k: v for k, v in kw.items() if v is not None})

    @property
    def net_Bps(self) -> float:
        """What one rank sends to the next per second. Without a direct path NCCL stages each
        message through pinned host memory (its SHM transport): a D2H copy, then an H2D one on
        the receiving card, while every card of the ring sends and receives at once and the
        step's own weight streaming shares those links, so half the host link's rate. NVIDIA
        leaves P2P off on GeForce boards such as the RTX 4090 (see the "RTX 4090 P2P unlocked"
        write-ups, blog.chlc.cc and allanchan339.github.io, which patch the driver to get it):
        ~12 GB/s over PCIe 4.0 x16."""
        if self.interconnect_Bps is not None:
            return self.interconnect_Bps
        return min(self.h2d_Bps, self.d2h_Bps) / 2


# Defaults for the host side of a desktop: a PCIe 4.0 NVMe SSD (Samsung 990 Pro datasheet:
# 7.45 GB/s sequential read, 6.9 GB/s write; we assume ~75% of that sustained with O_DIRECT),
# dual-channel DDR5 (~60 GB/s read, a memcpy moves ~25-30 GB/s), and fused CPU AdamW at
# ~2 G params/s on 8-16 cores (PLATFORM_NOTES.md measured 1.6 G/s on 2 cores; AdamW is memory
# bound, so it scales with bandwidth, not cores).
_DESKTOP = dict(
    host_memory_bytes=64 * GiB,
    disk_budget_bytes=500 * GiB,
    disk_read_Bps=5.5 * GB,
    disk_write_Bps=5.0 * GB,
    host_copy_Bps=28 * GB,
    cpu_adam_params_per_s=2.0e9,
)
# Practical pinned-memory copy rates: PCIe 4.0 x16 ~25 GB/s, PCIe 5.0 x16 ~50 GB/s, x8 half
# (measured bandwidthTest numbers are ~80% of the 31.5 / 63 GB/s link rates).
_PCIE4_X16 = dict(h2d_Bps=25 * GB, d2h_Bps=25 * GB)
_PCIE4_X8 = dict(h2d_Bps=12.5 * GB, d2h_Bps=12.5 * GB)
_PCIE5_X16 = dict(h2d_Bps=50 * GB, d2h_Bps=50 * GB)

PROFILES: dict[str, HardwareProfile] = {
    # GeForce RTX 3090: 24 GB; 71 TFLOPS dense FP16/BF16 tensor with FP32 accumulate
    # (NVIDIA Ampere GA102 whitepaper, appendix table); no fp8.
    # 936 GB/s GDDR6X (GeForce RTX 3090 specifications).
    "rtx3090": HardwareProfile(
        name="rtx3090", gpu_memory_bytes=24 * GB, matmul_flops=71 * T, fp8_matmul_flops=None,
        device_memory_Bps=936 * GB, **_PCIE4_X16, **_DESKTOP,
        fp32_matmul_flops=35.6 * T,  # GA102 whitepaper: 35.6 TFLOPS FP32
    ),
    # GeForce RTX 4090: 24 GB; 165 TFLOPS dense FP16/BF16, 330 dense FP8 (NVIDIA Ada Lovelace
    # architecture whitepaper, appendix table).
    # 1,008 GB/s GDDR6X (Ada whitepaper, appendix table).
    "rtx4090": HardwareProfile(
        name="rtx4090", gpu_memory_bytes=24 * GB, matmul_flops=165 * T,
        fp8_matmul_flops=330 * T, device_memory_Bps=1008 * GB, **_PCIE4_X16, **_DESKTOP,
        fp32_matmul_flops=82.6 * T,  # Ada whitepaper: 82.6 TFLOPS FP32
    ),
    # GeForce RTX 4060 Ti 16 GB: 44 TFLOPS dense FP16, 88 FP8 (Ada whitepaper); PCIe 4.0 x8.
    # 288 GB/s GDDR6 (Ada whitepaper).
    "rtx4060ti-16g": HardwareProfile(
        name="rtx4060ti-16g", gpu_memory_bytes=16 * GB, matmul_flops=44 * T,
        fp8_matmul_flops=88 * T, device_memory_Bps=288 * GB, **_PCIE4_X8, **_DESKTOP,
        fp32_matmul_flops=22.1 * T,  # Ada whitepaper: 22.1 TFLOPS FP32
    ),
    # GeForce RTX 5090: 32 GB; 209 TFLOPS dense FP16/BF16, 419 dense FP8 (NVIDIA Blackwell
    # RTX whitepaper); PCIe 5.0 x16.
    # 1,792 GB/s GDDR7 (Blackwell RTX whitepaper).
    "rtx5090": HardwareProfile(
        name="rtx5090", gpu_memory_bytes=32 * GB, matmul_flops=209 * T,
        fp8_matmul_flops=419 * T, device_memory_Bps=1792 * GB, **_PCIE5_X16, **_DESKTOP,
        fp32_matmul_flops=104.8 * T,  # Blackwell RTX whitepaper: 104.8 TFLOPS FP32
    ),
    # A100 40/80 GB: 312 TFLOPS dense BF16 (NVIDIA A100 datasheet); no fp8; PCIe 4.0 host link.
    # NVLink 3 between SXM cards: 600 GB/s both directions, 300 per direction. HBM2e:
    # 1,555 GB/s (40 GB), 2,039 GB/s (80 GB SXM) (A100 datasheet).
    "a100-40g": HardwareProfile(
        name="a100-40g", gpu_memory_bytes=40 * GB, matmul_flops=312 * T, fp8_matmul_flops=None,
        device_memory_Bps=1555 * GB, interconnect_Bps=300 * GB, **_PCIE4_X16, **_DESKTOP,
        fp32_matmul_flops=19.5 * T,  # A100 datasheet: 19.5 TFLOPS FP32
    ),
    "a100-80g": HardwareProfile(
        name="a100-80g", gpu_memory_bytes=80 * GB, matmul_flops=312 * T, fp8_matmul_flops=None,
        device_memory_Bps=2039 * GB, interconnect_Bps=300 * GB, **_PCIE4_X16, **_DESKTOP,
        fp32_matmul_flops=19.5 * T,  # A100 datasheet: 19.5 TFLOPS FP32
    ),
    # H100 SXM 80 GB: 989 TFLOPS dense BF16, 1979 dense FP8, 3.35 TB/s HBM3 (NVIDIA H100
    # datasheet); PCIe 5.0; NVLink 4: 900 GB/s both directions, 450 per direction.
    "h100-80g": HardwareProfile(
        name="h100-80g", gpu_memory_bytes=80 * GB, matmul_flops=989 * T,
        fp8_matmul_flops=1979 * T, device_memory_Bps=3350 * GB, interconnect_Bps=450 * GB,
        **_PCIE5_X16, **_DESKTOP,
        fp32_matmul_flops=67 * T,  # H100 SXM datasheet: 67 TFLOPS FP32
    ),
    # H200: 141 GB HBM3e at 4.8 TB/s; same tensor cores and NVLink as H100 (NVIDIA H200
    # datasheet).
    "h200": HardwareProfile(
        name="h200", gpu_memory_bytes=141 * GB, matmul_flops=989 * T,
        fp8_matmul_flops=1979 * T, device_memory_Bps=4800 * GB, interconnect_Bps=450 * GB,
        **_PCIE5_X16, **_DESKTOP,
        fp32_matmul_flops=67 * T,  # H200 datasheet: 67 TFLOPS FP32
    ),
    # This project's CPU-only development machine (2 vCPU, 24 GiB; PLATFORM_NOTES.md): fp32
    # matmul ~180 GFLOPS (1024^3 in 12 ms), memcpy ~25 GB/s, O_DIRECT read ~1.8 / write ~2.4
    # GB/s, fused AdamW 1.6 G params/s. The "device" is the CPU: copies are memcpys. Between
    # ranks, gloo's isend/irecv over loopback TCP: 0.34-0.60 GB/s per rank each way for 4-64
    # MiB messages on 2 ranks (tests running beside it), taken as 0.5 GB/s. Its memory as the
    # NF4 decode moves it (tierlm.plan.probe.decode_memory_Bps, 16M weights): 0.8-9.7 GB/s
    # over ten runs at load 5, ~4 GB/s typical.
    "cpu": HardwareProfile(
        name="cpu", gpu_memory_bytes=8 * GiB, host_memory_bytes=16 * GiB,
        disk_budget_bytes=50 * GiB, h2d_Bps=25 * GB, d2h_Bps=25 * GB,
        disk_read_Bps=1.8 * GB, disk_write_Bps=2.4 * GB, host_copy_Bps=25 * GB,
        matmul_flops=0.18 * T, fp8_matmul_flops=None, cpu_adam_params_per_s=1.6e9,
        device_memory_Bps=4 * GB, device_is_cpu=True, interconnect_Bps=0.5 * GB,
    ),
}


def probe_path() -> Path:
    return cache_dir() / "probe.json"


def load_probe() -> dict | None:
    p = probe_path()
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def detect(offload_dir: str | os.PathLike | None = None) -> HardwareProfile:
    """This machine: GPU memory from torch.cuda, RAM from psutil, free disk at the offload
    directory, and the rates `tierlm probe` measured (nominal ones where it has not run)."""
    import psutil
    import torch

    probe = load_probe() or {}
    disk_dir = Path(offload_dir) if offload_dir else Path.cwd()
    while not disk_dir.exists():
        disk_dir = disk_dir.parent
    free_disk = shutil.disk_usage(disk_dir).free
    host = psutil.virtual_memory().total
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        base = _closest_gpu(props.name)
        prof = base.with_overrides(
            name=f"detected ({props.name})", gpu_memory_bytes=props.total_memory,
            host_memory_bytes=host, disk_budget_bytes=free_disk,
        )
    else:
        prof = PROFILES["cpu"].with_overrides(
            name="detected (CPU only)", host_memory_bytes=host, disk_budget_bytes=free_disk,
            # the device tier is this RAM too: give it a quarter, the host tier the rest
            gpu_memory_bytes=host // 4,
        )
    measured = {k: v for k, v in probe.items() if k in _MEASURED_FIELDS}
    return prof.with_overrides(**measured)


_MEASURED_FIELDS = {
    "h2d_Bps", "d2h_Bps", "disk_read_Bps", "disk_write_Bps", "host_copy_Bps", "matmul_flops",
    "cpu_adam_params_per_s", "device_memory_Bps", "compiled_block_time_ratio",
    "compiled_block_probe", "fp32_matmul_flops",
}


def _closest_gpu(device_name: str) -> HardwareProfile:
    key = device_name.lower().replace(" ", "")
    for name, prof in PROFILES.items():
        if name.split("-")[0] in key:
            return prof
    return PROFILES["a100-80g"]


def resolve(
    name: str | None,
    *,
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    disk_budget_bytes: int | None = None,
    offload_dir: str | None = None,
) -> HardwareProfile:
    """A named profile (or `auto`/None: detected), with explicit sizes overriding it."""
    if name in (None, "auto"):
        prof = detect(offload_dir)
    elif name in PROFILES:
        prof = PROFILES[name]
    else:
        raise ConfigError(
            f"--hardware {name}: unknown profile; known: auto, {', '.join(PROFILES)}"
        )
    return prof.with_overrides(
        gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        disk_budget_bytes=disk_budget_bytes,
    )


def check_device(cfg: Config) -> None:
    """The config check of --device: auto, cpu, cuda, or sim:PROFILE, a profile of this table
    simulated on the tiered runtime in one process (called from `tierlm.plan.checks`)."""
    device = cfg.run.device
    if device in PLAIN_DEVICES:
        return
    names = ", ".join(f"sim:{p}" for p in PROFILES)
    if not device.startswith("sim:"):
        raise ConfigError(f"--device {device}: one of auto, cpu, cuda, or a simulated GPU "
                          f"({names})")
    if device[len("sim:"):] not in PROFILES:
        raise ConfigError(f"--device {device}: no hardware profile of that name; one of {names}")
    if not uses_tiered_runtime(cfg):
        raise ConfigError(f"--device {device} simulates the tiered runtime's step: pass "
                          "--offload-policy auto, host, disk or tiered")
    if cfg.distributed.nproc > 1 or cfg.distributed.context_parallel > 1:
        raise NotSupportedYet(f"--device {device} with --nproc or --context-parallel",
                              "the simulated device runs one process")
