"""Activation policies (ARCHITECTURE.md section 6): what each keeps, what it moves, and that
none of them changes the math."""

from __future__ import annotations

import copy
import ctypes
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.runtime_helpers import (
    OPTIM,
    assert_close_run,
    batches,
    new_engine,
    reference_run,
    tiny_model,
)
from tierlm.activations import (
    PolicyFactory,
    RunScope,
    SegmentCosts,
    activation_peak_bytes,
    chunked_cross_entropy,
    default_chunk_tokens,
    head_workspace_bytes,
    parse_overrides,
    resolve_policies,
    storages_of,
)
from tierlm.config import ConfigError
from tierlm.memory import Ledger, PlacementError, Tier
from tierlm.memory.layout import FlatLayout
from tierlm.memory.tiers import Link
from tierlm.models.adapters import ModelAdapter
from tierlm.plan.checks import check_supported, from_dict
from tierlm.runtime import Engine

CPU = torch.device("cpu")
B, T = 2, 16
POLICIES = ("keep", "selective", "full", "offload")

# -- the tiny Llama block of runtime_helpers.tiny_model("llama_untied") -----------------------
# hidden D=64, 4 query heads and 2 kv heads of head_dim 16, MLP width M=128, fp32, B=2, T=16.
D, H, KV, HD, M = 64, 4, 2, 16, 128
F32 = 4

# What `keep` holds, storage by storage (each once, however many views autograd saves of it):
#   input norm      rsqrt (B,T,1), x*rsqrt (B,T,D), weight*that (B,T,D) [fed to q, k and v]
#   attention       q and k after rotary (B,H,T,hd) and (B,KV,T,hd), v (B,KV,T,hd) as
#                   projected, SDPA output (B,T,D) and its log-sum-exp (B,H,T)
#   residual        x + attention (B,T,D) (the post-attention norm's input)
#   post norm       rsqrt (B,T,1), x*rsqrt (B,T,D), weight*that (B,T,D) [fed to gate and up]
#   MLP             gate (B,T,M) [silu's input], silu(gate) and up (B,T,M) [the product's
#                   inputs], their product (B,T,M) [down's input]
# Not counted: the boundary input (held as the segment's input anyway), the 9 weight views
# (packed as positions, not memory) and the rotary cos/sin (shared by every block).
KEEP_BYTES = F32 * (
    2 * B * T + 7 * B * T * D + 2 * B * T * KV * HD + B * H * T + 4 * B * T * M
)  # 131840
KEEP_SAVES = 23  # saved activation tensors (38 saves in all: + 9 weight views, 2 of the
# input, 4 of cos/sin)
# `selective` holds the outputs of the 7 matmuls (q, o, gate, up, down (B,T,D) or (B,T,M); k, v
# (B,T,KV*hd)) and of SDPA (output (B,T,D) and log-sum-exp (B,H,T)): 9 tensors.
SELECTIVE_BYTES = F32 * (4 * B * T * D + 2 * B * T * KV * HD + 2 * B * T * M + B * H * T)
SELECTIVE_SAVES = 9
# Its re-run in the backward materialises what `keep` holds, except what the cache already has
# (v, SDPA output and log-sum-exp, gate, up).
SELECTIVE_WORKSPACE = KEEP_BYTES - F32 * (B * T * KV * HD + B * T * D + B * H * T + 2 * B * T * M)


def block_and_input(name: str = "llama_untied", layers: int = 1):
    model = tiny_model(name, layers=layers)
    adapter = ModelAdapter(model)
    seg = adapter.segments[1]
    layout = FlatLayout([(n, tuple(p.shape), d) for n, p, d in seg.params])
    flat = layout.pack({n: p.detach() for n, p, _ in seg.params}, torch.empty(layout.numel))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, model.config.hidden_size, generator=g)
    ctx = adapter.context(torch.randint(0, 300, (B, T), generator=g), x)

    def run(w, inp):
        return seg.forward(layout.views(w), inp, ctx)

    return run, flat, x, ctx, layout


def run_policy(name, run, flat, x, ctx, layout, *, weights_for_backward=None, dropout=False):
    """Forward and backward of one block under one policy; the backward gets its own copy of
    the weights (as a streamed segment does after its weights were evicted)."""
    ledger = Ledger()
    scope = RunScope("block.0", ledger, storages_of(x, ctx))
    policy = PolicyFactory(CPU, dropout=dropout)(name)
    out, handle = policy.forward(run, flat, x, scope)
    after_forward = {k: v for k, v in ledger.activation_bytes.items() if v}
    policy.bring_back(handle)
    grad = torch.zeros(layout.numel)
    w = flat.clone() if weights_for_backward is None else weights_for_backward
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dx = policy.backward(handle, run, w, x, gout, grad, scope)
    return out, dx, grad, after_forward, ledger, handle


