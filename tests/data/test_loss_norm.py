"""The step's loss is the mean over every trained token of the step (tierlm.data.batch): with
loss masks of different lengths, M micro-batches, or W ranks, give the loss, the gradient and
so the weights of one batch of the same examples in one process.

The optimizer here is AdamW with eps 1: its first update, lr * g / (|g| + 1) per entry, is
one-to-one in the gradient, so weights after a step compare the gradients themselves (with the
usual eps the first step is lr * sign(g) and would hide a gradient weighted wrongly). The
micro-batches' trained-token counts differ several-fold: a mean of micro-batch means (or of
rank means) weighs the tokens of a short answer more than those of a long one, and moves the
weights by far more than the fp32 tolerance.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.distributed.test_distributed import run_ranks
from tests.runtime_helpers import OPTIM, VOCAB, tiny_model
from tierlm.distributed.comm import Comm
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.delayed import DelayedSync
from tierlm.distributed.sync import DenseSync
from tierlm.distributed.world import World
from tierlm.memory.ledger import Ledger
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.reference import ReferenceStep

CPU = torch.device("cpu")
MODEL, T = "llama_tied_gqa", 16
OPTIM_1 = dataclasses.replace(OPTIM, lr=0.1, eps=1.0)  # see the module docstring
# trained targets per row: micro-batches of two rows hold 3, 11 and 28 targets
COUNTS = (1, 2, 3, 8, 12, 16)


def _rows(counts, seed: int = 0) -> torch.Tensor:
    """(len(counts), 2, T+1) rows of random ids whose labels train `counts[i]` random targets
    of row i (tierlm.data.batch's masked layout)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(counts), T + 1), generator=g)
    trained = torch.zeros_like(ids, dtype=torch.bool)
    for i, k in enumerate(counts):
        trained[i, 1 + torch.randperm(T, generator=g)[:k]] = True
    return torch.stack([ids, ids.masked_fill(~trained, -100)], dim=1)


def _hand_loss(model, rows: torch.Tensor) -> float:
    """Summed token loss of every trained target over their count, by hand."""
    with torch.no_grad():
        logits = model(input_ids=rows[:, 0, :-1]).logits.float()  # (B, T, V)
    labels = rows[:, 1, 1:]
    mask = labels != -100
    logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return float(-logp[mask].sum() / mask.sum())


def _assert_same(a: dict, b: dict, wa: dict, wb: dict, where: str) -> None:
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), where
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), where
    for k, v in wb.items():
        diff = (wa[k] - v).abs().max().item()
        assert diff <= 1e-6, f"{where}: {k}: max abs diff {diff}"


@pytest.fixture(scope="module")
def one_batch():
    """The reference trainer's step on all rows as one batch, and the hand-computed loss."""
    model = tiny_model(MODEL)
    rows = _rows(COUNTS)
    want = _hand_loss(model, rows)
    ref = ReferenceStep(copy.deepcopy(model), OPTIM_1, grad_clip=0.0, device=CPU)
    out = ref.step([rows], OPTIM_1.lr)
    assert out["loss"] == pytest.approx(want, rel=1e-6)
    return model, rows, out, ref.weights()


def test_reference_micro_batches_equal_one_batch(one_batch):
    model, rows, want, weights = one_batch
    ref = ReferenceStep(copy.deepcopy(model), OPTIM_1, grad_clip=0.0, device=CPU)
    out = ref.step(list(rows.split(2)), OPTIM_1.lr)  # 3, 11 and 28 trained targets
    _assert_same(out, want, ref.weights(), weights, "reference, 3 micro-batches")


@pytest.mark.parametrize(("policy", "order", "chunk"), [
    ("host", "microbatch-outer", None), ("disk", "layer-outer", 5), ("none", "microbatch-outer",
                                                                      7)])
def test_engine_micro_batches_equal_one_batch(one_batch, tmp_path, policy, order, chunk):
    """The tiered engine (state offloaded, both micro-batch orders, loss chunks that cut rows)
    over 3 micro-batches against the reference's one batch."""
    model, rows, want, weights = one_batch
    eng = build_engine(copy.deepcopy(model), OPTIM_1, EngineOptions(
        policy=policy, offload_dir=str(tmp_path), batch_size=2, seq_len=T, micro_batches=3,
        microbatch_order=order, grad_clip=0.0, loss_chunk_tokens=chunk,
    ), device=CPU)
    out = eng.step(list(rows.split(2)), OPTIM_1.lr)
    _assert_same(out, want, eng.weights(), weights, f"engine {policy} {order}")
    eng.close()


# -- data parallel: W ranks equal one process with every row ----

RANK_COUNTS = ((1, 2, 3, 4), (8, 12, 16, 16))  # rank 0's rows train few targets, rank 1's many


def _dp_rows() -> list[torch.Tensor]:
    return [_rows(c, seed=r) for r, c in enumerate(RANK_COUNTS)]


def _dp_run(world: World, sync, policy: str, tmp: str) -> dict:
    comm = Comm(world.size, Ledger())
    strategy = sync.build(comm)
    engine = build_engine(tiny_model(MODEL), OPTIM_1, EngineOptions(
        policy=policy, grad_sync=strategy, batch_size=2, seq_len=T, micro_batches=2,
        grad_clip=0.0, offload_dir=f"{tmp}/rank{world.rank}"), device=CPU)
    comm.ledger = engine.ledger
    dp = DataParallelStep(engine, strategy, world, comm)
    out = dp.step(list(_dp_rows()[world.rank].split(2)), OPTIM_1.lr)  # two micro-batches
    result = {"loss": out["loss"], "grad_norm": out["grad_norm"],
              "weights": {k: v.numpy().copy() for k, v in dp.weights().items()}}
    dp.close()
    return result


