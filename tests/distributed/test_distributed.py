"""Data parallel and FSDP2 on gloo with 2 processes (forked from pytest: no re-import cost).

Each test runs a function on two ranks and compares what they return with each other and with
the single-process reference trainer (tests/runtime_helpers.py) on the same global batches:
2 ranks x micro-batch b against 1 process x micro-batch 2b.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import multiprocessing as mp
import os
import socket
import traceback

import numpy as np
import pytest
import torch

from tests.runtime_helpers import OPTIM, assert_close_run, batches, tiny_model
from tierlm.config import ConfigError
from tierlm.distributed.comm import Comm
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.delayed import DelayedSync
from tierlm.distributed.setup import RankSlice
from tierlm.distributed.sync import DenseSync
from tierlm.distributed.topk import TopKSync
from tierlm.distributed.world import World
from tierlm.memory.layout import FlatLayout
from tierlm.memory.ledger import Ledger
from tierlm.memory.tiers import Link
from tierlm.plan.timing import grad_sync_bytes
from tierlm.runtime import Engine, EngineOptions, build_engine
from tierlm.runtime.shapes import ModelShape, TrainShape

MODEL = "llama_tied_gqa"  # tied embeddings: the head's gradient joins the owner's before sync
STEPS, M, B_GLOBAL, T = 4, 2, 4, 16
LR = 1e-2
# Two ranks sum their halves of the batch in another order than one process sums all of it, so
# gradients agree to fp32 rounding, not bitwise. AdamW's first steps move each weight by about
# lr * g / (|g| + eps): with the usual eps an entry whose gradient is itself at rounding level
# (cancelling contributions) moves by up to lr either way. A larger eps keeps the optimizer
# from amplifying rounding, so the comparison sees what the sync computes.
OPTIM = dataclasses.replace(OPTIM, eps=1e-3)


# -- running a function on 2 ranks ----

def _rank_main(fn, rank: int, world: int, port: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share the machine's cores
    w = None
    try:
        w = World.from_env(timeout_s=60)  # short: a rank that fails must not hang the other
        queue.put((rank, True, fn(w)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if w is not None:
            w.close()


def run_ranks(fn, world: int = 2, timeout_s: float = 900.0) -> list:
    """`fn(world)` on `world` forked ranks; `timeout_s` guards against a hang, not a duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


# -- pieces the ranks use ----

def _global_batches(steps: int = STEPS):
    return batches(steps, M, b=B_GLOBAL, t=T)