def test_expected_numbers_follow_from_the_shapes():
    assert KEEP_BYTES == 131840 and SELECTIVE_BYTES == 74240 and SELECTIVE_WORKSPACE == 86272


def test_saved_tensor_count_and_bytes_per_policy():
    run, flat, x, ctx, layout = block_and_input()
    got = {name: run_policy(name, run, flat, x, ctx, layout) for name in POLICIES}

    _, _, _, held, ledger, handle = got["keep"]
    assert held == {("block.0", "saved"): KEEP_BYTES}
    assert ledger.segment_activations() == {"block.0": {"saved": KEEP_BYTES}}
    assert handle.held_bytes == KEEP_BYTES

    _, _, _, held, ledger, _ = got["selective"]
    assert held == {("block.0", "saved"): SELECTIVE_BYTES}
    assert ledger.segment_activations() == {
        "block.0": {"saved": SELECTIVE_BYTES, "workspace": SELECTIVE_WORKSPACE}
    }

    _, _, _, held, ledger, _ = got["full"]
    assert held == {}  # nothing survives the forward
    assert ledger.segment_activations() == {"block.0": {"workspace": KEEP_BYTES}}

    _, _, _, held, ledger, _ = got["offload"]
    assert held == {("block.0", "offloaded"): KEEP_BYTES}  # on the host, none on the device
    assert ledger.segment_activations() == {
        "block.0": {"offloaded": KEEP_BYTES, "workspace": KEEP_BYTES}
    }
    assert ledger.moved_bytes[Link.D2H] == KEEP_BYTES  # each storage once, there and back
    assert ledger.moved_bytes[Link.H2D] == KEEP_BYTES
    for _, _, _, _, ledger, _ in got.values():  # everything released after the backward
        assert not any(ledger.activation_bytes.values())


def test_saved_tensor_counts_by_kind():
    """Count the saves themselves: 38 saves, of which 23 are activations (the rest weight views,
    the boundary input and cos/sin); selective's cache keeps 9 op outputs."""
    from tierlm.activations.saved import SavedTensorScope, WeightRef
    from tierlm.activations.selective import SelectiveRun

    run, flat, x, ctx, _ = block_and_input()
    leaf = flat.detach().requires_grad_()
    scope = SavedTensorScope(leaf, storages_of(x, ctx))
    kinds = []
    pack = scope.pack

    def recording(t):
        packed = pack(t)
        kinds.append("WeightRef" if isinstance(packed, WeightRef) else "tensor")
        return packed

    scope.pack = recording
    with torch.enable_grad(), scope.hooks():
        run(leaf, x.detach().requires_grad_())
    assert len(kinds) == 38 and kinds.count("WeightRef") == 9
    assert scope.count == KEEP_SAVES and scope.bytes == KEEP_BYTES

    sel = SelectiveRun(lambda: set(), lambda n: None)
    with torch.enable_grad():
        torch.utils.checkpoint.checkpoint(
            run, leaf, x.detach().requires_grad_(), use_reentrant=False, context_fn=sel.contexts
        )
    assert sel.held_count == SELECTIVE_SAVES and sel.held_bytes == SELECTIVE_BYTES


@pytest.mark.parametrize("name", ["llama_untied", "gpt2", "qwen2"])
def test_every_policy_gives_keeps_gradients_bitwise(name):
    run, flat, x, ctx, layout = block_and_input(name)
    ref_out, ref_dx, ref_grad, *_ = run_policy("keep", run, flat, x, ctx, layout)
    # and keep itself is plain autograd on the same block
    leaf, xin = flat.clone().requires_grad_(), x.clone().requires_grad_()
    out = run(leaf, xin)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(ref_out, out.detach())
    assert torch.equal(ref_dx, xin.grad) and torch.equal(ref_grad, leaf.grad)
    for policy in ("selective", "full", "offload"):
        out, dx, grad, *_ = run_policy(policy, run, flat, x, ctx, layout)
        assert torch.equal(out, ref_out), policy
        assert torch.equal(dx, ref_dx), policy
        assert torch.equal(grad, ref_grad), policy


