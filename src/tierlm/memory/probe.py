"""`tierlm probe`: measure this machine's rates for the planner and save them.

Measured: disk read/write with O_DIRECT (dd, on the offload directory), host memcpy, fused CPU
AdamW params/s, the dense matmul rate of the compute device, and pinned H2D/D2H copies where
CUDA exists. Saved as JSON under the tierlm cache; `--hardware auto` reads it.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.memory.disk import dd_throughput


def _best_s(fn: Callable[[], None], repeats: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def decode_memory_Bps(dev: torch.device, numel: int = 16 * 2**20) -> float:
    """Device memory bandwidth as QLoRA's per-matmul NF4 decode sees it: `numel` weights
    decoded into fp32, at the bytes tierlm.models.nf4.decode_traffic_bytes counts per weight
    (the planner's decode time divides the same count by this rate)."""
    from tierlm.models.nf4 import decode_traffic_bytes, dequantise, nf4_nbytes, quantise

    x = torch.randn(numel)
    buf = quantise(x, torch.empty(nf4_nbytes(numel), dtype=torch.uint8)).to(dev)
    out = torch.empty(numel, device=dev)

    def decode() -> None:
        dequantise(buf, numel, out=out)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    decode()  # warm: the level table on the device
    return decode_traffic_bytes(numel, torch.float32) / _best_s(decode)


def measure(directory: Path, *, disk_mib: int = 512, log=print) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=directory, prefix=".tierlm-probe-") as d:
        w, r = dd_throughput(Path(d), disk_mib * 2**20)
    out["disk_write_Bps"], out["disk_read_Bps"] = w, r
    log(f"disk (O_DIRECT, {directory}): write {w / 1e9:.2f} GB/s, read {r / 1e9:.2f} GB/s")

    n = 64 * 2**20  # 256 MiB of fp32
    src, dst = torch.empty(n), torch.empty(n)
    src.fill_(1.0)
    dst.fill_(0.0)
    s = _best_s(lambda: dst.copy_(src))
    out["host_copy_Bps"] = 2 * 4 * n / s  # read + write
    log(f"host memcpy: {out['host_copy_Bps'] / 1e9:.1f} GB/s (read + write)")

    p = torch.zeros(n // 2)
    g, m, v = torch.full_like(p, 1e-3), torch.zeros_like(p), torch.zeros_like(p)
    step = torch.zeros((), dtype=torch.float32)
    from torch.optim.adam import adam

    def update() -> None:
        adam([p], [g], [m], [v], [], [step], fused=True, decoupled_weight_decay=True,
             amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
             maximize=False)

    out["cpu_adam_params_per_s"] = p.numel() / _best_s(update)
    log(f"CPU fused AdamW: {out['cpu_adam_params_per_s'] / 1e9:.2f} G params/s")

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = 4096 if dev.type == "cuda" else 1024
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)

    def mm() -> None:
        for _ in range(4):
            a @ b
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out["matmul_flops"] = 4 * 2 * size**3 / _best_s(mm)
    log(f"matmul ({dev.type}, {dtype}): {out['matmul_flops'] / 1e12:.2f} TFLOPS")

    out["device_memory_Bps"] = decode_memory_Bps(dev)
    log(f"device memory, as the NF4 decode moves it: "
        f"{out['device_memory_Bps'] / 1e9:.1f} GB/s (read + write)")

    if dev.type == "cuda":
        host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty_like(host, device=dev)
        for key, (d_, s_) in (("h2d_Bps", (gpu, host)), ("d2h_Bps", (host, gpu))):

            def copy(d_=d_, s_=s_) -> None:
                d_.copy_(s_, non_blocking=True)
                torch.cuda.synchronize()

            out[key] = host.numel() / _best_s(copy)
            log(f"{key[:3].upper()} pinned copy: {out[key] / 1e9:.1f} GB/s")
    return out


def run_probe(
    directory: str | None, out_path: Path, *, disk_mib: int = 512, log=print
) -> dict[str, float]:
    target = Path(directory) if directory else Path.cwd()
    target.mkdir(parents=True, exist_ok=True)
    result = measure(target, disk_mib=disk_mib, log=log)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    tmp.replace(out_path)
    log(f"saved to {out_path}; `--hardware auto` uses these numbers")
    return result
