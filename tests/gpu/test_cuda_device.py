"""`CudaDevice`'s own measurements (skipped without a GPU): a wait the compute stream makes on a
copy is timed on the device, so the step's split counts what the host never sees."""

import pytest
import torch

from tierlm.memory.device import CudaDevice
from tierlm.memory.tiers import Link

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_device_side_wait_on_a_copy_is_measured_and_a_passed_one_is_not():
    dev = CudaDevice(torch.device("cuda"))
    src = torch.ones(64 * 2**20, dtype=torch.uint8).pin_memory()  # 64 MiB: milliseconds on PCIe
    dst = torch.empty_like(src, device="cuda")
    done = dev.copy(dst, src, Link.H2D, "upload", after=())
    dev.wait(done, "upload")  # compute queues behind the copy: it stalls on the device
    total = int(dst.sum())  # the host learns of it only here
    dev.synchronize()
    assert total == src.numel()
    stalled = dev.take_wait_s()
    copy_s = dev.take_link_s()[Link.H2D]
    assert 0 < stalled <= copy_s * 1.5  # (nothing ran before the wait: the stall is the copy)
    assert dev.take_wait_s() == 0.0  # taken once
    dev.wait(done, "again")  # already passed: compute does not stall
    dev.synchronize()
    assert dev.take_wait_s() < stalled