def test_recomputing_policies_replay_dropout_masks():
    """With dropout, a recompute must draw the forward's masks again: full replays the RNG state
    it captured, selective relies on torch.utils.checkpoint's own RNG stash."""
    model = tiny_model("gpt2", layers=1)
    model.config.resid_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    model.train()
    adapter = ModelAdapter(model)
    seg = adapter.segments[1]
    layout = FlatLayout([(n, tuple(p.shape), d) for n, p, d in seg.params])
    flat = layout.pack({n: p.detach() for n, p, _ in seg.params}, torch.empty(layout.numel))
    x = torch.randn(B, T, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ctx = adapter.context(torch.zeros(B, T, dtype=torch.long), x)

    def run(w, inp):
        return seg.forward(layout.views(w), inp, ctx)

    got = {}
    for policy in POLICIES:
        torch.manual_seed(5)
        got[policy] = run_policy(policy, run, flat, x, ctx, layout, dropout=True)[:3]
    torch.manual_seed(5)
    assert not torch.equal(run(flat, x), run(flat, x))  # the masks really are random
    for policy in POLICIES:
        assert all(torch.equal(a, b) for a, b in zip(got[policy], got["keep"], strict=True))


@pytest.mark.parametrize("policy", ["keep", "selective", "offload"])
def test_kept_graphs_do_not_hold_the_weights(policy):
    """A streamed segment's device weights must be freeable after its forward whatever its
    policy: the graph holds positions, and the backward reads the then-current copy."""
    run, flat, x, ctx, layout = block_and_input()
    ref = run_policy("keep", run, flat, x, ctx, layout)
    streamed = flat.clone()  # the forward's device copy
    alive = weakref.ref(streamed.untyped_storage())
    ledger = Ledger()
    scope = RunScope("block.0", ledger, storages_of(x, ctx))
    pol = PolicyFactory(CPU, dropout=False)(policy)
    out, handle = pol.forward(run, streamed, x, scope)
    del streamed
    gc.collect()
    assert alive() is None  # evicted: nothing in the graph kept it
    grad = torch.zeros(layout.numel)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dx = pol.backward(handle, run, flat.clone(), x, gout, grad, scope)  # re-fetched copy
    assert torch.equal(dx, ref[1]) and torch.equal(grad, ref[2])


# -- the engine: every policy reproduces `none` --------------------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def runs():
    """Reference (plain PyTorch) runs, by model."""
    out = {}
    for name in ("llama_tied_gqa", "gpt2"):
        base = tiny_model(name, layers=3)
        steps = batches(STEPS, 2)
        lrs = [OPTIM.lr] * STEPS
        recs, weights = reference_run(copy.deepcopy(base), steps, lrs, 0.05)
        out[name] = (base, steps, lrs, recs, weights)
    return out


def _engine(model, tmp_path, policy, *, placement="none", order="microbatch-outer",
                budget=None, **kw):
    from tierlm.config import ActivationConfig

    acts = ActivationConfig(policy=policy, **kw)
    return new_engine(model, tmp_path, policy=placement, microbatch_order=order, grad_clip=0.05,
                      micro_batches=2, activations=acts, device_budget_bytes=budget)


def budget_for(model, tmp_path, policies: list[str], placement: str = "none") -> int:
    """The device budget at which `dynamic` can just afford `policies`: the model state and
    boundary activations (what an unbudgeted `dynamic` engine places besides its reserve) plus
    the activation peak of `policies` from the engine's own measured costs."""
    probe = _engine(copy.deepcopy(model), tmp_path, "dynamic", placement=placement)
    state = probe.report.device_bytes - probe.activation_reserve_bytes
    peak = activation_peak_bytes(
        policies, probe.activation_costs, in_flight=1, head_bytes=probe.activation_head_bytes
    )
    probe.close()
    return state + peak


def engine_run(runs, name, tmp_path, policy, **kw):
    base, steps, lrs, _, _ = runs[name]
    eng = _engine(copy.deepcopy(base), tmp_path, policy, **kw)
    recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    w = eng.weights()
    chosen = list(eng.activation_policies)
    eng.close()
    return recs, w, chosen


# Under a streamed placement without a device budget `none` keeps every graph (the weights
# come back for the backward, which then runs without a recompute); with a budget that holds
# one block's saved tensors, the last block keeps and the others recompute (embed saves only
# its token ids, which the step holds anyway: it keeps for free). `dynamic`'s budget affords
# exactly [keep, full, selective, keep]: the last block keeps, the one before it fits only
# `selective`, the first block gets the fallback, and `embed` (it saves at most its input ids)
# keeps; without its budget it would keep everything, which is `none`.
MIXED = ["keep", "full", "selective", "keep"]
STREAMED_KEEP = ["keep", "full", "full", "keep"]


@pytest.mark.parametrize(
    "policy, kw, chosen_policies",
    [
        pytest.param("full", {}, ["full"] * 4, id="full-resident"),
        pytest.param("selective", {}, ["selective"] * 4, id="selective-resident"),
        pytest.param("offload", {}, ["offload"] * 4, id="offload-resident"),
        pytest.param("none", {"placement": "host", "order": "layer-outer"}, ["keep"] * 4,
                     id="none-host-layer-outer"),
        pytest.param("none", {"placement": "host", "budget": STREAMED_KEEP},
                     STREAMED_KEEP, id="none-host-budget"),
        pytest.param("full", {"placement": "host"}, ["full"] * 4, id="full-host"),
        pytest.param("selective", {"placement": "host"}, ["selective"] * 4, id="selective-host"),
        pytest.param("offload", {"placement": "host", "order": "layer-outer"}, ["offload"] * 4,
                     id="offload-host-layer-outer"),
        pytest.param(
            "none", {"placement": "host", "overrides": "block.[01]=keep,block.2=selective"},
            ["keep", "keep", "keep", "selective"], id="none-host-overrides",
        ),
        pytest.param("dynamic", {"budget": MIXED}, MIXED, id="dynamic-budget"),
    ],
)
@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_engine_policies_reproduce_none(runs, name, policy, kw, chosen_policies, tmp_path):
    """fp32: the same losses, gradient norms and weights as `none` with microbatch-outer order on
    the same placement, bit for bit, and as the plain-PyTorch reference within the runtime's
    usual tolerance; each case runs the per-segment policies it names."""
    placement = kw.get("placement", "none")
    none_recs, none_w, _ = engine_run(runs, name, tmp_path / "none", "none", placement=placement)
    if "budget" in kw:
        kw = {**kw, "budget": budget_for(runs[name][0], tmp_path / "probe", kw["budget"],
                                         placement)}
    recs, w, chosen = engine_run(runs, name, tmp_path / "p", policy, **kw)
    assert chosen == chosen_policies
    assert [r["loss"] for r in recs] == [r["loss"] for r in none_recs]
    assert [r["grad_norm"] for r in recs] == [r["grad_norm"] for r in none_recs]
    assert all(torch.equal(w[k], none_w[k]) for k in none_w)
    _, _, _, ref_recs, ref_w = runs[name]
    assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], w, ref_w)


