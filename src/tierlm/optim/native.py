"""The optimizers' CPU kernels in C (8-bit AdamW's block update, Lion's update, Adafactor's
segment step), built with the system compiler on first use and loaded with ctypes; `kernel()`
(`lion_kernel()`, `adafactor_kernel()`) returns None where no compiler is found or the build
fails, and the caller runs the eager PyTorch kernel instead. Each kernel's comment in the C
source says how close it is to the eager one.

Why C (8-bit AdamW): the update is compute-bound (dequantise, two moment updates, two block maxima,
requantise, the Adam step), and eager PyTorch makes a pass over memory per operation; Inductor
fuses them, but its code for this kernel stayed several times slower than fused AdamW here. One
pass per block of 256, with the block's fp32 moments in L1, runs near fused AdamW's speed.

The 8-bit AdamW C code performs the eager kernel's operations in the same order, in fp32 and
without floating-point contraction; the two agree to rounding, not bit for bit (ATen's
vectorised sqrt is not always correctly rounded). A run uses one kernel throughout, so the flat
optimizer and its per-parameter twin stay identical under either."""

from __future__ import annotations

import ctypes
import hashlib
import math
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
#include <stdlib.h>
#include <string.h>

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

/* Adafactor (tierlm.optim.adafactor): torch.optim.Adafactor's step on every parameter of a
   segment in two passes over it where eager PyTorch makes about fifteen per parameter.
   (A) A matrix, per row: the sums of squares of the gradient and the parameter, the row's new
   statistic r_i, then (the row still in cache) beside the column sums of g_ij^2 the column sums
   of g_ij^2 / r_i. A vector: the sum of squares of the parameter, the new second moment, the
   update's sum of squares. Then, serially, each matrix's column statistics c_j and each
   parameter's step size. (C) The parameter update, the update recomputed from the gradient
   (reading it again costs less than writing and reading the update).

   A matrix's estimate 1/sqrt(max(r_i c_j / mean(r), eps1^2)) is taken as min(a_i b_j, 1/eps1)
   with a_i = 1/sqrt(r_i / mean(r)) and b_j = 1/sqrt(c_j), so (C) multiplies where the eager step
   divides and takes a square root per element. Where no element reaches the eps1 clamp (max a_i
   * max b_j below 1/eps1, over the rows and columns with a nonzero gradient) the update's sum of
   squares sum_ij g_ij^2 a_i^2 b_j^2 is mean(r) sum_j (sum_i g_ij^2 / r_i) / c_j from the sums of
   (A); otherwise a pass (B) over the gradient sums it element by element. The results agree
   with torch's to a few units in the last place, not bit for bit.

   Sums accumulate in double (the column sums: in fp32 over 64 rows, then in double) per block
   of rows (vector elements) fixed by the shape, and blocks are added in order: results do not
   depend on the thread count. Each pass is one
   parallel loop over all the segment's blocks, taken as threads come free: on a shared machine
   a descheduled thread stalls the others at two barriers a segment, not two a parameter.

   desc, 8 per parameter: offset in p and g, factored (0 or 1), batches nb, rows R, columns C
   (a vector: 1, 1, its length), offsets in row, col and var. h, 6 per parameter: 1-beta2_t,
   rho_t, decay factor (1 where no decay), eps1, eps2, d. Returns 0, or -1 where the scratch
   memory could not be allocated (then nothing was written). */

#define AF_BIG 1.152921504606846976e18f /* 2^60: a_i b_j stays finite */
#define AF_VBLOCK 16384                 /* vector elements per block; (C) takes as many */
#define AF_SUBROWS 64                   /* rows a column sum adds in fp32 before double */

static inline float af_lerp(float s, float e, float w) {
    /* ATen's lerp: from the nearer end, fused */
    return fabsf(w) < 0.5f ? fmaf(w, e - s, s) : fmaf(w - 1.0f, e - s, e);
}

static inline float af_isqrt(double x) {
    return x > 0.0 ? (float)fmin(1.0 / sqrt(x), (double)AF_BIG) : AF_BIG;
}

static inline float af_cap(const double *h) {
    return af_isqrt((double)(float)(h[3] * h[3]));
}

static inline int64_t af_rows_per_block(int64_t R) {
    return R > 32 * 128 ? (R + 31) / 32 : 128; /* at most 32 blocks a matrix */
}

/* the step size -alpha / denom from the sums of squares of the parameter (before decay) and of
   the update, each rounded to fp32 as torch's norm is */
static float af_step(double psq, double usq, int64_t n, const double *h) {
    const double root_n = sqrt((double)n);
    const double alpha = fmax(h[4], (double)(float)sqrt(psq) / root_n) * h[1];
    const double denom = fmax(1.0, (double)(float)sqrt(usq) / (root_n * h[5]));
    return (float)(-alpha / denom);
}

