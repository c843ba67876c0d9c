"""`tierlm probe`: measure this machine's rates for the planner and save them.

Measured: disk read/write with O_DIRECT (dd, on the offload directory), host memcpy, fused CPU
AdamW params/s, the dense matmul rate of the compute device, and pinned H2D/D2H copies where
CUDA exists. With `--compile segments` also one decoder block's forward+backward eager against
compiled (`compiled_block_time_ratio`, the compiled time over the eager one), which the planner
multiplies into the blocks' compute time of a `--compile segments` plan; compiling costs tens of
seconds on a CPU, so it is asked for. Saved as JSON under the tierlm cache (a later probe without
`--compile` keeps the compiled measurement it finds there); `--hardware auto` reads it.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tierlm.config import PrecisionConfig
from tierlm.memory.disk import dd_throughput
from tierlm.models import build_model, preset_config
from tierlm.models.adapters import ModelAdapter
from tierlm.precision import prepare_precision
from tierlm.precision.nf4 import decode_traffic_bytes, dequantise, nf4_nbytes, quantise
from tierlm.runtime.compile import NoCompile, SegmentCompile


def _seconds(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
    decoded into fp32, at the bytes tierlm.precision.nf4.decode_traffic_bytes counts per weight
    (the planner's decode time divides the same count by this rate)."""
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
    if dev.type == "cuda":
        # fp32 as a run computes it without --tf32: IEEE on the CUDA cores
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            a, b = a.float(), b.float()
            out["fp32_matmul_flops"] = 4 * 2 * size**3 / _best_s(mm)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        log(f"matmul (cuda, float32, TF32 off): {out['fp32_matmul_flops'] / 1e12:.2f} TFLOPS")

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


# What `--compile segments` is measured on when the probe is not told: the block of the preset
# a run on such a device trains, at its usual sequence length, in the precision `--precision
# auto` computes in there (fp32 on a CPU: no native bf16; bf16 on a GPU).
COMPILE_PROBE_DEFAULTS = {"cpu": ("small", 256, "fp32"), "cuda": ("1b", 2048, "bf16")}


def measure_compiled_block(
    device: torch.device, config, *, label: str, seq_len: int, batch_size: int = 1,
    precision: str = "fp32", cache_dir: Path | None = None, repeats: int = 3, log=print,
) -> dict[str, float | str]:
    """One decoder block of a model of `config` (a transformers config; `label` names it in
    the result), forward and backward (input and weight gradients) on (batch_size, seq_len)
    tokens, called as the tiered runtime calls it (the adapter's functional call over its
    parameters), eager and compiled as `--compile segments` compiles it; the best of `repeats`
    runs of each, interleaved, after a warm-up (the compiled one's is the compile, reported
    apart). Returns `compiled_block_time_ratio` (compiled s / eager s),
    `compiled_block_compile_s` and `compiled_block_probe` (what was measured)."""
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    base = build_model(config, device=device, seed=0)
    if precision == "bf16":
        prepare_precision(base, PrecisionConfig(mode="bf16"), "bf16", device, log=lambda m: None)
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), device=device, generator=g)

    def timer(compiled) -> Callable[[], None]:
        model = copy.deepcopy(base)
        compiled.apply(model, lambda m: None)
        adapter = ModelAdapter(model)
        embed, block = adapter.segments[0], adapter.segments[1]
        views = {n: p for n, p, _ in block.params}
        with torch.no_grad():
            x = embed.forward({n: p for n, p, _ in embed.params}, ids,
                              adapter.embed_context(ids, None))
        ctx = adapter.context(ids, x)
        x.requires_grad_(True)
        grad_out = torch.randn(x.shape, device=device, generator=g, dtype=x.dtype)
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                    else contextlib.nullcontext())

        def run() -> None:
            with autocast:
                out = block.forward(views, x, ctx)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_out)
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run

    eager_run = timer(NoCompile())
    eager_run()  # warm-up
    compiler = SegmentCompile(cache_dir or Path(tempfile.gettempdir()) / "tierlm-inductor",
                              precision=precision)
    compiled_run = timer(compiler)
    compile_s = _seconds(compiled_run)
    # interleaved, so load from other processes slows both alike; best of each (noise only adds)
    eager_s = compiled_s = float("inf")
    for _ in range(repeats):
        eager_s = min(eager_s, _seconds(eager_run))
        compiled_s = min(compiled_s, _seconds(compiled_run))
    what = (f"one {label} block, {batch_size} x {seq_len} tokens, {precision} on {device.type}, "
            f"torch {torch.__version__}")
    ratio = compiled_s / eager_s
    log(f"compiled block ({what}): forward+backward eager {eager_s * 1e3:.1f} ms, compiled "
        f"{compiled_s * 1e3:.1f} ms: {ratio:.2f}x the eager time (compiling took "
        f"{compile_s:.1f} s)")
    return {"compiled_block_time_ratio": ratio, "compiled_block_compile_s": compile_s,
            "compiled_block_probe": what}


COMPILED_KEYS = ("compiled_block_time_ratio", "compiled_block_compile_s", "compiled_block_probe")


def run_probe(
    directory: str | None, out_path: Path, *, disk_mib: int = 512, compile: str = "off",
    compile_size: str | None = None, compile_seq_len: int | None = None,
    cache_dir: Path | None = None, log=print,
) -> dict[str, float | str]:
    """Measure (`compile` "segments": the compiled block too, of preset `compile_size` at
    `compile_seq_len` tokens, defaults per device in COMPILE_PROBE_DEFAULTS) and save to
    `out_path`."""
    target = Path(directory) if directory else Path.cwd()
    target.mkdir(parents=True, exist_ok=True)
    result: dict[str, float | str] = dict(measure(target, disk_mib=disk_mib, log=log))
    if compile == "segments":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        size, seq_len, precision = COMPILE_PROBE_DEFAULTS[dev.type]
        size, seq_len = compile_size or size, compile_seq_len or seq_len
        config = preset_config(size, vocab_size=256, max_seq_len=seq_len)
        result.update(measure_compiled_block(dev, config, label=size, seq_len=seq_len,
                                             precision=precision, cache_dir=cache_dir, log=log))
    else:
        previous = _read(out_path)
        kept = {k: previous[k] for k in COMPILED_KEYS if k in previous}
        if kept:
            result.update(kept)
            log(f"kept the compiled block's measurement from the previous probe "
                f"({kept.get('compiled_block_probe')}); `--compile segments` measures it again")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1), encoding="utf-8")
    tmp.replace(out_path)
    log(f"saved to {out_path}; `--hardware auto` uses these numbers")
    return result


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