def test_offload_moves_the_saved_bytes_to_host_and_back(tmp_path):
    """Everything resident with device state: the only host traffic is the offloaded
    activations, each block's `keep` bytes there and back per micro-batch."""
    layers, m = 3, 2
    model = tiny_model("llama_untied", layers=layers)
    eng = new_engine(model, policy="none", micro_batches=m, activations=_acts("offload"))
    eng.step(batches(1, m)[0], OPTIM.lr)
    per_step = layers * m * KEEP_BYTES  # embed saves only the token ids (its input)
    assert eng.ledger.moved_bytes[Link.D2H] == per_step
    assert eng.ledger.moved_bytes[Link.H2D] == per_step
    seg = eng.ledger.segment_activations()
    for i in range(layers):
        assert seg[f"block.{i}"]["offloaded"] == KEEP_BYTES
        assert seg[f"block.{i}"].get("saved", 0) == 0  # nothing held on the device
    snap = eng.ledger.snapshot()
    assert snap["offloaded_activation_step_peak_bytes"] == layers * KEEP_BYTES
    assert snap["saved_activation_step_peak_bytes"] > 0  # only the head's, in its own action
    eng.close()


def _acts(policy, **kw):
    from tierlm.config import ActivationConfig

    return ActivationConfig(policy=policy, **kw)