/* rows [i0, i1) of batch t of parameter `param` (a vector: elements) */
typedef struct { int64_t param, t, i0, i1; } af_task;

int adafactor_segment(float *p, const float *g, float *row, float *col, float *var,
                      int64_t nparams, const int64_t *desc, const double *h, int nthreads) {
    /* the tasks of (A) and (C), and where each task's and parameter's scratch starts */
    int64_t na = 0, nc = 0, nab = 0, ncol = 0;
    for (int64_t q = 0; q < nparams; q++) {
        const int64_t *d = desc + 8 * q, nb = d[2], R = d[3], C = d[4];
        if (nb * R * C == 0)
            continue;
        if (d[1]) {
            const int64_t rpb = af_rows_per_block(R), per = C < AF_VBLOCK ? AF_VBLOCK / C : 1;
            na += nb * ((R + rpb - 1) / rpb);
            nc += nb * ((R + per - 1) / per);
            nab += nb * (R + C);
            ncol += nb * ((R + rpb - 1) / rpb) * 3 * C;
        } else {
            na += (C + AF_VBLOCK - 1) / AF_VBLOCK;
            nc += (C + AF_VBLOCK - 1) / AF_VBLOCK;
        }
    }
    af_task *ta = malloc((size_t)(na + nc + 1) * sizeof(af_task)), *tc = ta + na;
    int64_t *colat = malloc((size_t)(na + 1) * sizeof(int64_t));
    int64_t *abat = malloc((size_t)(nparams + 1) * sizeof(int64_t));
    int64_t *first = malloc((size_t)(nparams + 1) * sizeof(int64_t)); /* first (A) task */
    double *sums = malloc((size_t)(2 * na + 1) * sizeof(double)); /* psq, usq per (A) task */
    double *colpart = malloc((size_t)(ncol + 1) * sizeof(double));
    double *rowsq = malloc((size_t)(nab + 1) * sizeof(double));
    float *ab = malloc((size_t)(nab + 1) * sizeof(float));
    float *steps = malloc((size_t)(nparams + 1) * sizeof(float));
    if (!ta || !colat || !abat || !first || !sums || !colpart || !rowsq || !ab || !steps) {
        free(ta); free(colat); free(abat); free(first); free(sums); free(colpart); free(rowsq);
        free(ab); free(steps);
        return -1;
    }
    int64_t ia = 0, ic = 0, at_col = 0, at_ab = 0;
    for (int64_t q = 0; q < nparams; q++) {
        const int64_t *d = desc + 8 * q, nb = d[2], R = d[3], C = d[4];
        first[q] = ia;
        abat[q] = at_ab;
        if (nb * R * C == 0)
            continue;
        if (d[1]) {
            const int64_t rpb = af_rows_per_block(R), per = C < AF_VBLOCK ? AF_VBLOCK / C : 1;
            for (int64_t t = 0; t < nb; t++) {
                for (int64_t i = 0; i < R; i += rpb) {
                    colat[ia] = at_col;
                    at_col += 3 * C;
                    ta[ia++] = (af_task){q, t, i, i + rpb < R ? i + rpb : R};
                }
                for (int64_t i = 0; i < R; i += per)
                    tc[ic++] = (af_task){q, t, i, i + per < R ? i + per : R};
            }
            at_ab += nb * (R + C);
        } else {
            for (int64_t i = 0; i < C; i += AF_VBLOCK) {
                ta[ia++] = (af_task){q, 0, i, i + AF_VBLOCK < C ? i + AF_VBLOCK : C};
                tc[ic++] = (af_task){q, 0, i, i + AF_VBLOCK < C ? i + AF_VBLOCK : C};
            }
        }
    }
    first[nparams] = ia;

    #pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t k = 0; k < na; k++) { /* (A) */
        const af_task tk = ta[k];
        const int64_t *d = desc + 8 * tk.param, C = d[4];
        const double *hq = h + 6 * tk.param;
        const float w = (float)hq[0];
        double ps = 0.0, us = 0.0;
        if (d[1]) {
            const int64_t R = d[3], mat = d[0] + tk.t * R * C;
            float *rt = row + d[5] + tk.t * R;
            double *cs = colpart + colat[k], *cs2 = cs + C;
            float *sub = (float *)(cs2 + C), *sub2 = sub + C; /* the last rows, in fp32 */
            double *rq = rowsq + abat[tk.param] + tk.t * R;
            memset(cs, 0, (size_t)(3 * C) * sizeof(double));
            for (int64_t i = tk.i0; i < tk.i1; i++) {
                const float *gi = g + mat + i * C, *pi = p + mat + i * C;
                double rs = 0.0, pr = 0.0;
                #pragma omp simd reduction(+:rs, pr)
                for (int64_t j = 0; j < C; j++) {
                    const float x = gi[j], y = pi[j], xx = x * x;
                    rs += (double)xx;
                    sub[j] += xx;
                    pr += (double)y * y;
                }
                const float norm = (float)sqrt(rs);
                const float r = af_lerp(rt[i], (norm * norm) / (float)C, w);
                rt[i] = r;
                rq[i] = rs;
                ps += pr;
                if (rs > 0.0 && r > 0.0f) {
                    const float inv = (float)(1.0 / (double)r);
                    #pragma omp simd
                    for (int64_t j = 0; j < C; j++)
                        sub2[j] += gi[j] * gi[j] * inv;
                }
                if ((i + 1 - tk.i0) % AF_SUBROWS == 0 || i + 1 == tk.i1) {
                    #pragma omp simd
                    for (int64_t j = 0; j < C; j++) {
                        cs[j] += (double)sub[j];
                        cs2[j] += (double)sub2[j];
                        sub[j] = 0.0f;
                        sub2[j] = 0.0f;
                    }
                }
            }
        } else {
            const float eps1sq = (float)(hq[3] * hq[3]);
            const float *gq = g + d[0], *pq = p + d[0];
            float *v = var + d[7];
            #pragma omp simd reduction(+:ps, us)
            for (int64_t i = tk.i0; i < tk.i1; i++) {
                const double y = pq[i];
                ps += y * y;
                const float vi = af_lerp(v[i], gq[i] * gq[i], w);
                v[i] = vi;
                const double u = gq[i] * (1.0f / sqrtf(fmaxf(vi, eps1sq)));
                us += u * u;
            }
        }
        sums[2 * k] = ps;
        sums[2 * k + 1] = us;
    }

    for (int64_t q = 0; q < nparams; q++) { /* statistics and step sizes, in order */
        const int64_t *d = desc + 8 * q, nb = d[2], R = d[3], C = d[4];
        const double *hq = h + 6 * q;
        double psq = 0.0, usq = 0.0;
        for (int64_t k = first[q]; k < first[q + 1]; k++) {
            psq += sums[2 * k];
            usq += sums[2 * k + 1];
        }
        if (d[1] && nb * R * C > 0) {
            const float w = (float)hq[0], eps1 = (float)hq[3], cap = af_cap(hq);
            const int64_t rpb = af_rows_per_block(R), nblk = (R + rpb - 1) / rpb;
            usq = 0.0;
            for (int64_t t = 0; t < nb; t++) {
                float *rt = row + d[5] + t * R, *ct = col + d[6] + t * C;
                float *a = ab + abat[q] + t * (R + C), *b = a + R;
                const double *rq = rowsq + abat[q] + t * R;
                const double *parts = colpart + colat[first[q] + t * nblk];
                double rsum = 0.0;
                for (int64_t i = 0; i < R; i++)
                    rsum += rt[i];
                float rmean = (float)(rsum / (double)R);
                rmean = rmean < eps1 ? eps1 : rmean;
                float amax = 0.0f, bmax = 0.0f;
                for (int64_t i = 0; i < R; i++) {
                    a[i] = af_isqrt((double)rt[i] / (double)rmean);
                    if (rq[i] > 0.0)
                        amax = fmaxf(amax, a[i]);
                }
                double weighted = 0.0; /* sum_j (sum_i g_ij^2 / r_i) / c_j */
                for (int64_t j = 0; j < C; j++) {
                    double s = 0.0, s2 = 0.0;
                    for (int64_t k = 0; k < nblk; k++) {
                        s += parts[3 * C * k + j];
                        s2 += parts[3 * C * k + C + j];
                    }
                    const float norm = (float)sqrt(s);
                    ct[j] = af_lerp(ct[j], (norm * norm) / (float)R, w);
                    b[j] = af_isqrt((double)ct[j]);
                    if (s > 0.0) {
                        bmax = fmaxf(bmax, b[j]);
                        weighted += ct[j] > 0.0f ? s2 / (double)ct[j] : 0.0;
                    }
                }
                if ((double)amax * (double)bmax < (double)cap * (1.0 - 1e-6)) {
                    usq += (double)rmean * weighted; /* no element clamped */
                    continue;
                }
                const float *gt = g + d[0] + t * R * C; /* (B) */
                double *part = sums + 2 * first[q]; /* this matrix's (A) sums are read: reuse */
                #pragma omp parallel for schedule(dynamic) num_threads(nthreads)
                for (int64_t k = 0; k < nblk; k++) {
                    const int64_t i1 = (k + 1) * rpb < R ? (k + 1) * rpb : R;
                    double us = 0.0;
                    for (int64_t i = k * rpb; i < i1; i++) {
                        const float *gi = gt + i * C, ai = a[i];
                        double ur = 0.0;
                        #pragma omp simd reduction(+:ur)
                        for (int64_t j = 0; j < C; j++) {
                            const double u = gi[j] * fminf(ai * b[j], cap);
                            ur += u * u;
                        }
                        us += ur;
                    }
                    part[k] = us;
                }
                for (int64_t k = 0; k < nblk; k++)
                    usq += part[k];
            }
        }
        steps[q] = nb * R * C > 0 ? af_step(psq, usq, nb * R * C, hq) : 0.0f;
    }

    #pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t k = 0; k < nc; k++) { /* (C) */
        const af_task tk = tc[k];
        const int64_t *d = desc + 8 * tk.param, C = d[4];
        const double *hq = h + 6 * tk.param;
        const float decay = (float)hq[2], step = steps[tk.param];
        if (d[1]) {
            const int64_t R = d[3], mat = d[0] + tk.t * R * C;
            const float cap = af_cap(hq);
            const float *a = ab + abat[tk.param] + tk.t * (R + C), *b = a + R;
            for (int64_t i = tk.i0; i < tk.i1; i++) {
                const float *gi = g + mat + i * C, ai = a[i];
                float *pi = p + mat + i * C;
                #pragma omp simd
                for (int64_t j = 0; j < C; j++)
                    pi[j] = fmaf(gi[j] * fminf(ai * b[j], cap), step, pi[j] * decay);
            }
        } else {
            const float eps1sq = (float)(hq[3] * hq[3]);
            const float *gq = g + d[0], *v = var + d[7];
            float *pq = p + d[0];
            #pragma omp simd
            for (int64_t i = tk.i0; i < tk.i1; i++)
                pq[i] = fmaf(gq[i] * (1.0f / sqrtf(fmaxf(v[i], eps1sq))), step, pq[i] * decay);
        }
    }
    free(ta); free(colat); free(abat); free(first); free(sums); free(colpart); free(rowsq);
    free(ab); free(steps);
    return 0;
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
    dll.adafactor_segment.restype = ctypes.c_int
    dll.adafactor_segment.argtypes = [ctypes.c_void_p] * 5 + [
        ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double),
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


