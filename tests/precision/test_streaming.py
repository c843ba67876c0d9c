"""Device copies in compute precision (tierlm.precision.streaming): a streamed or resident block
whose state is off the device holds its compute copy on the device (bf16, E4M3 + scales, fp32
norms) and the matmuls read it, with the losses and weights of computing from fp32 copies."""

from __future__ import annotations

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.config import PrecisionConfig
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.precision import PrecisionLinear, prepare_precision
from tierlm.precision.linear import Fp8Linear
from tierlm.precision.matmul import ScaledMM
from tierlm.precision.streaming import ComputeCopies
from tierlm.runtime import EngineOptions, build_engine

CPU = torch.device("cpu")
ON_DEVICE = SegmentPlacement(resident=True, state_tier=Tier.DEVICE)


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def run(tmp_path, mode: str, order: str, m: int, *, copies: bool, tier: Tier = Tier.HOST,
        name: str = "llama_untied", kernel: bool = False, steps: int = 2):
    """3 blocks: block 0 resident with host state (keeps its graph), blocks 1-2 streamed from
    `tier`; embed and head on the device. `copies=False` computes from fp32 copies of the
    masters, the numbers the fp32 device slots gave before compute-precision slots."""
    model = tiny_model(name, layers=3)
    prepare_precision(model, PrecisionConfig(mode=mode), mode, CPU, log=lambda _m: None)
    if kernel:  # the path a GPU with fp8 units takes: torch._scaled_mm on the stored E4M3
        for mod in model.modules():
            if isinstance(mod, PrecisionLinear) and isinstance(mod.compute, Fp8Linear):
                mod.compute.mm = ScaledMM()
    resident = SegmentPlacement(resident=True, state_tier=Tier.HOST)
    streamed = SegmentPlacement(resident=False, state_tier=tier)
    opts = EngineOptions(
        policy="tiered", offload_dir=str(tmp_path / f"{mode}-{order}-{m}-{copies}"),
        batch_size=2, seq_len=16, micro_batches=m, microbatch_order=order,
        placements=[ON_DEVICE, resident, streamed, streamed, ON_DEVICE], autocast=bf16_autocast,
    )
    choose = ComputeCopies.choose_format
    if not copies:
        ComputeCopies.choose_format = lambda self, st: None
    try:
        engine = build_engine(model, OPTIM, opts, device=CPU)
    finally:
        ComputeCopies.choose_format = choose
    losses = [engine.step(b, 1e-2)["loss"] for b in batches(steps, m)]
    return engine, losses, engine.weights()


def assert_same(a, b) -> None:
    (_, losses_a, weights_a), (_, losses_b, weights_b) = a, b
    assert losses_a == losses_b
    for k, v in weights_a.items():
        assert torch.equal(v, weights_b[k]), k


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_compute_precision_slots_are_small_and_change_no_bit(tmp_path, mode, order, m):
    compact = run(tmp_path, mode, order, m, copies=True)
    fp32 = run(tmp_path, mode, order, m, copies=False)
    assert_same(compact, fp32)
    per_param = 1.1 if mode == "fp8" else 2.1
    for engine, bound in ((compact[0], per_param), (fp32[0], 4.0)):
        blocks = engine.states[1:4]
        numel = blocks[0].numel
        scales = 4 * (blocks[0].compute_format.n_scales if blocks[0].compute_format else 0)
        resident = blocks[0].device_nbytes()
        peak = engine.ledger.peak_class_bytes[(Tier.DEVICE, TensorClass.COMPUTE)]
        # the resident block's copy, and at most two stream slots (one block each)
        assert resident <= bound * numel + scales
        assert peak - resident <= 2 * (bound * numel + scales)
        assert peak - resident >= 2 * blocks[1].device_nbytes()  # both slots were used
        engine.close()
    assert fp32[0].states[1].device_nbytes() == 4 * fp32[0].states[1].numel


def test_gpt2_transposed_weights_and_bf16_biases(tmp_path):
    """GPT-2's Conv1D weights are stored transposed and its biases cross in bf16; evaluation
    reads the slots too."""
    for mode in ("bf16", "fp8"):
        a = run(tmp_path, mode, "layer-outer", 2, copies=True, name="gpt2")
        b = run(tmp_path, mode, "layer-outer", 2, copies=False, name="gpt2")
        assert_same(a, b)
        assert "bf16" in a[0].states[2].compute_format.kinds
        held_out = batches(1, 1, seed=7)[0][0]  # evaluation streams the same slots
        assert a[0].eval_loss(held_out) == b[0].eval_loss(held_out)
        a[0].close(), b[0].close()


def test_fp8_kernel_reads_the_stored_e4m3(tmp_path):
    """torch._scaled_mm (on the CPU here) on the stored E4M3 and its scale gives what it gives
    on E4M3 quantised from the fp32 copy."""
    a = run(tmp_path, "fp8", "microbatch-outer", 1, copies=True, kernel=True)
    b = run(tmp_path, "fp8", "microbatch-outer", 1, copies=False, kernel=True)
    assert_same(a, b)
    a[0].close(), b[0].close()


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
def test_disk_tier_streams_its_compute_file(tmp_path, mode):
    compact = run(tmp_path, mode, "layer-outer", 2, copies=True, tier=Tier.DISK, steps=3)
    fp32 = run(tmp_path, mode, "layer-outer", 2, copies=False, tier=Tier.DISK, steps=3)
    assert_same(compact, fp32)
    engine = compact[0]
    st = engine.states[2]
    path = engine.store.disk.path(st.file("compute"))
    assert path.stat().st_size >= st.compute_format.nbytes
    assert engine.ledger.current_bytes[(Tier.DISK, TensorClass.COMPUTE)] == 2 * st.device_nbytes()
    assert engine.ledger.current_bytes[(Tier.HOST, TensorClass.COMPUTE)] > 0  # block 0 only
    # what the stream reads: the compute file instead of the fp32 master
    read = [e.ledger.total_moved_bytes[Link.DISK_READ] for e, _, _ in (compact, fp32)]
    fetches = engine.cache.loads  # of the two disk blocks, over the three steps
    assert fetches == fp32[0].cache.loads >= 2 * 3  # each block at least once a step
    encode = 2 * 4 * st.numel  # setup reads each master once to encode its copy
    assert read[1] - read[0] == fetches * (4 * st.numel - st.compute_format.nbytes) - encode
    for e in (compact, fp32):
        e[0].close()