def test_ledger_counts_activations_per_segment(tmp_path):
    """keep holds the blocks' bytes from forward to backward; the boundary inputs are counted
    per segment; the device total adds saved tensors to the tier totals."""
    layers = 2
    model = tiny_model("llama_untied", layers=layers)
    eng = new_engine(model, policy="none", activations=_acts("none"))
    eng.step(batches(1, 1)[0], OPTIM.lr)
    seg = eng.ledger.segment_activations()
    hidden = B * T * D * F32
    for i in range(layers):
        assert seg[f"block.{i}"] == {"saved": KEEP_BYTES, "boundary": hidden}
    assert seg["head"]["boundary"] == hidden
    snap = eng.ledger.snapshot()
    assert snap["saved_activation_step_peak_bytes"] >= layers * KEEP_BYTES
    assert snap["device_total_step_peak_bytes"] >= (
        snap["device_step_peak_bytes"] + layers * KEEP_BYTES
    )
    assert eng.ledger.device_activation_bytes == 0  # all released after the step
    eng.close()


# -- chunked cross-entropy ---------------------------------------------------------------------


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss_increase(fn) -> tuple[int, object]:
    """Peak resident memory `fn` adds (VmHWM after resetting it, less VmRSS before)."""
    libc = ctypes.CDLL("libc.so.6")
    # glibc raises its mmap threshold after large frees (up to 32 MiB), after which chunk-sized
    # buffers come from the heap and fragment it, so the peak depends on what earlier tests
    # freed; a fixed threshold (M_MMAP_THRESHOLD = -3) makes the measurement repeatable
    libc.mallopt(-3, 128 * 1024)
    gc.collect()
    libc.malloc_trim(0)
    base = _status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    out = fn()
    return _status_bytes("VmHWM:") - base, out


def chunked_loss_measurement() -> dict:
    """The full and the chunked head's peak RSS, losses and gradients (run in a process of its
    own by the test below: the peak is the whole process's, so a thread an earlier test left
    behind, or its thread count, would add to it)."""
    batch, seq, vocab, hidden = 4, 1024, 32000, 64
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(batch * seq, hidden, generator=g)
    w0 = torch.randn(vocab, hidden, generator=g) * 0.02
    targets = torch.randint(0, vocab, (batch * seq,), generator=g)

    def full():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = F.cross_entropy(F.linear(h, w), targets)  # (B*T, V) logits at once
        loss.backward()
        return loss.item(), h.grad, w.grad

    chunk = default_chunk_tokens(vocab)

    def chunked():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = chunked_cross_entropy(lambda x: F.linear(x, w), h, targets, chunk_tokens=chunk)
        return loss.item(), h.grad, w.grad

    full_bytes, (loss_a, dh_a, dw_a) = peak_rss_increase(full)
    chunk_bytes, (loss_b, dh_b, dw_b) = peak_rss_increase(chunked)
    return {
        "full_bytes": full_bytes, "chunk_bytes": chunk_bytes,
        "logits_bytes": batch * seq * vocab * 4,
        # the head's reserve in `dynamic` bounds what a chunk really takes (+ the copies made
        # here)
        "reserve": head_workspace_bytes(chunk, vocab, batch * seq, hidden),
        "extra": 2 * (h0.numel() + w0.numel()) * 4 + 32 * 2**20,
        "losses": (loss_a, loss_b),
        "dh_equal": torch.equal(dh_b, dh_a),  # each token's gradient row is computed alike
        "dw_close": torch.allclose(dw_b, dw_a, rtol=1e-5, atol=1e-9),  # summed over chunks
    }


