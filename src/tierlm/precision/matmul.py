"""The fp8 matmul: `torch._scaled_mm` where the build and device run it, else an emulation that
dequantises both operands to fp32 and multiplies (the same result up to fp32 rounding, without
the speed). Which one a run uses is decided once, at setup, by trying the kernel on the device.

Both compute `(a8 / sa) @ (b8 / sb)` with fp32 accumulation for a (M, K) and b (K, N); `a_inv`,
`b_inv` are the reciprocal scales (0-dim fp32 tensors). Each backend also says how a scaled
tensor becomes its fp8 operand (`cast`): the kernel takes fp8 tensors; the emulation keeps the
fp8 values in fp32 (the same numbers, computed without the fp8 dtype) so nothing is decoded
per matmul; the forward's operands are saved for the backward in that form.

On the CPU, torch's own `_scaled_mm` decodes both operands on every call (a slow scalar
conversion) and runs an fp32 GEMM, so the emulation computes the same numbers faster there
(bench/fp8_matmul.py); the kernel is used where fp8 units exist (CUDA sm_89+).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tierlm.precision.formats import E4M3, Fp8Format, to_fp8, to_fp8_grid

KERNEL_MULTIPLE = 16  # CUDA's fp8 GEMMs need every dimension divisible by 16


class Fp8Matmul(Protocol):
    name: str
    cast: Callable[[torch.Tensor, Fp8Format], torch.Tensor]

    def __call__(
        self, a8: torch.Tensor, b8: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor: ...


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 else t.t().contiguous().t()


class ScaledMM:
    """`torch._scaled_mm`: the first operand row-major, the second column-major. The inner
    dimension is padded with zeros to a multiple of 16 where it is not (the weight gradient's
    inner dimension is the token count); zeros add nothing to the product."""

    name = "scaled_mm"
    cast = staticmethod(to_fp8)

    def __call__(self, a8, b8, a_inv, b_inv, out_dtype):
        k = a8.shape[1]
        pad = -k % KERNEL_MULTIPLE
        if pad:  # fp8 zero is the all-zero byte in both formats
            zeros = torch.zeros(max(a8.shape[0], b8.shape[1]), pad, dtype=torch.uint8,
                                device=a8.device)
            a8 = torch.cat([a8.view(torch.uint8), zeros[: a8.shape[0]]], 1).view(a8.dtype)
            b8 = torch.cat([b8.view(torch.uint8), zeros[: b8.shape[1]].t()], 0).view(b8.dtype)
        return torch._scaled_mm(
            _row_major(a8), _col_major(b8), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype
        )


class Emulated:
    """fp8 values held in fp32, multiplied in fp32: for devices without fp8 kernels. Every fp8
    value and every product of two is exact in fp32, and the power-of-two scales (scaling.py)
    are applied to the product exactly, so this differs from an fp8 GEMM only in summation
    order."""

    name = "emulated"
    cast = staticmethod(to_fp8_grid)

    def __call__(self, a8, b8, a_inv, b_inv, out_dtype):
        # not in place: selective checkpointing caches the matmul's output for the backward's
        # re-run, and a cached tensor must not change after it is stored
        return torch.mul(a8 @ b8, a_inv * b_inv).to(out_dtype)


def scaled_mm_works(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs on `device` (CPU builds of torch >= 2.5 and CUDA sm_89+
    do; older GPUs raise)."""
    n = KERNEL_MULTIPLE
    try:
        a = torch.ones(n, n, device=device).to(E4M3.dtype)
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return bool(out[0, 0].item() == n)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def emulation_note(device: torch.device, emulate: bool) -> str:
    """The line a run under the emulation prints: it checks fp8 numerics, it does not speed
    anything up (an fp32 GEMM plus the casts: slower than bf16)."""
    if emulate:
        why = "--fp8-emulate"
    elif device.type != "cuda":
        why = f"device {device.type} has no fp8 units"
    else:
        why = (f"{torch.cuda.get_device_name(device)} has no fp8 units torch._scaled_mm runs "
               "on")
    return (f"precision: fp8 is emulated ({why}): the fp8 values are multiplied in fp32, a "
            "check of fp8 numerics with no speed-up (slower than bf16)")


def select_matmul(device: torch.device, emulate: bool) -> Fp8Matmul:
    """The kernel where the device has fp8 units and the build runs it, else the emulation."""
    if emulate or device.type != "cuda" or not scaled_mm_works(device):
        return Emulated()
    return ScaledMM()
