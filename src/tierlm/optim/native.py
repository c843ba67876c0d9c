"""The optimizers' CPU kernels in C (8-bit AdamW's block update, Lion's update), built with the
system compiler on first use and loaded with ctypes; `kernel()` (`lion_kernel()`) returns None
where no compiler is found or the build fails, and the caller runs the eager PyTorch kernel
instead.

Why C (8-bit AdamW): the update is compute-bound (dequantise, two moment updates, two block maxima,
requantise, the Adam step), and eager PyTorch makes a pass over memory per operation; Inductor
fuses them, but its code for this kernel stayed several times slower than fused AdamW here. One
pass per block of 256, with the block's fp32 moments in L1, runs near fused AdamW's speed.

The C code performs the eager kernel's operations in the same order, in fp32 and without
floating-point contraction; the two agree to rounding, not bit for bit (ATen's vectorised sqrt is
not always correctly rounded). A run uses one kernel throughout, so the flat optimizer and its
per-parameter twin stay identical under either."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

#define BLOCK 256

/* n elements in ceil(n / 256) blocks (the last may be short); per block one scale per moment.
   h: 1-beta1, 1-beta2, beta1, beta2, decay factor, step size, 1/sqrt(bc2), eps, 1/127^4, 1/255^4 */
void adamw8bit_blocks(float *p, const float *g, int8_t *qm, uint8_t *qv, float *sm, float *sv,
                      int64_t n, const float *h, int nthreads) {
    const int64_t nb = (n + BLOCK - 1) / BLOCK;
    const float w1 = h[0], w2 = h[1], b1 = h[2], b2 = h[3], decay = h[4], step = h[5];
    const float ibc2 = h[6], eps = h[7], cm = h[8], cv = h[9];
    const float tiny = 1.17549435e-38f;
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t o = b * BLOCK;
        const int64_t len = n - o < BLOCK ? n - o : BLOCK;
        float m[BLOCK], r[BLOCK];
        const float km = sm[b] * cm, kv = sv[b] * cv;
        float am = 0.0f, av = 0.0f;
        for (int64_t i = 0; i < len; i++) {
            const float x = (float)qm[o + i];
            const float y = (float)qv[o + i];
            const float gi = g[o + i];
            const float x2 = x * x, y2 = y * y;
            const float mi = copysignf(x2 * x2, x) * km * b1 + gi * w1;
            const float vi = (y2 * y2) * kv * b2 + (gi * gi) * w2;
            m[i] = mi;
            r[i] = vi;
        }
        for (int64_t i = 0; i < len; i++) {
            am = fmaxf(am, fabsf(m[i]));
            av = fmaxf(av, r[i]);
        }
        sm[b] = am;
        sv[b] = av;
        const float fm = (1.0f / sqrtf(sqrtf(am > tiny ? am : tiny))) * 127.0f;
        const float fv = (1.0f / sqrtf(sqrtf(av > tiny ? av : tiny))) * 255.0f;
        for (int64_t i = 0; i < len; i++) {
            const float mi = m[i];
            const float ri = sqrtf(r[i]);
            qm[o + i] = (int8_t)nearbyintf(copysignf(sqrtf(sqrtf(fabsf(mi))) * fm, mi));
            qv[o + i] = (uint8_t)nearbyintf(sqrtf(ri) * fv);
            p[o + i] = p[o + i] * decay - (mi * step) / (ri * ibc2 + eps);
        }
    }
}

/* Lion (tierlm.optim.lion): one pass where eager PyTorch makes eight over memory; the same
   operations in the same order, each rounded to fp32 (no contraction), so the two agree bit for
   bit. h: beta1, 1-beta1, beta2, 1-beta2, decay factor (1 where no decay), lr */
void lion_update(float *p, const float *g, float *m, int64_t n, const float *h, int nthreads) {
    const float b1 = h[0], w1 = h[1], b2 = h[2], w2 = h[3], decay = h[4], lr = h[5];
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t i = 0; i < n; i++) {
        const float gi = g[i], mi = m[i];
        const float c = mi * b1 + gi * w1;
        const float s = (float)((c > 0.0f) - (c < 0.0f));
        p[i] = p[i] * decay - s * lr;
        m[i] = mi * b2 + gi * w2;
    }
}
"""