def test_chunked_loss_peak_is_4x_below_full_logits_with_the_same_loss_and_gradient():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = ("import json; from tests.activations.test_activations import "
            "chunked_loss_measurement as m; print(json.dumps(m()))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, text=True,
                          capture_output=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    full_bytes, chunk_bytes = r["full_bytes"], r["chunk_bytes"]
    assert full_bytes >= r["logits_bytes"]  # the measurement sees the full logits
    assert chunk_bytes * 4 <= full_bytes, (chunk_bytes, full_bytes)
    assert chunk_bytes <= r["reserve"] + r["extra"], (chunk_bytes, r["reserve"], r["extra"])
    loss_a, loss_b = r["losses"]
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    assert r["dh_equal"] and r["dw_close"]


# -- dynamic ---------------------------------------------------------------------------------


def test_dynamic_rule_keeps_the_last_segments_first():
    costs = [SegmentCosts(0, 0, 0)] + [SegmentCosts(100, 60, 50)] * 4
    kw = dict(fallback="full", in_flight=1, head_bytes=10)
    pinned = [None] * 5
    from tierlm.activations import choose_policies

    assert choose_policies(costs, pinned, None, **kw) == ["keep"] * 5
    roomy = choose_policies(costs, pinned, 10_000, **kw)
    assert roomy == ["keep"] * 5
    tight = choose_policies(costs, pinned, 230, **kw)
    assert tight[-1] == "keep" and tight[1] == "full"
    assert activation_peak_bytes(tight, costs, in_flight=1, head_bytes=10) <= 230
    with pytest.raises(PlacementError, match="--device-budget"):
        choose_policies(costs, pinned, 99, **kw)  # one block's recompute does not fit
    pinned[-1] = "offload"
    assert choose_policies(costs, pinned, 10_000, **kw)[-1] == "offload"


def dynamic_engine(model, budget):
    return new_engine(model, policy="none", device_budget_bytes=budget,
                      activations=_acts("dynamic"))


def test_dynamic_recomputes_more_as_the_budget_shrinks_and_stays_inside_it():
    layers = 4
    base = tiny_model("llama_untied", layers=layers)
    probe = dynamic_engine(copy.deepcopy(base), None)  # no budget: keep everything
    assert probe.activation_policies == ["keep"] * (layers + 1)
    state = probe.report.device_bytes - probe.activation_reserve_bytes  # weights + boundary
    step = batches(1, 1)[0]
    ref_loss = probe.step(step, OPTIM.lr)["loss"]
    ref_w = probe.weights()
    probe.close()
    budgets = [state + x for x in (20 * KEEP_BYTES, 3 * KEEP_BYTES, int(1.6 * KEEP_BYTES))]
    kept_counts, recomputed = [], []
    head = head_workspace_bytes(default_chunk_tokens(300), 300, B * T, D)
    for budget in budgets:
        eng = dynamic_engine(copy.deepcopy(base), budget + head)
        chosen = eng.activation_policies
        assert eng.step(step, OPTIM.lr)["loss"] == ref_loss  # mixed policies, same math
        w = eng.weights()
        assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)
        assert eng.ledger.step_peak_device_total_bytes <= budget + head, chosen
        assert eng.ledger.step_peak_tier_bytes[Tier.DEVICE] <= budget + head
        kept_counts.append(chosen.count("keep"))
        recomputed.append(sum(p in ("full", "selective") for p in chosen))
        # the last blocks keep first: along the blocks, full < selective < keep
        # (embed holds nothing but its input ids, so keeping it is free)
        rank = {"full": 0, "selective": 1, "keep": 2}
        blocks = [rank[p] for p in chosen[1:]]
        assert blocks == sorted(blocks), chosen
        eng.close()
    assert kept_counts[0] > kept_counts[1] > kept_counts[2]
    assert recomputed[0] < recomputed[1] < recomputed[2]
    with pytest.raises(PlacementError, match="--device-budget"):
        dynamic_engine(copy.deepcopy(base), state + KEEP_BYTES // 2)
    # asked to, it offloads what does not fit instead of recomputing it
    eng = new_engine(copy.deepcopy(base), policy="none", device_budget_bytes=budgets[2] + head,
                     activations=_acts("dynamic", dynamic_fallback="offload"))
    chosen = eng.activation_policies
    assert "offload" in chosen and "full" not in chosen
    assert eng.step(step, OPTIM.lr)["loss"] == ref_loss
    # the only traffic of a resident model: each offloaded block's saved bytes, there and back
    offloaded = chosen[1:].count("offload") * KEEP_BYTES
    assert eng.ledger.moved_bytes[Link.D2H] == eng.ledger.moved_bytes[Link.H2D] == offloaded
    eng.close()


# -- configuration -------------------------------------------------------------------------------


def cfg_of(**activations):
    return from_dict({"model": {"size": "tiny"}, "activations": activations})


def test_overrides_parse_and_resolve():
    rules = parse_overrides("block.[0-3]=full, block.1[01]=keep ,head=keep")
    assert [(p.pattern, pol) for p, pol in rules] == [
        ("block.[0-3]", "full"), ("block.1[01]", "keep"), ("head", "keep"),
    ]
    names = ["embed"] + [f"block.{i}" for i in range(12)]
    resident = [True] * 13
    got = resolve_policies("selective", "block.[0-3]=full,block.1[01]=keep", names, resident)
    assert got == ["selective"] + ["full"] * 4 + ["selective"] * 6 + ["keep"] * 2
    # none as the planner runs it: streamed segments recompute, resident ones keep
    assert resolve_policies("none", None, ["embed", "block.0"], [True, False],
                            planned=True) == ["keep", "full"]
    # none on its own: a streamed segment keeps where the budget holds it (no budget: all)
    assert resolve_policies("none", None, ["embed", "block.0"], [True, False]) == ["keep"] * 2
    block = SegmentCosts(keep_bytes=100, selective_bytes=40, selective_workspace_bytes=60)
    names3, streamed3 = ["embed", "block.0", "block.1"], [True, False, False]
    costs3 = [SegmentCosts(0, 0, 0), block, block]
    # the last block's saved tensors are gone before the first block recomputes: 100 holds
    # either, 200 both
    for budget, want in ((99, ["keep", "full", "full"]), (199, ["keep", "full", "keep"]),
                         (200, ["keep", "keep", "keep"])):
        assert resolve_policies("none", None, names3, streamed3, costs=costs3,
                                budget_bytes=budget) == want, budget
    assert resolve_policies("none", "block.1=selective", names3, streamed3, costs=costs3,
                            budget_bytes=199, fallback="offload") == [
        "keep", "offload", "selective"]  # keeping block.0 too: 100 + 40 held, + 60 workspace


@pytest.mark.parametrize(
    "text, message",
    [
        ("block.0", "is not pattern=policy"),
        ("block.0=fast", "unknown policy 'fast'"),
        ("block.(=full", "is not a regex"),
        ("head=full", "always keeps"),
        (".*=offload", "always keeps"),  # the pattern would take the head too
    ],
)
def test_bad_overrides_are_config_errors(text, message):
    with pytest.raises(ConfigError, match=rf"--activations.overrides: .*{message}"):
        cfg_of(overrides=text)


def test_flags_route_to_the_runtime_and_check_what_it_supports():
    from tierlm.cli import build_parser, config_from_args
    from tierlm.config import uses_tiered_runtime

    def parse(*argv):
        return config_from_args(build_parser().parse_args(["train", *argv]))

    for policy in ("selective", "offload", "dynamic"):
        cfg = parse("--grad-checkpointing", policy)
        assert uses_tiered_runtime(cfg)
        check_supported(cfg)
    assert not uses_tiered_runtime(parse("--grad-checkpointing", "full"))  # plain PyTorch
    cfg = parse("--grad-checkpointing", "dynamic", "--device-budget", "8GiB")
    assert cfg.memory.device_budget == "8GiB"
    for opt in ("Adafactor", "Lion"):  # every optimizer runs on the tiered runtime
        check_supported(parse("--grad-checkpointing", "selective", "--opt", opt))


def test_trainer_runs_selective_and_dynamic_like_none(tmp_path):
    from tierlm.runtime.reference import ReferenceStep
    from tierlm.train import Trainer

    def train(out, **acts):
        cfg = from_dict({
            "model": {"size": "tiny"},
            "data": {"seq_len": 32, "vocab_size": 512},
            "optim": {"lr": 3e-3, "warmup_steps": 2},
            "train": {"max_steps": 2, "batch_size": 2, "eval_every": 0, "eval_batches": 1,
                      "sample_tokens": 0},
            "activations": acts,
            "run": {"out": str(out), "device": "cpu", "seed": 3},
        })
        trainer = Trainer(cfg, log=lambda _m: None)
        return trainer, trainer.train()

    ref, plain = train(tmp_path / "none")
    assert isinstance(ref.stepper, ReferenceStep)
    # without --device-budget, dynamic keeps every segment (a budget: the engine test above)
    for policy, chosen in (("selective", "selective"), ("offload", "offload"),
                           ("dynamic", "keep")):
        trainer, result = train(tmp_path / policy, policy=policy)
        assert isinstance(trainer.stepper, Engine)
        assert set(trainer.stepper.activation_policies) == {chosen}, policy
        assert result.losses == pytest.approx(plain.losses, rel=1e-6), policy


# -- attention -----------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["llama_tied_gqa", "qwen2", "gpt2", "preset"])
def test_attention_runs_through_the_fused_sdpa_kernel(name):
    """No (T x T) attention matrix in any family: the blocks call SDPA's flash kernel (the CPU
    one here; CUDA picks its own fused kernel through the same call)."""
    if name == "preset":
        from tierlm.models import build_model, preset_config

        model = build_model(preset_config("tiny", vocab_size=300, max_seq_len=64), device="cpu")
    else:
        model = tiny_model(name, layers=1)
    assert model.config._attn_implementation == "sdpa"
    ops = _Ops()
    with ops:
        model(input_ids=torch.randint(0, 300, (B, T))).logits.sum().backward()
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in ops.seen
    assert not {"aten.bmm", "aten._softmax", "aten.baddbmm"} & ops.seen  # no eager attention


def test_dynamic_parks_the_inputs_it_recomputes_from_on_the_host():
    """`dynamic` with --boundary-activations host (a long sequence): the boundary inputs of the
    segments it recomputes wait in host RAM, those of the segments it keeps stay on the device
    (their graph refers to them) and count in what keeping costs; same math, inside the
    budget."""
    layers = 4
    base = tiny_model("llama_untied", layers=layers)
    step = batches(1, 1)[0]
    hidden = B * T * D * F32

    def engine(budget, tier):
        return new_engine(copy.deepcopy(base), policy="none", device_budget_bytes=budget,
                          activations=_acts("dynamic"), boundary_tier=tier)

    probe = engine(None, Tier.DEVICE)
    state = probe.report.device_bytes - probe.activation_reserve_bytes
    ref_loss = probe.step(step, OPTIM.lr)["loss"]
    ref_w = probe.weights()
    probe.close()
    head = head_workspace_bytes(default_chunk_tokens(300), 300, B * T, D)
    budget = state + 3 * KEEP_BYTES + head
    eng = engine(budget, Tier.HOST)
    chosen = eng.activation_policies
    assert "full" in chosen and "keep" in chosen, chosen
    before = dict(eng.ledger.moved_bytes)
    assert eng.step(step, OPTIM.lr)["loss"] == ref_loss
    w = eng.weights()
    assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)
    # every recomputed block's input goes out and comes back once (embed takes token ids)
    parked = sum(p == "full" for p in chosen[1:]) * hidden
    assert eng.ledger.moved_bytes[Link.D2H] - before.get(Link.D2H, 0) == parked
    assert eng.ledger.moved_bytes[Link.H2D] - before.get(Link.H2D, 0) == parked
    assert eng.ledger.step_peak_device_total_bytes <= budget, chosen
    eng.close()
    # the same budget with every input on the device keeps no more blocks
    on_device = engine(budget, Tier.DEVICE)
    assert on_device.activation_policies.count("keep") <= chosen.count("keep")
    on_device.close()


