"""GPU clocks, temperature, power, throttle reasons and PCIe link peak through NVML.

NVML comes from the optional `nvidia-ml-py` package (`pip install tierlm[gpu]`, imported as
`pynvml`). Without it, without a CUDA device, or when NVML cannot start, `open_gpu_sampler`
returns a sampler whose fields are all None, so metrics.jsonl keeps the same keys everywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

GPU_FIELDS = (
    "gpu_sm_clock_mhz",
    "gpu_max_sm_clock_mhz",
    "gpu_temp_c",
    "gpu_power_w",
    "gpu_throttle_reasons",
)

# NVML clock-event (throttle) reason bits, as nvml.h defines them.
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# Usable bytes/s per lane and direction by PCIe generation: transfer rate x line-code
# efficiency (8b/10b up to gen 2, 128b/130b for gen 3-5, FLIT mode ~242/256 for gen 6) / 8 bits.
PCIE_LANE_Bps = {
    1: 2.5e9 * 8 / 10 / 8,
    2: 5e9 * 8 / 10 / 8,
    3: 8e9 * 128 / 130 / 8,
    4: 16e9 * 128 / 130 / 8,
    5: 32e9 * 128 / 130 / 8,
    6: 64e9 * 242 / 256 / 8,
}


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASON_BITS.items() if mask & bit]


class GpuSampler(Protocol):
    pcie_peak_Bps: float | None  # per direction, from the link's maximum generation and width

    def sample(self) -> dict[str, Any]: ...


class NoGpu:
    pcie_peak_Bps = None

    def sample(self) -> dict[str, Any]:
        return dict.fromkeys(GPU_FIELDS)


class NvmlSampler:
    """Reads one GPU's state each step; a query the driver refuses leaves its field None."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        gen = self._query("nvmlDeviceGetMaxPcieLinkGeneration")
        width = self._query("nvmlDeviceGetMaxPcieLinkWidth")
        self.pcie_peak_Bps = PCIE_LANE_Bps[gen] * width if gen in PCIE_LANE_Bps and width else None
        self.max_sm_clock_mhz = self._query("nvmlDeviceGetMaxClockInfo", nvml.NVML_CLOCK_SM)
        # The reason query was renamed (ClocksThrottle -> ClocksEvent) in newer bindings.
        self._reasons_fn = next(
            (
                n
                for n in ("nvmlDeviceGetCurrentClocksEventReasons",
                          "nvmlDeviceGetCurrentClocksThrottleReasons")
                if hasattr(nvml, n)
            ),
            None,
        )

    def _query(self, fn: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, fn)(self.handle, *args)
        except Exception:  # NVMLError_NotSupported and friends: not fatal, the field is None
            return None

    def sample(self) -> dict[str, Any]:
        power_mw = self._query("nvmlDeviceGetPowerUsage")
        mask = self._query(self._reasons_fn) if self._reasons_fn else None
        return {
            "gpu_sm_clock_mhz": self._query("nvmlDeviceGetClockInfo", self.nvml.NVML_CLOCK_SM),
            "gpu_max_sm_clock_mhz": self.max_sm_clock_mhz,
            "gpu_temp_c": self._query(
                "nvmlDeviceGetTemperature", self.nvml.NVML_TEMPERATURE_GPU
            ),
            "gpu_power_w": power_mw / 1000 if power_mw is not None else None,
            "gpu_throttle_reasons": reason_names(mask) if mask is not None else None,
        }


def _handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of torch's device: matched by UUID, since CUDA_VISIBLE_DEVICES can make
    torch's index differ from NVML's."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def open_gpu_sampler(device: torch.device, nvml: Any = None) -> GpuSampler:
    """An NVML sampler for `device` when it is a CUDA device and NVML works, else `NoGpu`.
    `nvml`: the pynvml module (tests pass a stand-in); None imports it."""
    if device.type != "cuda":
        return NoGpu()
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return NoGpu()
    try:
        nvml.nvmlInit()
        return NvmlSampler(nvml, _handle(nvml, device))
    except Exception:  # no driver library, no permission: run without GPU telemetry
        return NoGpu()