def _fsdp_run(world: World) -> dict:
    from tierlm.distributed.fsdp import FSDPStep

    step = FSDPStep(tiny_model(MODEL), OPTIM_1, grad_clip=0.0, device=CPU, world=world,
                    comm=Comm(world.size, Ledger()), precision="fp32", cpu_offload=False)
    out = step.step(list(_dp_rows()[world.rank].split(2)), OPTIM_1.lr)
    return {"loss": out["loss"], "grad_norm": out["grad_norm"],
            "weights": {k: v.numpy().copy() for k, v in step.weights().items()}}


def _ranks_main(world: World, tmp: str) -> dict:
    return {"dense-host": _dp_run(world, DenseSync(), "host", tmp),
            "delayed": _dp_run(world, DelayedSync(every=8), "none", tmp),
            "fsdp": _fsdp_run(world)}


def test_two_ranks_equal_one_process_with_every_row(tmp_path):
    """Dense sync on the tiered engine (host placement) and FSDP2: 2 ranks x 2 micro-batches
    with 10 and 52 trained targets equal one process on all 8 rows as one batch. Delayed sync
    steps each rank on its own rows (its own mean); its logged loss is still the world's
    token-weighted mean."""
    model = tiny_model(MODEL)
    parts = _dp_rows()
    rows = torch.cat(parts)
    ref = ReferenceStep(copy.deepcopy(model), OPTIM_1, grad_clip=0.0, device=CPU)
    want = ref.step([rows], OPTIM_1.lr)
    weights = ref.weights()
    alone = []  # delayed: each rank's step is one process's on its own rows
    for part in parts:
        own = ReferenceStep(copy.deepcopy(model), OPTIM_1, grad_clip=0.0, device=CPU)
        own.step([part], OPTIM_1.lr)
        alone.append(own.weights())
    ranks = run_ranks(lambda w: _ranks_main(w, str(tmp_path)))
    for r, run in enumerate(ranks):
        for name in ("dense-host", "fsdp"):
            got = {k: torch.from_numpy(v) for k, v in run[name]["weights"].items()}
            _assert_same(run[name], want, got, weights, f"rank {r} {name}")
        assert run["delayed"]["loss"] == pytest.approx(want["loss"], rel=1e-6)
        got = {k: torch.from_numpy(v) for k, v in run["delayed"]["weights"].items()}
        for k, v in alone[r].items():
            assert (got[k] - v).abs().max().item() <= 1e-6, f"rank {r} delayed: {k}"


# -- context parallel: each rank holds a zig-zag share of every row ----

CP_COUNTS = (1, 2, 12, 16)  # two micro-batches of two rows: 3 and 28 trained targets


def _cp_main(world: World) -> dict:
    from tierlm.distributed.context import (
        ContextLayout,
        ZigzagShare,
        build_ring,
        use_ring_attention,
    )
    from tierlm.distributed.context_step import ContextParallelStep

    micro = list(_rows(CP_COUNTS).split(2))
    out = {}
    layout = ContextLayout(world.rank, world.size, world.size)  # one row group of cp ranks
    step = ContextParallelStep(
        ReferenceStep(tiny_model(MODEL), OPTIM_1, grad_clip=0.0, device=CPU), layout,
        build_ring(layout))
    rec = step.step(micro, OPTIM_1.lr)
    out["reference"] = {"loss": rec["loss"], "grad_norm": rec["grad_norm"],
                        "weights": {k: v.numpy().copy() for k, v in step.weights().items()}}
    comm = Comm(world.size, Ledger())
    sync = DenseSync().build(comm)
    ring = build_ring(layout)
    engine = build_engine(tiny_model(MODEL), OPTIM_1, EngineOptions(
        policy="host", grad_sync=sync, batch_size=2, seq_len=T, micro_batches=2, grad_clip=0.0,
        sequence_share=ZigzagShare(layout, ring)), device=CPU)
    use_ring_attention(engine.adapter.model)
    comm.ledger = ring.ledger = engine.ledger
    dp = DataParallelStep(engine, sync, world, comm)
    rec = dp.step(micro, OPTIM_1.lr)
    out["engine"] = {"loss": rec["loss"], "grad_norm": rec["grad_norm"],
                     "weights": {k: v.numpy().copy() for k, v in dp.weights().items()}}
    dp.close()
    return out


def test_context_parallel_micro_batches_equal_one_batch():
    """CP 2 on the reference step and on the tiered engine (host placement): two masked
    micro-batches of 3 and 28 trained targets, each row split between the ranks, equal one
    process on the four whole rows as one batch."""
    model = tiny_model(MODEL)
    ref = ReferenceStep(copy.deepcopy(model), OPTIM_1, grad_clip=0.0, device=CPU)
    want = ref.step([_rows(CP_COUNTS)], OPTIM_1.lr)
    weights = ref.weights()
    for r, run in enumerate(run_ranks(_cp_main)):
        for name, got in run.items():
            got_w = {k: torch.from_numpy(v) for k, v in got["weights"].items()}
            # the ring sums attention blocks in another order: fp32 rounding, as in
            # tests/distributed/test_context_parallel.py
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (r, name)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), (r, name)
            for k, v in weights.items():
                diff = (got_w[k] - v).abs().max().item()
                assert diff <= 1e-5, f"rank {r} {name}: {k}: max abs diff {diff}"
