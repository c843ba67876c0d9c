"""The distributed paths on CUDA (skipped without a GPU): gradient syncs over NCCL and the FSDP2
backend with its pinned CPU offload.

One GPU cannot hold two NCCL ranks (NCCL refuses two ranks on one device), so these tests run
a one-rank group of the backend the trainer uses where CUDA exists (`cpu:gloo,cuda:nccl`):
every collective on a CUDA tensor still goes through NCCL, a one-rank sync must leave the step
the plain engine takes, and top-k must still keep what it did not send."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.distributed.comm import Comm
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.delayed import DelayedSync
from tierlm.distributed.sync import DenseSync
from tierlm.distributed.topk import TopKSync
from tierlm.distributed.world import World
from tierlm.memory.layout import FlatLayout
from tierlm.memory.ledger import Ledger
from tierlm.runtime import EngineOptions, build_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda") if torch.cuda.is_available() else None
MODEL = "llama_tied_gqa"
LR = 1e-2


@pytest.fixture(scope="module")
def world():
    w = World()
    w.ensure_group()  # one rank; NCCL for CUDA tensors, gloo for host ones
    assert "nccl" in str(dist.get_backend())
    yield w
    w.close()


@pytest.fixture
def collective_devices(monkeypatch):
    """The device of every tensor handed to all_reduce / all_gather_into_tensor."""
    seen: list[str] = []
    for name in ("all_reduce", "all_gather_into_tensor"):
        real = getattr(dist, name)

        def spy(*args, _real=real, **kwargs):
            seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    return seen


def _engine(model, policy, tmp, **sync):
    return build_engine(
        model, OPTIM,
        EngineOptions(policy=policy, micro_batches=2, batch_size=2, seq_len=16,
                      offload_dir=str(tmp), **sync),
        device=DEV,
    )


def _run(step, steps):
    losses = [step.step(b, LR)["loss"] for b in steps]
    weights = {k: v.float().cpu() for k, v in step.weights().items()}
    step.close()
    return losses, weights


@pytest.mark.parametrize("policy", ["none", "host"])
@pytest.mark.parametrize("sync", [DenseSync(), TopKSync(ratio=1.0, overrides=()),
                                  DelayedSync(every=2)], ids=["dense", "topk1", "delayed2"])
def test_one_rank_syncs_leave_the_plain_step(world, collective_devices, sync, policy, tmp_path):
    base = tiny_model(MODEL, layers=3)
    steps = batches(4, 2)
    ref_losses, ref_w = _run(_engine(copy.deepcopy(base), policy, tmp_path / "plain"), steps)
    comm = Comm(world.size, Ledger())
    strategy = sync.build(comm)
    engine = _engine(copy.deepcopy(base), policy, tmp_path / "dp", grad_sync=strategy)
    comm.ledger = engine.ledger
    losses, w = _run(DataParallelStep(engine, strategy, world, comm), steps)
    # CUDA reductions (atomics in embedding backward) are not bitwise reproducible
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, v in ref_w.items():
        assert (w[n] - v).abs().max().item() < 1e-4, n
    if isinstance(sync, DelayedSync):
        assert collective_devices  # the weights were averaged (over one rank)
    else:  # gradients of device-resident segments go through NCCL; host-tier ones through gloo
        assert ("cuda" if policy == "none" else "cpu") in collective_devices


@pytest.mark.parametrize("feedback", ["residual", "ef21"])
def test_topk_on_cuda_keeps_what_it_did_not_send(world, collective_devices, feedback):
    layout = FlatLayout([("a.weight", (40, 10), True), ("b.weight", (100,), False)])
    sync = TopKSync(ratio=0.1, overrides=(("b", 1.0),), feedback=feedback)
    topk = sync.build(Comm(world.size, Ledger()))
    gen = torch.Generator(device=DEV).manual_seed(0)
    n_a = 400  # a: 40 of 400 entries sent; b: dense by override
    for _ in range(3):
        g = torch.randn(layout.numel, device=DEV, generator=gen)
        if feedback == "residual":
            before = topk.state.get("residual", {}).get("seg", torch.zeros_like(g)).clone()
            acc = g + before
        else:
            before = topk.state.get("estimate", {}).get("seg", torch.zeros_like(g)).clone()
            acc = g - before  # ef21 sends the change since the estimate
        grad = g.clone()
        topk.start("seg", grad, layout.slots).wait()
        topk.after_step(None, skipped=False)
        if feedback == "residual":
            sent = acc - topk.state["residual"]["seg"]
            assert torch.equal(grad[:n_a], sent[:n_a])  # one rank: the mean is what it sent
        else:
            sent = topk.state["estimate"]["seg"] - before
            assert torch.equal(grad, topk.state["estimate"]["seg"])
        nz = sent[:n_a].nonzero().flatten()
        assert len(nz) == 40
        assert torch.equal(sent[nz], acc[nz])  # sent whole ...
        rest = torch.ones(n_a, dtype=torch.bool, device=DEV)
        rest[nz] = False
        assert acc[nz].abs().min() >= acc[:n_a][rest].abs().max()  # ... and the top-k
        torch.testing.assert_close(grad[n_a:], g[n_a:], rtol=0, atol=0)  # dense part: exact
    assert "cuda" in collective_devices


@pytest.mark.parametrize("cpu_offload", [False, True])
def test_fsdp_on_cuda_matches_the_reference_and_resumes(world, cpu_offload, tmp_path):
    from tierlm.checkpoint import TrainState, load_checkpoint, save_sharded_checkpoint
    from tierlm.distributed.fsdp import FSDPStep
    from tierlm.runtime.reference import ReferenceStep

    base = tiny_model(MODEL, layers=3)
    steps = batches(5, 2)
    ref = ReferenceStep(copy.deepcopy(base).to(DEV), OPTIM, grad_clip=1.0, device=DEV)
    ref_losses = [ref.step(b, LR)["loss"] for b in steps]
    ref_w = {k: v.detach().float().cpu() for k, v in ref.model.named_parameters()}

    def build():
        return FSDPStep(copy.deepcopy(base), OPTIM, grad_clip=1.0, device=DEV, world=world,
                        comm=Comm(world.size, Ledger()), precision="fp32",
                        cpu_offload=cpu_offload)

    fsdp = build()
    losses = []
    for i, b in enumerate(steps):
        losses.append(fsdp.step(b, LR)["loss"])
        if i == 2:
            ckpt = save_sharded_checkpoint(
                tmp_path, fsdp, world, model_config=fsdp.model.config, tokenizer=None,
                state=TrainState(step=3, sampler={}, run_config={}), keep=1)
    w = {k: v.float().cpu() for k, v in fsdp.weights().items()}
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, v in ref_w.items():
        assert (w[n] - v).abs().max().item() < 1e-4, n

    weights, optim, _ = load_checkpoint(ckpt)
    resumed = build()
    resumed.load(weights, optim)
    assert [resumed.step(b, LR)["loss"] for b in steps[3:]] == pytest.approx(losses[3:],
                                                                              rel=1e-5)