def adafactor_kernel() -> ctypes._CFuncPtr | None:
    """The compiled Adafactor segment step, or None where it cannot be built here."""
    dll = _library()
    return None if dll is None else dll.adafactor_segment


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


def run_adafactor(fn: ctypes._CFuncPtr, p: torch.Tensor, g: torch.Tensor, row: torch.Tensor,
                  col: torch.Tensor, var: torch.Tensor, params: list[tuple[int, tuple[int, ...],
                                                                     int, int, int]],
                  hyper: list[tuple[float, ...]]) -> None:
    """One Adafactor step on a segment: flat contiguous fp32 CPU tensors, `p` and `g` the
    master and gradient, `row`, `col` and `var` the slot buffers. `params[q]` is parameter q's
    (offset in p, shape, offset in row, in col, in var) and `hyper[q]` its 6 scalars listed in
    the C source; a parameter of two or more dimensions is factored over its last two."""
    for t in (p, g, row, col, var):
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype != torch.float32:
            raise ValueError("the Adafactor C kernel takes contiguous fp32 CPU tensors")
    desc = []
    for offset, shape, row_at, col_at, var_at in params:
        numel = math.prod(shape)
        if offset + numel > p.numel() or g.numel() != p.numel():
            raise ValueError(f"Adafactor: a parameter {shape} at {offset} is outside the "
                             f"{p.numel()} elements given")
        if len(shape) >= 2:
            rows, cols = shape[-2:]
            batches = math.prod(shape[:-2])
            if row_at + batches * rows > row.numel() or col_at + batches * cols > col.numel():
                raise ValueError(f"Adafactor: the statistics of a parameter {shape} are "
                                 "outside the slot buffers given")
            desc += [offset, 1, batches, rows, cols, row_at, col_at, 0]
        else:
            if var_at + numel > var.numel():
                raise ValueError(f"Adafactor: the variance of a parameter {shape} is outside "
                                 "the slot buffer given")
            desc += [offset, 0, 1, 1, numel, 0, 0, var_at]
    flat_hyper = [x for h in hyper for x in h]
    if len(flat_hyper) != 6 * len(params):
        raise ValueError("Adafactor: 6 scalars per parameter")
    rc = fn(p.data_ptr(), g.data_ptr(), row.data_ptr(), col.data_ptr(), var.data_ptr(),
            len(params), (ctypes.c_int64 * len(desc))(*desc),
            (ctypes.c_double * len(flat_hyper))(*flat_hyper), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("the Adafactor C kernel could not allocate its scratch (up to 768 "
                          "bytes per matrix column)")