# no contraction: the rounding stays the eager kernel's; finite math without signed zeros lets
# the block maxima vectorise (the gradient is checked finite before the optimizer runs)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-ffinite-math-only", "-fno-signed-zeros", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: list = []  # [function or None] once tried


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    # -march=native: the build is this CPU's, so its flags are part of the cache key
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc + _cpu_flags()).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"tierlm-kernels-{os.getuid()}")
    lib = os.path.join(folder, f"optim-{key}.so")
    if not os.path.exists(lib):
        os.makedirs(folder, exist_ok=True)
        src = os.path.join(folder, f"optim-{key}.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        tmp = f"{lib}.{os.getpid()}"
        done = subprocess.run([cc, *_FLAGS, src, "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"tierlm: the optimizer C kernels did not build ({cc}); using the eager "
                  f"kernels:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
        os.replace(tmp, lib)  # atomic: concurrent builders each publish a whole file
    dll = ctypes.CDLL(lib)
    dll.adamw8bit_blocks.restype = None
    dll.adamw8bit_blocks.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p,
                                                              ctypes.c_int]
    dll.lion_update.restype = None
    dll.lion_update.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p,
                                                         ctypes.c_int]
    return dll


def kernel() -> ctypes._CFuncPtr | None:
    """The compiled 8-bit AdamW block kernel, or None where it cannot be built here."""
    dll = _library()
    return None if dll is None else dll.adamw8bit_blocks


def lion_kernel() -> ctypes._CFuncPtr | None:
    """The compiled Lion update, or None where it cannot be built here."""
    dll = _library()
    return None if dll is None else dll.lion_update


def _library() -> ctypes.CDLL | None:
    with _lock:
        if not _loaded:
            try:
                _loaded.append(_build())
            except OSError as e:
                print(f"tierlm: the optimizer C kernels did not load ({e}); using the eager "
                      "kernels", file=sys.stderr)
                _loaded.append(None)
        return _loaded[0]


def run(fn: ctypes._CFuncPtr, p: torch.Tensor, g: torch.Tensor, qm: torch.Tensor,
        qv: torch.Tensor, sm: torch.Tensor, sv: torch.Tensor, h: torch.Tensor) -> None:
    """One call over a span: flat contiguous CPU tensors, p/g/qm/qv of n elements, sm/sv of
    ceil(n/256), `h` the 10 fp32 scalars listed in the C source."""
    dtypes = (torch.float32, torch.float32, torch.int8, torch.uint8) + (torch.float32,) * 3
    for t, dtype in zip((p, g, qm, qv, sm, sv, h), dtypes, strict=True):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != dtype:
            raise ValueError("the 8-bit AdamW C kernel takes contiguous CPU tensors: fp32 "
                             "master, gradient and scales, int8 and uint8 codes")
    fn(p.data_ptr(), g.data_ptr(), qm.data_ptr(), qv.data_ptr(), sm.data_ptr(), sv.data_ptr(),
       p.numel(), h.data_ptr(), torch.get_num_threads())


def run_lion(fn: ctypes._CFuncPtr, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
             h: torch.Tensor) -> None:
    """Lion over flat contiguous fp32 CPU tensors of equal size; `h` the 6 fp32 scalars listed
    in the C source."""
    for t in (p, g, m, h):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != torch.float32:
            raise ValueError("the Lion C kernel takes contiguous fp32 CPU tensors")
    fn(p.data_ptr(), g.data_ptr(), m.data_ptr(), p.numel(), h.data_ptr(),
       torch.get_num_threads())