def test_dynamic_under_fp8_mixes_policies_with_the_same_math_and_statistics():
    """`--precision fp8 --grad-checkpointing dynamic` (emulated fp8 on the CPU): its probe and
    its steps run `selective` over fp8 layers, whose replay used to raise (the emulated matmul
    scaled its cached output in place; the scalers recorded again, adding ops the forward had
    not run). A budget that mixes keep, selective and full gives the losses, weights and fp8
    statistics of keeping every graph; the probe's random inputs record nothing."""
    from tierlm.config import PrecisionConfig
    from tierlm.precision import PrecisionLinear, prepare_precision

    base = tiny_model("llama_untied", layers=4)
    steps = batches(2, 1)

    def run(budget):
        model = copy.deepcopy(base)
        prepare_precision(model, PrecisionConfig(mode="fp8"), "fp8", CPU, log=lambda _m: None)
        eng = dynamic_engine(model, budget)
        losses = [eng.step(s, OPTIM.lr)["loss"] for s in steps]
        counts = {s.name: s.count for m in model.modules()
                  if isinstance(m, PrecisionLinear) and hasattr(m.compute, "scalers")
                  for s in m.compute.scalers.all()}
        return eng, losses, counts

    probe, ref_losses, ref_counts = run(None)
    assert probe.activation_policies == ["keep"] * 5
    state = probe.report.device_bytes - probe.activation_reserve_bytes
    keep_bytes = probe.activation_costs[1].keep_bytes
    ref_w = probe.weights()
    probe.close()
    head = head_workspace_bytes(default_chunk_tokens(300), 300, B * T, D)
    budget = state + head + int(1.6 * keep_bytes)
    eng, losses, counts = run(budget)
    assert "selective" in eng.activation_policies and "keep" in eng.activation_policies
    assert losses == ref_losses
    w = eng.weights()
    assert all(torch.equal(w[k], ref_w[k]) for k in ref_w)
    # the probe (random inputs) and the recomputes recorded nothing: each weight, once a step
    assert counts == ref_counts
    assert ref_counts["model.layers.0.self_attn.o_proj.weight"] == len(steps) * D * D
    assert eng.ledger.step_peak_device_total_bytes <= budget
    eng.close()
