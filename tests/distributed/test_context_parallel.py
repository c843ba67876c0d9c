"""Context parallel (ring attention) on gloo: CP 2 and CP 4, and DP 2 x CP 2, against one process
over the same full sequences (tests/runtime_helpers.py's reference step), with GQA.

Each rank returns its gradients of the first micro-batch, its losses and its final weights; all
must equal the reference within 1e-5 (fp32: the ring sums attention blocks and the all-reduce
sums rank shares in another order than one process does).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.distributed.test_distributed import run_ranks
from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.config import ActivationConfig, ConfigError
from tierlm.distributed.comm import Comm, all_reduce_send_bytes
from tierlm.distributed.context import (
    ContextLayout,
    ZigzagShare,
    _block_backward,
    _block_forward,
    build_ring,
    ring_send_bytes,
    use_ring_attention,
    zigzag_positions,
)
from tierlm.distributed.context_step import ContextParallelStep
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.sync import DenseSync
from tierlm.distributed.world import World
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Link, Tier
from tierlm.plan.checks import from_dict
from tierlm.plan.timing import grad_sync_bytes, ring_kv_bytes
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.shapes import ModelShape, TrainShape

MODEL, LAYERS = "llama_tied_gqa", 2  # 4 query heads, 2 K/V heads
STEPS, M, T = 2, 2, 32
LR = 1e-2
# see tests/distributed/test_distributed.py: rounding, not Adam
OPTIM = dataclasses.replace(OPTIM, eps=1e-3)
CPU = torch.device("cpu")


def _reference(rows: int, name: str = MODEL) -> dict:
    model = tiny_model(name, layers=LAYERS)
    ref = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU)
    step_batches = batches(STEPS, M, b=rows, t=T)
    ref._loss(step_batches[0][0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    outs = [ref.step(b, LR) for b in step_batches]
    return {"grads": grads, "losses": [o["loss"] for o in outs],
            "grad_norms": [o["grad_norm"] for o in outs], "weights": ref.weights(),
            "eval": ref.eval_loss(step_batches[0][0])}


def _cp_run(world: World, cp: int, rows: int, name: str = MODEL) -> dict:
    """This rank's run: the row group's rows of the global batches, its zig-zag share of each."""
    layout = ContextLayout(world.rank, world.size, cp)
    step = ContextParallelStep(
        ReferenceStep(tiny_model(name, layers=LAYERS), OPTIM, grad_clip=1.0, device=CPU),
        layout, build_ring(layout),
    )
    global_batches = batches(STEPS, M, b=rows, t=T)
    step_batches = [[b.tensor_split(layout.dp)[layout.dp_rank] for b in micro]
                    for micro in global_batches]
    nll, tokens = step._nll(step_batches[0][0])
    (nll / tokens).backward()
    step._sum_gradients()
    grads = {n: p.grad.clone() for n, p in step.ref.model.named_parameters()}
    step.ref.model.zero_grad(set_to_none=True)
    outs = [step.step(b, LR) for b in step_batches]
    assert step.ref.model.config._attn_implementation == "tierlm_ring"
    # numpy across the process boundary: a tensor would travel as shared memory of an ended rank
    return {"grads": _numpy(grads), "losses": [o["loss"] for o in outs],
            "grad_norms": [o["grad_norm"] for o in outs],
            "weights": _numpy(step.weights()),
            "kv_send_bytes": outs[-1]["kv_send_bytes"],
            "net_send_bytes": outs[-1]["net_send_bytes"],
            "eval": step.eval_loss(global_batches[0][0])}  # every row group: all rows


def _engine_run(world: World, cp: int, rows: int, activations: str, name: str = MODEL) -> dict:
    """The tiered runtime with host placement on this rank's share, data parallel over all
    ranks with the dense sync (the wiring of tierlm.distributed.setup)."""
    layout = ContextLayout(world.rank, world.size, cp)
    comm = Comm(world.size, Ledger())
    sync = DenseSync().build(comm)
    ring = build_ring(layout)
    engine = build_engine(
        tiny_model(name, layers=LAYERS), OPTIM,
        EngineOptions(policy="host", grad_sync=sync, batch_size=rows // layout.dp, seq_len=T,
                      micro_batches=M, sequence_share=ZigzagShare(layout, ring),
                      activations=ActivationConfig(policy=activations)),
        device=CPU,
    )
    use_ring_attention(engine.adapter.model)
    comm.ledger = ring.ledger = engine.ledger
    step = DataParallelStep(engine, sync, world, comm)
    outs = []
    for micro in batches(STEPS, M, b=rows, t=T):
        ring.sent_bytes = 0
        outs.append(step.step([b.tensor_split(layout.dp)[layout.dp_rank] for b in micro], LR))
    result = {"losses": [o["loss"] for o in outs], "grad_norms": [o["grad_norm"] for o in outs],
              "weights": _numpy(step.weights()), "kv_send_bytes": ring.sent_bytes,
              "net_send_bytes": engine.ledger.moved_bytes[Link.NET_SEND],
              "resident": [p.resident for p in engine.report.placements],
              # per segment but the head: whether its backward recomputes its forward
              "recomputes": [p.recomputes for p in engine.policies]}
    step.close()
    return result


def _numpy(tensors: dict[str, torch.Tensor]) -> dict:
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}


def _assert_equal(run: dict, ref: dict) -> None:
    for a, b in zip(run["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (run["losses"], ref["losses"])
    for a, b in zip(run["grad_norms"], ref["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (run["grad_norms"], ref["grad_norms"])
    for key in ("grads", "weights"):
        for name, want in ref[key].items() if key in run else ():
            diff = (torch.from_numpy(run[key][name]) - want).abs().max().item()
            assert diff <= 1e-5, f"{key} {name}: max abs diff {diff}"


def _kv_heads(c) -> int:
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads  # GPT-2: all


@pytest.mark.parametrize(("world", "cp", "name"),
                         [(2, 2, MODEL), (4, 4, MODEL), (4, 2, MODEL), (2, 2, "gpt2")],
                         ids=["cp2", "cp4", "dp2xcp2", "cp2-gpt2"])
def test_ring_equals_one_process_over_the_full_sequences(world, cp, name):
    """GPT-2 too: its learned position embedding looks up each token's global position."""
    rows = 2 * (world // cp)  # 2 rows per row group: DP 2 x CP 2 is one process with 4 rows
    ref = _reference(rows, name)
    runs = run_ranks(lambda w: _cp_run(w, cp, rows, name), world=world)
    for run in runs:
        _assert_equal(run, ref)
    # the bytes: K/V around the ring in both sweeps (context.py), plus the gradient all-reduce
    model = tiny_model(name, layers=LAYERS)
    c = model.config
    kv = ring_send_bytes(cp=cp, batch=rows // (world // cp), kv_heads=_kv_heads(c),
                         local_len=T // cp, head_dim=c.hidden_size // c.num_attention_heads,
                         element_bytes=4, layers=c.num_hidden_layers)
    n_params = sum(p.numel() for p in model.parameters())
    resident = [SegmentPlacement(resident=True, state_tier=Tier.DEVICE)] * (LAYERS + 2)
    shape = ModelShape.from_config(c)
    train = TrainShape(batch_size=rows // (world // cp), seq_len=T // cp, micro_batches=M,
                       context_parallel=cp, nproc=world)
    planned = ring_kv_bytes(shape, train, resident, keep_resident=True)
    # the gradient all-reduce over all dp x cp ranks, as the planner counts it
    all_reduce = int(2 * (world - 1) / world * 4 * n_params)
    assert grad_sync_bytes(shape, train) == all_reduce
    for run in runs:
        assert run["kv_send_bytes"] == M * kv == planned
        # and the step's trained-token count (one int64) and the logged loss (2 float64)
        assert run["net_send_bytes"] == (M * kv + all_reduce + all_reduce_send_bytes(8, world)
                                         + all_reduce_send_bytes(16, world))
        assert run["eval"] == pytest.approx(ref["eval"], rel=1e-5)


@pytest.mark.parametrize(("world", "cp", "activations", "name"),
                         [(2, 2, "none", MODEL), (4, 4, "full", MODEL), (2, 2, "none", "gpt2")],
                         ids=["cp2", "cp4-recompute", "cp2-gpt2"])
def test_tiered_runtime_with_host_placement_equals_one_process(world, cp, activations, name):
    rows = 2 * (world // cp)
    ref = _reference(rows, name)
    runs = run_ranks(lambda w: _engine_run(w, cp, rows, activations, name), world=world)
    c = tiny_model(name, layers=LAYERS).config
    kv = ring_send_bytes(cp=cp, batch=rows // (world // cp), kv_heads=_kv_heads(c),
                         local_len=T // cp, head_dim=c.hidden_size // c.num_attention_heads,
                         element_bytes=4, layers=c.num_hidden_layers)
    # full recompute runs each block's forward again in the backward: the ring passes the
    # forward's K/V once more; `none` keeps the streamed blocks' graphs (no device budget) and
    # passes them once
    recomputed = sum(runs[0]["recomputes"][1:])
    assert recomputed == (c.num_hidden_layers if activations == "full" else 0)
    recompute_kv = ring_send_bytes(
        cp=cp, batch=rows // (world // cp), kv_heads=_kv_heads(c), local_len=T // cp,
        head_dim=c.hidden_size // c.num_attention_heads, element_bytes=4,
        layers=recomputed, backward=False)
    # the planner counts the same bytes for this placement (its net lane's)
    shape = ModelShape.from_config(c, optim=OPTIM)
    train = TrainShape(batch_size=rows // (world // cp), seq_len=T // cp, micro_batches=M,
                       context_parallel=cp, nproc=world, grad_sync=DenseSync())
    planned = ring_kv_bytes(
        shape, train,
        [SegmentPlacement(resident=r, state_tier=Tier.HOST) for r in runs[0]["resident"]],
        keep_resident=(*(not r for r in runs[0]["recomputes"]), True))
    # plus the gradient all-reduce, per segment over every rank, as the planner counts it, the
    # step's trained-token count (one int64) and the logged loss (its sum and tokens, 2 float64)
    others = (grad_sync_bytes(shape, train) + all_reduce_send_bytes(8, world)
              + all_reduce_send_bytes(16, world))
    for run in runs:
        _assert_equal(run, ref)
        assert run["kv_send_bytes"] == M * (kv + recompute_kv) == planned
        assert run["net_send_bytes"] == run["kv_send_bytes"] + others


def test_zigzag_shares_cover_the_sequence_once_and_balance_causal_work():
    shares = [zigzag_positions(32, 4, r) for r in range(4)]
    assert torch.equal(torch.sort(torch.cat(shares)).values, torch.arange(32))
    # keys below each query (the causal work) per rank: equal
    work = {int((s + 1).sum()) for s in shares}
    assert len(work) == 1
    with pytest.raises(ValueError, match="multiple of 2 x 4"):
        zigzag_positions(36, 4, 0)


@pytest.mark.parametrize("causal", [True, False])
def test_math_block_equals_the_fused_cpu_block(causal):
    """The block used off CPU (exact fp32 math) against the CPU flash kernel, with GQA."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 12 if not causal else 8, 16, generator=g) for _ in range(2))
    out, lse = _block_forward(q, k, v, causal, 0.25, fused=True)
    out_m, lse_m = _block_forward(q, k, v, causal, 0.25, fused=False)
    torch.testing.assert_close(out_m, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_m, lse, atol=1e-5, rtol=1e-5)
    fused = _block_backward(dout, q, k, v, out, lse, causal, 0.25, fused=True)
    math_ = _block_backward(dout, q, k, v, out, lse, causal, 0.25, fused=False)
    for a, b in zip(math_, fused, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sliding_window_models_are_refused_naming_the_flag():
    model = tiny_model("qwen2")
    model.config.layer_types = ["sliding_attention"] * LAYERS
    ref = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU)
    with pytest.raises(ConfigError, match="sliding-window.*--context-parallel"):
        ContextParallelStep(ref, ContextLayout(0, 2, 2), ring=None)


def test_packed_examples_are_refused_naming_the_flag():
    ref = ReferenceStep(copy.deepcopy(tiny_model(MODEL)), OPTIM, grad_clip=1.0, device=CPU)
    step = ContextParallelStep(ref, ContextLayout(0, 2, 2), ring=None)
    packed = torch.zeros(1, 3, T + 1, dtype=torch.long)  # ids, labels, positions
    with pytest.raises(ConfigError, match="--data.packing"):
        step._nll(packed)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"distributed": {"nproc": 3}}, r"--nproc 3 is not a multiple of --context-parallel 2"),
        ({"data": {"seq_len": 30}}, r"--seq-len 30 is not a multiple of 2 x --context-parallel"),
        ({"distributed": {"backend": "fsdp"}}, r"--context-parallel with --backend fsdp"),
        ({"distributed": {"sparse_grad_ratio": 0.1}}, r"--context-parallel with --grad-sync topk"),
        ({"distributed": {"sync_every": 2}}, r"--context-parallel with --grad-sync delayed"),
        ({"distributed": {"grad_sync_dtype": "bf16"}}, r"--grad-sync dense \(bf16\)"),
        ({"precision": {"mode": "fp8"}}, r"--context-parallel with --precision fp8"),
        ({"data": {"packing": "documents"}}, r"--context-parallel with --data.packing documents"),
    ],
)
def test_combinations_not_built_are_refused_naming_the_flag(extra, match):
    data = {"distributed": {"nproc": 2, "context_parallel": 2}, "data": {"seq_len": 32}}
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=match):
        from_dict(data)
    from_dict({"distributed": {"nproc": 4, "context_parallel": 2}, "data": {"seq_len": 32},
               "activations": {"policy": "full"}})  # what is built passes
    from_dict({"distributed": {"nproc": 2, "context_parallel": 2}, "data": {"seq_len": 32},
               "memory": {"offload_policy": "host"}, "activations": {"policy": "selective"}})


def test_plan_holds_one_rank_share_of_each_row(capsys):
    """`tierlm plan --context-parallel N`: each rank's activations are those of seq/N tokens;
    attention still reads the whole row; the train command it prints keeps the CP flags."""
    from tierlm.cli import main
    from tierlm.plan.inputs import hardware_for, make_plan, model_config_for

    def plan(cp: int, **hw):
        cfg = from_dict({"model": {"size": "small"}, "data": {"seq_len": 4096},
                         "train": {"batch_size": 1},
                         "memory": {"offload_policy": "host", "hardware": "rtx4090"},
                         "distributed": {"nproc": cp, "context_parallel": cp}})
        p, _, train = make_plan(cfg, model_config_for(cfg), hardware_for(cfg).with_overrides(**hw),
                                "bf16")
        return p, train

    (p1, _), (p2, t2) = plan(1), plan(2)
    assert (t2.seq_len, t2.context_parallel) == (2048, 2)
    assert p2.device_by_class["activation"] * 2 == p1.device_by_class["activation"]
    # the ring's sends: a lane of their own, hidden behind attention unless the link is slow
    assert p1.times_s["net"] == 0 and p2.times_s["net"] > 0
    slow, _ = plan(2, interconnect_Bps=1e8)
    assert slow.times_s["net"] > slow.times_s["attention"]
    assert slow.bottleneck == "interconnect (ring K/V)"
    t = slow.times_s
    # the CP group's gradient all-reduce shares the link: what the backward cannot hide
    assert 0 < t["grad_sync_exposed"] < t["net"] - t["attention"]
    assert t["net_lane"] == pytest.approx(
        t["compute"] + t["net"] - t["attention"] + t["grad_sync_exposed"])
    assert slow.step_s >= t["net_lane"] > p2.step_s
    assert main(["plan", "--model-size", "small", "--seq-len", "4096", "--batch-size", "1",
                 "--hardware", "rtx4090", "--precision", "bf16", "--nproc", "2",
                 "--context-parallel", "2", "--no-optimizer-table"]) == 0
    out = capsys.readouterr().out
    assert "2048 tokens per rank (context parallel 2: rows of 4096)" in out
    assert "net lane" in out and "ring K/V" in out
    assert "--nproc 2 --context-parallel 2" in out


def test_the_ranks_of_a_cp_group_share_their_row_group():
    from tierlm.distributed.setup import RankSlice

    class Rows:
        def next_batch(self):
            return torch.arange(8).unsqueeze(1).expand(8, 5)  # 2 row groups x 4 rows

    got = [RankSlice(Rows(), World(rank=r, size=4), cp=2).next_batch()[:, 0].tolist()
           for r in range(4)]
    assert got == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