def _mine(world: World, step_batches):
    return [b.tensor_split(world.size)[world.rank] for b in step_batches]


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(weights[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def _numpy(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in weights.items()}


def _dp(world: World, sync, policy: str = "none", tmp: str | None = None) -> DataParallelStep:
    comm = Comm(world.size, Ledger())
    strategy = sync.build(comm)
    engine = build_engine(
        tiny_model(MODEL), OPTIM,
        EngineOptions(policy=policy, grad_sync=strategy, batch_size=B_GLOBAL // world.size,
                      seq_len=T, micro_batches=M,
                      offload_dir=f"{tmp}/rank{world.rank}" if tmp else None),
        device=torch.device("cpu"),
    )
    comm.ledger = engine.ledger
    return DataParallelStep(engine, strategy, world, comm)


def _train(world: World, sync, policy: str = "none", steps: int = STEPS, tmp=None) -> dict:
    dp = _dp(world, sync, policy, tmp)
    losses, digests, sent = [], [], []
    for step_batches in _global_batches(steps):
        out = dp.step(_mine(world, step_batches), LR)
        losses.append(out["loss"])
        digests.append(_digest(dp.weights()))
        sent.append(dp.ledger.moved_bytes[Link.NET_SEND])
    result = {"losses": losses, "digests": digests, "sent": sent,
              "weights": _numpy(dp.weights())}
    dp.close()
    return result


def reference_run(model, steps, lrs, clip: float):
    from tierlm.runtime.reference import ReferenceStep

    ref = ReferenceStep(model, OPTIM, grad_clip=clip, device=torch.device("cpu"))
    out = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    return out, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    out, weights = reference_run(tiny_model(MODEL), _global_batches(), [LR] * STEPS, clip=1.0)
    return [o["loss"] for o in out], weights


def _as_torch(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in weights.items()}


# What one rank sends per step besides its strategy's bytes (the same counter carries both), an
# all-reduce of n bytes sending 2 (W-1)/W x n = n at W = 2: the logged loss (the summed token
# loss and the trained tokens, two float64), and under a sync that averages gradients (dense,
# top-k) the step's trained-token count (one int64) that the loss is divided by.
LOSS_SENT = 16
LOSS_MEAN_SENT = LOSS_SENT + 8


def _dense_sent() -> int:
    """A dense sync's bytes per rank and step: every fp32 gradient all-reduced once (a ring
    all-reduce over W ranks sends 2 (W-1)/W of the payload: the payload itself at W = 2); tied
    weights once."""
    return 4 * sum(p.numel() for p in tiny_model(MODEL).parameters())


def _planned_sent(sync) -> float:
    """The planner's count of what one of 2 ranks sends per step to sync (on average)."""
    shape = ModelShape.from_config(tiny_model(MODEL).config, optim=OPTIM)
    return grad_sync_bytes(shape, TrainShape(B_GLOBAL // 2, T, M, nproc=2, grad_sync=sync))


# -- data: each rank its slice of the global batch ----

def test_a_verdict_from_one_rank_reaches_every_rank():
    """A non-finite FSDP shard on one rank must stop the save on all (it is collective)."""
    verdicts = run_ranks(lambda w: (w.all_agree(True), w.all_agree(w.rank == 0)))
    assert verdicts == [(True, False), (True, False)]


def test_rank_slices_make_up_the_single_process_batch():
    from tierlm.data import BatchSampler, PackedSequences

    seqs = PackedSequences(torch.arange(2000), 16, "test")
    one = BatchSampler(seqs, 8, seed=3)
    ranks = [RankSlice(BatchSampler(seqs, 8, seed=3), World(rank=r, size=2)) for r in range(2)]
    for _ in range(5):
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (4, 17) for p in parts)
        assert torch.equal(torch.cat(parts), one.next_batch())
    assert ranks[1].state_dict() == one.state_dict()


# -- dense ----

def _dense_runs(world: World, tmp: str) -> dict:
    return {
        "none": _train(world, DenseSync()),
        "host": _train(world, DenseSync(), policy="host", tmp=tmp),
    }


def test_dense_two_ranks_equal_one_process_with_twice_the_batch(reference, tmp_path):
    ref_losses, ref_weights = reference
    ranks = run_ranks(lambda w: _dense_runs(w, str(tmp_path)))
    for policy in ("none", "host"):  # everything resident; state (and the sync) in host RAM
        r0, r1 = ranks[0][policy], ranks[1][policy]
        assert r0["digests"] == r1["digests"], f"{policy}: ranks differ after a sync"
        assert r0["losses"] == r1["losses"]
        assert_close_run(r0["losses"], ref_losses, _as_torch(r0["weights"]), ref_weights,
                         rel=1e-6, atol=1e-6)
        assert r0["sent"] == [_dense_sent() + LOSS_MEAN_SENT] * STEPS
        assert r0["sent"] == [_planned_sent(DenseSync()) + LOSS_MEAN_SENT] * STEPS


# -- masked (fine-tuning) batches ----

def _masked(step_batches, every_second_half: int = 2):
    """Each (B, T+1) batch with labels masking all but every other target (the second half of
    the rows: every `every_second_half`-th). With equal counts per half, two ranks' step means
    make the one-process mean; evaluation weighs each rank's mean by its trained count."""
    out = []
    for b in step_batches:
        trained = torch.zeros_like(b, dtype=torch.bool)
        half = b.shape[0] // 2
        trained[:half, 1::2] = True
        trained[half:, 1::every_second_half] = True
        out.append(torch.stack([b, b.masked_fill(~trained, -100)], dim=1))  # (B, 2, T+1)
    return out


def _masked_runs(world: World) -> dict:
    dp = _dp(world, DenseSync())
    steps = [_masked(s) for s in _global_batches(2)]
    evals = [dp.eval_loss(b) for b in _masked(_global_batches(1)[0], 5)]
    losses = [dp.step(_mine(world, s), LR)["loss"] for s in steps]
    result = {"losses": losses, "evals": evals, "weights": _numpy(dp.weights())}
    dp.close()
    return result


def test_masked_batches_two_ranks_equal_one_process():
    from tierlm.runtime.reference import ReferenceStep

    steps = [_masked(s) for s in _global_batches(2)]
    ref = ReferenceStep(tiny_model(MODEL), OPTIM, grad_clip=1.0, device=torch.device("cpu"))
    evals = [ref.eval_loss(b) for b in _masked(_global_batches(1)[0], 5)]
    losses = [ref.step(s, LR)["loss"] for s in steps]
    ranks = run_ranks(_masked_runs)
    for r in ranks:
        assert r["evals"] == pytest.approx(evals, rel=1e-6)
        assert_close_run(r["losses"], losses, _as_torch(r["weights"]), ref.weights(),
                         rel=1e-6, atol=1e-6)


# -- top-k ----

def _topk_runs(world: World) -> dict:
    steps = 2
    return {
        "dense": _train(world, DenseSync(), steps=steps),
        "topk_1": _train(world, TopKSync(ratio=1.0, overrides=()), steps=steps),
        "topk_005": _train(world, TopKSync(ratio=0.05, overrides=()), steps=steps),
    }


def test_topk_ratio_one_is_dense_and_005_sends_a_tenth(reference):
    ranks = run_ranks(_topk_runs)
    r0 = ranks[0]
    assert r0["topk_1"]["digests"] == r0["dense"]["digests"]  # bit for bit
    assert r0["topk_1"]["sent"] == r0["dense"]["sent"]
    for r in ranks:
        assert r["topk_005"]["digests"] == ranks[0]["topk_005"]["digests"]
    assert r0["dense"]["sent"] == [_dense_sent() + LOSS_MEAN_SENT] * 2
    # 4 B value + 4 B index per entry sent: twice the ratio of the dense bytes, a little over
    # where a parameter's 5% is rounded up to whole entries
    ratio = [(s - LOSS_MEAN_SENT) / _dense_sent() for s in r0["topk_005"]["sent"]]
    assert all(0.1 <= x < 0.1002 for x in ratio), ratio
    planned = _planned_sent(TopKSync(ratio=0.05, overrides=())) + LOSS_MEAN_SENT
    assert r0["topk_005"]["sent"] == [planned] * 2
    assert r0["dense"]["sent"] == [_planned_sent(TopKSync(ratio=1.0)) + LOSS_MEAN_SENT] * 2


def _residual_exchange(world: World) -> dict:
    """Two steps of top-k on one two-parameter segment, with known gradients per rank."""
    layout = FlatLayout([("a.weight", (40, 10), True), ("b.weight", (100,), False)])
    out = {}
    for feedback in (True, False):
        sync = TopKSync(ratio=0.1, overrides=(("b", 1.0),), error_feedback=feedback)
        topk = sync.build(Comm(world.size, Ledger()))
        gen = torch.Generator().manual_seed(world.rank)
        steps = []
        for _ in range(2):
            g = torch.randn(layout.numel, generator=gen)
            held = topk.state.get("residual", {})
            residual_before = held.get("seg", torch.zeros(layout.numel)).clone()
            grad = g.clone()
            topk.start("seg", grad, layout.slots).wait()
            topk.after_step(None, skipped=False)
            residual = topk.state.get("residual", {}).get("seg", torch.zeros(layout.numel))
            residual = residual.clone()
            steps.append({k: v.numpy() for k, v in dict(
                g=g, residual_before=residual_before, synced=grad, residual=residual).items()})
        out[feedback] = steps
    return out


def test_topk_residual_is_what_was_not_sent():
    ranks = run_ranks(_residual_exchange)
    n_a = 400  # parameter a: sparse at 0.1 -> 40 entries; b (100 entries) dense by override
    for step in range(2):
        sent, full = [], []
        for r in ranks:
            s = r[True][step]
            acc = s["g"] + s["residual_before"]  # error feedback: the residual joins the grad
            sent_r = acc - s["residual"]
            a_sent, a_acc = sent_r[:n_a], acc[:n_a]
            nz = np.flatnonzero(a_sent)
            assert len(nz) == 40
            assert np.array_equal(a_sent[nz], a_acc[nz])  # sent entries are sent whole
            assert np.abs(a_acc[nz]).min() >= np.abs(np.delete(a_acc, nz)).max()  # the top-k
            assert np.all(s["residual"][n_a:] == 0)  # the dense part leaves no residual
            sent.append(sent_r)
            full.append(acc)
        expected_a = (sent[0][:n_a] + sent[1][:n_a]) / 2
        expected_b = (full[0][n_a:] + full[1][n_a:]) / 2
        for r in ranks:
            np.testing.assert_allclose(r[True][step]["synced"][:n_a], expected_a, atol=1e-6)
            np.testing.assert_allclose(r[True][step]["synced"][n_a:], expected_b, atol=1e-6)
    assert np.any(ranks[0][True][1]["residual_before"] != 0)  # the second step used it
    for r in ranks:  # without error feedback nothing is kept
        assert not np.any(r[False][1]["residual"])


def _ef21_exchange(world: World) -> dict:
    """Top-k with ef21 feedback on one segment: 12 steps, the same gradient every step."""
    layout = FlatLayout([("a.weight", (40, 10), True), ("b.weight", (100,), False)])
    sync = TopKSync(ratio=0.1, overrides=(("b", 1.0),), feedback="ef21")
    topk = sync.build(Comm(world.size, Ledger()))
    g = torch.randn(layout.numel, generator=torch.Generator().manual_seed(world.rank))
    steps = []
    for _ in range(12):
        before = topk.state.get("estimate", {}).get("seg", torch.zeros(layout.numel)).clone()
        grad = g.clone()
        topk.start("seg", grad, layout.slots).wait()
        topk.after_step(None, skipped=False)
        steps.append({"before": before.numpy(), "synced": grad.numpy(),
                      "estimate": topk.state["estimate"]["seg"].clone().numpy()})
    return {"g": g.numpy(), "steps": steps}


def test_ef21_sends_the_change_and_steps_with_the_mean_estimate():
    ranks = run_ranks(_ef21_exchange)
    n_a = 400  # a: 40 of 400 entries per step; b: dense by override
    mean_g = (ranks[0]["g"] + ranks[1]["g"]) / 2
    for step in range(12):
        for r in ranks:
            s = r["steps"][step]
            moved = np.flatnonzero(s["estimate"][:n_a] != s["before"][:n_a])
            change = r["g"][:n_a] - s["before"][:n_a]
            assert len(moved) <= 40  # only what was sent moves the estimate ...
            assert np.array_equal(s["estimate"][moved], r["g"][moved])  # ... to the gradient
            if len(moved) == 40:  # the top-k of the change
                rest = np.delete(np.abs(change), moved)
                assert np.abs(change[moved]).min() >= rest.max()
            assert np.array_equal(s["estimate"][n_a:], r["g"][n_a:])  # dense: exact
        # every rank steps with the same gradient: the mean of the ranks' estimates
        assert np.array_equal(ranks[0]["steps"][step]["synced"], ranks[1]["steps"][step]["synced"])
        mean_est = (ranks[0]["steps"][step]["estimate"] + ranks[1]["steps"][step]["estimate"]) / 2
        np.testing.assert_allclose(ranks[0]["steps"][step]["synced"], mean_est, atol=1e-6)
    # a gradient that holds still is fully sent after 1 / ratio steps: nothing is lost
    np.testing.assert_allclose(ranks[0]["steps"][9]["synced"], mean_g, atol=1e-6)
    assert not np.allclose(ranks[0]["steps"][8]["synced"][:n_a], mean_g[:n_a], atol=1e-6)


# -- delayed ----

def test_delayed_ranks_agree_exactly_at_multiples_of_k():
    ranks = run_ranks(lambda w: _train(w, DelayedSync(every=2)))
    d0, d1 = ranks[0]["digests"], ranks[1]["digests"]
    for step, (a, b) in enumerate(zip(d0, d1, strict=True), start=1):
        assert (a == b) == (step % 2 == 0), f"step {step}"
    # bytes only when weights are averaged: the fp32 weights, all-reduced like a dense sync
    assert ranks[0]["sent"] == [LOSS_SENT, _dense_sent() + LOSS_SENT] * 2
    per_step = sum(s - LOSS_SENT for s in ranks[0]["sent"]) / STEPS
    assert _planned_sent(DelayedSync(every=2)) == per_step


def _moments_digest(engine) -> dict[str, str]:
    from tierlm.memory.tiers import Tier
    from tierlm.runtime.state import free_copies, read_copies

    engine.synchronize()
    h = {"exp_avg": hashlib.sha256(), "exp_avg_sq": hashlib.sha256()}
    for st in engine.states:
        bufs = read_copies(engine.store, st, tuple(h))
        for name in h:
            h[name].update(bufs[name].numpy().tobytes())
        if st.tier == Tier.DISK:
            free_copies(engine.store, st, bufs)
    return {name: d.hexdigest() for name, d in h.items()}


def _delayed_moments(world: World, tmp: str) -> dict:
    out = {}
    for moments, policy in (("local", "none"), ("average", "none"), ("average", "disk")):
        dp = _dp(world, DelayedSync(every=2, moments=moments), policy,
                 tmp=f"{tmp}/{moments}-{policy}")
        weights, opt, sent = [], [], []
        for step_batches in _global_batches(4):
            dp.step(_mine(world, step_batches), LR)
            weights.append(_digest(dp.weights()))
            opt.append(_moments_digest(dp.engine))
            sent.append(dp.ledger.moved_bytes[Link.NET_SEND])
        dp.close()
        out[f"{moments}-{policy}"] = {"weights": weights, "moments": opt, "sent": sent}
    return out


def test_delayed_can_average_the_adamw_moments_with_the_weights(tmp_path):
    ranks = run_ranks(lambda w: _delayed_moments(w, str(tmp_path)))
    r0, r1 = ranks
    averaged = {"local": (), "average": ("exp_avg", "exp_avg_sq")}
    for run in ("local-none", "average-none", "average-disk"):
        for step in range(4):
            synced = step % 2 == 1
            assert (r0[run]["weights"][step] == r1[run]["weights"][step]) == synced, run
            for name in ("exp_avg", "exp_avg_sq"):  # moments not averaged stay per rank
                same = r0[run]["moments"][step][name] == r1[run]["moments"][step][name]
                assert same == (synced and name in averaged[run.split("-")[0]]), (run, name)
    # the disk tier reads the moments, averages them and writes them back like resident state
    assert r0["average-disk"]["moments"] == r0["average-none"]["moments"]
    # a sync sends the fp32 weights, plus each moment in bf16 (half the weights' bytes each)
    local, average = (r0[f"{m}-none"]["sent"][1] for m in ("local", "average"))
    assert local == _dense_sent() + LOSS_SENT
    assert average - local == 2 * _dense_sent() // 2
    for m in ("local", "average"):  # every second step; the planner's mean per step
        sent = sum(s - LOSS_SENT for s in r0[f"{m}-none"]["sent"]) / 4
        assert _planned_sent(DelayedSync(every=2, moments=m)) == sent, m


# -- checkpoints: rank-local state (residuals, per-rank weights and moments) round-trips ----

def _resume(world: World, path: str, sync) -> dict:
    from pathlib import Path

    from tierlm.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from tierlm.distributed.setup import drain

    plain = _train(world, sync)
    dp = _dp(world, sync)
    all_batches = _global_batches()
    for step_batches in all_batches[:2]:
        dp.step(_mine(world, step_batches), LR)
    if world.is_main:
        ckpt = save_checkpoint(Path(path), shards=dp.state_shards(),
                               model_config=dp.engine.adapter.model.config, tokenizer=None,
                               state=TrainState(step=2, sampler={}, run_config={}))
    else:
        drain(dp.state_shards())
    dp.close()
    world.barrier()
    ckpt = world.from_main(ckpt if world.is_main else None)
    weights, optim, _ = load_checkpoint(ckpt)
    resumed = _dp(world, sync)
    resumed.load(weights, optim)
    losses = [resumed.step(_mine(world, b), LR)["loss"] for b in all_batches[2:]]
    return {"plain": plain["losses"][2:], "plain_digest": plain["digests"][-1],
            "resumed": losses, "resumed_digest": _digest(resumed.weights())}


@pytest.mark.parametrize("sync", [TopKSync(ratio=0.05, overrides=()),
                                  TopKSync(ratio=0.05, overrides=(), feedback="ef21"),
                                  DelayedSync(every=3)],
                         ids=["topk", "topk-ef21", "delayed"])
def test_resume_continues_exactly(tmp_path, sync):
    ranks = run_ranks(lambda w: _resume(w, str(tmp_path), sync))
    for r in ranks:  # delayed: saved at step 2, between syncs, so per-rank weights matter
        assert r["resumed"] == r["plain"]
        assert r["resumed_digest"] == r["plain_digest"]


def test_resume_refuses_another_world_size(tmp_path):
    dp = _dp(World.single(), TopKSync(ratio=0.05, overrides=()))
    try:
        with pytest.raises(ConfigError, match="written by 2 processes"):
            dp.load(dp.weights(), {"dp.world_size": torch.tensor(2)})
    finally:
        dp.close()


# -- FSDP2 ----

def _fsdp(world: World, path: str) -> dict:
    from pathlib import Path

    from tierlm.checkpoint import TrainState, load_checkpoint, save_sharded_checkpoint
    from tierlm.distributed.fsdp import FSDPStep

    def build():
        if world.rank == 0:
            model = tiny_model(MODEL)
        else:  # as the trainer builds it: no weights of its own, its shards come from rank 0
            with torch.device("meta"):
                model = tiny_model(MODEL, seed=1)
            assert all(p.is_meta for p in (*model.parameters(), *model.buffers()))
        return FSDPStep(model, OPTIM, grad_clip=1.0, device=torch.device("cpu"),
                        world=world, comm=Comm(world.size, Ledger()), precision="fp32",
                        cpu_offload=True)

    def save(at: int):  # collective: each rank writes its own shards; keep the newest only
        return save_sharded_checkpoint(
            Path(path), step, world, model_config=step.model.config, tokenizer=None,
            state=TrainState(step=at, sampler={}, run_config={}), keep=1)

    step = build()
    all_batches = _global_batches(5)
    losses = []
    for i, b in enumerate(all_batches):
        losses.append(step.step(_mine(world, b), LR)["loss"])
        if i == 1:
            save(2)  # pruned by the next save
        if i == 2:  # checkpoint after step 3
            ckpt = save(3)
            saved = _numpy(step.weights())
            saved_optim = _numpy(step.optimizer_state())
    final = _numpy(step.weights())
    weights, optim, _ = load_checkpoint(ckpt)
    resumed = build()
    resumed.load(weights, optim)
    loaded_optim = _numpy(resumed.optimizer_state())
    resumed_losses = [resumed.step(_mine(world, b), LR)["loss"] for b in all_batches[3:]]
    return {"losses": losses, "weights": final, "resumed": resumed_losses,
            "resumed_weights": _numpy(resumed.weights()), "ckpt": str(ckpt), "saved": saved,
            "saved_optim": saved_optim, "loaded_optim": loaded_optim}


def test_fsdp_matches_one_process_and_resumes(tmp_path):
    from pathlib import Path

    from tierlm.checkpoint import (
        CheckpointError,
        SafetensorsFile,
        export_hf_from_checkpoint,
        list_checkpoints,
        verify_checkpoint,
    )

    ref_out, ref_weights = reference_run(tiny_model(MODEL), _global_batches(5), [LR] * 5,
                                         clip=1.0)
    ranks = run_ranks(lambda w: _fsdp(w, str(tmp_path)))
    for r in ranks:
        assert_close_run(r["losses"], [o["loss"] for o in ref_out], _as_torch(r["weights"]),
                         ref_weights, rel=1e-5, atol=1e-5)
        assert r["resumed"] == pytest.approx(r["losses"][3:], rel=0, abs=1e-6)
        for k, v in r["weights"].items():
            np.testing.assert_allclose(r["resumed_weights"][k], v, rtol=0, atol=1e-6, err_msg=k)
        # the full AdamW state, keyed as the other steppers key it, survives the dcp round trip
        assert {f"{n}.{slot}" for n in r["weights"] for slot in ("exp_avg", "exp_avg_sq",
                                                                 "step")} == r["saved_optim"].keys()
        for k, v in r["saved_optim"].items():
            assert np.array_equal(r["loaded_optim"][k], v), k

    # torch.distributed.checkpoint files of both ranks, all under the manifest
    ckpt = Path(ranks[0]["ckpt"])
    assert ranks[1]["ckpt"] == str(ckpt) and list_checkpoints(tmp_path) == [ckpt]
    manifest = (ckpt / "manifest.json").read_text()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "state.json", "rng.safetensors"):
        assert (ckpt / name).is_file() and f'"{name}"' in manifest, name
    assert not list(ckpt.glob("*model*.safetensors"))  # nothing gathered
    verify_checkpoint(ckpt)

    # export assembles the full weights from the shards
    hf = export_hf_from_checkpoint(ckpt, tmp_path / "hf")
    exported = SafetensorsFile(hf / "model.safetensors")
    assert sorted(exported.entries) == sorted(ranks[0]["saved"])
    for k, v in ranks[0]["saved"].items():
        assert np.array_equal(exported.read(k).numpy(), v), k

    # a corrupted shard of rank 1 is caught
    with (ckpt / "__1_0.distcp").open("r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match="__1_0.distcp fails its checksum"):
        verify_checkpoint(ckpt)


def test_sharded_save_failure_leaves_no_checkpoint(tmp_path):
    import errno

    from tierlm.checkpoint import (
        CheckpointWriteError,
        TrainState,
        list_checkpoints,
        save_sharded_checkpoint,
    )

    class FullDisk:
        def save_sharded(self, path):
            (path / "__0_0.distcp").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointWriteError, match="disk full"):
        save_sharded_checkpoint(tmp_path, FullDisk(), World.single(), model_config=None,
                                tokenizer=None, state=TrainState(step=1, sampler={},
                                                                 run_config={}))
    assert list_checkpoints(tmp_path) == []
    assert not list((tmp_path / "checkpoints").iterdir())  # the temporary directory is gone


def test_fsdp_checkpoints_resume_only_fsdp_runs_of_their_world_size(tmp_path):
    from tierlm.checkpoint import CheckpointError, check_tensor_format

    dcp_state = {"tensors": "dcp", "world_size": 2}
    check_tensor_format(tmp_path, dcp_state, 2)
    check_tensor_format(tmp_path, {}, None)
    with pytest.raises(CheckpointError, match="--backend fsdp --nproc 2"):
        check_tensor_format(tmp_path, dcp_state, None)
    with pytest.raises(CheckpointError, match="shards of 2 processes, this run has 4"):
        check_tensor_format(tmp_path, dcp_state, 4)
    with pytest.raises(CheckpointError, match="without --backend fsdp"):
        check_tensor_format(tmp_path, {"format_version": 2}, 2)


# -- strategy configs ----

def test_topk_ratios_by_pattern_and_warmup():
    from tierlm.distributed.checks import parse_ratio_overrides

    sync = TopKSync(ratio=0.01, warmup_steps=4,
                    overrides=parse_ratio_overrides("embed|lm_head|norm=1.0,mlp=0.1"))
    topk = sync.build(Comm(2, Ledger()))
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    seen = []
    for _ in range(6):
        seen.append([topk.ratio_of(n) for n in names])
        topk.after_step(None, skipped=False)
    assert seen[0] == [1.0, 1.0, 1.0, 1.0]  # warm-up starts dense
    assert seen[2] == pytest.approx([1.0, 0.1**0.5, 0.01**0.5, 1.0])
    assert seen[4] == seen[5] == [1.0, 0.1, 0.01, 1.0]
    layout = FlatLayout([("a.mlp.w", (10, 10), True), ("a.norm.w", (10,), False),
                         ("a.q.w", (10, 10), True)])
    plan = topk.plan("seg", layout.slots)
    assert plan.sparse == [(0, 100, 10), (100, 100, 1)] and plan.dense == [(200, 10)]


def test_distributed_flags_resolve_to_typed_strategies():
    from tierlm.distributed.strategies import sync_config
    from tierlm.plan.checks import resolve

    def strategy(**flags):
        cfg = resolve(None, {f"distributed.{k}": v for k, v in flags.items()})
        return sync_config(cfg.distributed, max_steps=10)

    assert strategy() == DenseSync()
    assert strategy(grad_sync_dtype="bf16") == DenseSync(dtype="bf16")
    topk = strategy(sparse_grad_ratio=0.05, sparse_grad_ratio_overrides="")
    assert isinstance(topk, TopKSync) and topk.ratio == 0.05 and topk.overrides == ()
    assert strategy(sparse_grad_ratio=0.05).overrides[0][1] == 1.0  # sensitive layers dense
    assert strategy(sync_every=4) == DelayedSync(every=4, final_step=10)
    assert strategy(sync_every=2, sync_moments="average").moments == "average"
    for bad, flag in (({"grad_sync": "topk"}, "--sparse-grad-ratio"),
                      ({"sync_every": 2, "grad_sync": "dense"}, "--sync-every"),
                      ({"sync_moments": "average"}, "--sync-moments is for --grad-sync delayed"),
                      ({"backend": "fsdp", "sparse_grad_ratio": 0.1}, "--grad-sync topk"),
                      ({"sparse_grad_ratio_overrides": "mlp"}, "PATTERN=RATIO")):
        with pytest.raises(ConfigError, match=flag):
            strategy(**bad)


def test_sync_strategies_need_several_processes():
    from tierlm.distributed.setup import join_world
    from tierlm.plan.checks import resolve

    assert join_world(resolve(None, {})).size == 1  # no torchrun: one process, dense is a no-op
    for flags in ({"distributed.sparse_grad_ratio": 0.05}, {"distributed.sync_every": 2}):
        with pytest.raises(ConfigError, match="--nproc N"):
            join_world(resolve(None, flags))


# -- the stepper protocol ----

def _stepper_classes():
    from tierlm.distributed.fsdp import FSDPStep
    from tierlm.runtime.reference import ReferenceStep

    return [ReferenceStep, Engine, DataParallelStep, FSDPStep]


@pytest.mark.parametrize("cls", _stepper_classes(), ids=lambda c: c.__name__)
def test_every_stepper_implements_the_protocol_itself(cls):
    from tierlm.runtime.stepper import Stepper

    assert issubclass(cls, Stepper) and not inspect.isabstract(cls)
    assert not hasattr(cls, "__getattr__")  # nothing reaches another object unannounced


def test_capabilities_are_declared_not_probed():
    from tierlm.runtime.reference import ReferenceStep

    ref = ReferenceStep(tiny_model(MODEL), OPTIM, grad_clip=1.0, device=torch.device("cpu"))
    assert (ref.engine, ref.ledger, ref.cache, ref.fp8_stats, ref.save_sharded) == (None,) * 5
    dp = _dp(World.single(), DenseSync())
    try:
        engine = dp.engine
        assert engine.engine is engine and engine.save_sharded is None
        # the wrapper's capabilities are its engine's, and nothing else of the engine leaks
        assert dp.ledger is engine.ledger and dp.cache is engine.cache
        assert not hasattr(dp, "states") and not hasattr(dp, "opts")
    finally:
        dp.close()


def _trainer_run(out: str, world: World) -> list[dict]:
    """A 2-step data-parallel training run through the trainer; rank 0's metrics records."""
    from tierlm.config import from_dict
    from tierlm.monitor.metrics import read_metrics
    from tierlm.train import Trainer

    cfg = from_dict({
        "model": {"size": "tiny"},
        "data": {"seq_len": 16, "vocab_size": 300},
        "train": {"max_steps": 2, "batch_size": 1, "eval_every": 0, "eval_batches": 1},
        "run": {"out": out, "device": "cpu", "seed": 3},
        "distributed": {"timeout_s": 60},
    })
    trainer = Trainer(cfg, log=lambda msg: None)
    assert isinstance(trainer.stepper, DataParallelStep)
    trainer.train()
    trainer.stepper.close()
    return read_metrics(trainer.run_dir / "metrics.jsonl") if world.is_main else []


def test_data_parallel_runs_keep_the_predicted_vs_measured_record(tmp_path):
    """The planner's prediction for the engine a data-parallel stepper drives is checked
    against that engine's ledger, as in a single-process tiered run."""
    rank0, _ = run_ranks(lambda w: _trainer_run(str(tmp_path / "run"), w))
    (rec,) = [r for r in rank0 if "predicted_device_peak_bytes" in r]
    assert rec["step"] == 2  # everything on the device (--offload-policy none): host holds 0
    assert rec["predicted_device_peak_bytes"] > 0 and rec["measured_device_peak_bytes"] > 0
    assert rec["predicted_host_peak_bytes"] >= 0 and rec["measured_host_peak_bytes"] >= 0
