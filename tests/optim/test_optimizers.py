"""Optimizers over tiered state (tierlm.optim): each `--opt` on the tiered runtime reproduces the
same optimizer on the reference trainer (host and disk state, both micro-batch orders, clipping
active), resumes bit for bit across placements, and is counted by the planner as the runtime
holds it; the wiring takes slots of any dtype and block size (a fake 8-bit optimizer on chunked
disk state)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.runtime_helpers import (
    assert_close_run,
    assert_same_state,
    batches,
    new_engine,
    tiny_model,
)
from tierlm.checkpoint import SafetensorsFile, write_safetensors
from tierlm.config import NotSupportedYet, OptimConfig
from tierlm.distributed.delayed import Delayed, DelayedSync
from tierlm.memory.layout import FlatLayout
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.optim import OPTIMIZERS, build_flat_optimizer, build_optimizer
from tierlm.optim import native as kernels
from tierlm.optim.adafactor import FlatAdafactor
from tierlm.optim.flat import FlatOptimizer, StateSlot, params_in
from tierlm.optim.lion import Lion
from tierlm.plan.describe import describe
from tierlm.plan.evaluate import evaluate
from tierlm.plan.result import usable_budgets
from tierlm.runtime import Engine
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.shapes import ModelShape

CPU = torch.device("cpu")
B, T, M, STEPS = 2, 16, 2, 5
CHUNK = 1024  # elements: the tiny model's disk segments update in several chunks
CLIP = 0.05  # below every step's gradient norm: clipping is active throughout
# Adafactor's update in torch's operations, and in the C kernel where it builds here
NATIVE = [False] + ([True] if kernels.adafactor_kernel() is not None else [])
CONFIGS = {
    "AdamW": OptimConfig(name="AdamW", lr=1e-2, weight_decay=0.1),
    "Lion": OptimConfig(name="Lion", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.99),
    "Adafactor": OptimConfig(name="Adafactor", lr=1e-2, weight_decay=0.1),
}
# the low-bit optimizers' runtime-vs-reference tests are in optim/test_lowbit_optim.py; resume here
RESUMED = {
    **CONFIGS,
    "AdamW8bit": OptimConfig(name="AdamW8bit", lr=1e-2, weight_decay=0.1),
    "GaLoreAdamW": OptimConfig(name="GaLoreAdamW", lr=1e-2, weight_decay=0.1, galore_rank=4,
                               galore_update_every=3),  # the resumed steps 3-4 refresh once
}


def _engine(model, cfg: OptimConfig, tmp_path, **kw) -> Engine:
    return new_engine(model, tmp_path, optim=cfg, micro_batches=M, grad_clip=CLIP,
                      staging_chunk_numel=CHUNK, **kw)


def _lrs(cfg: OptimConfig) -> list[float]:
    return [cfg.lr * (1 - 0.1 * i) for i in range(STEPS)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runtime_matches_reference_trainer(name, tmp_path):
    cfg = CONFIGS[name]
    base = tiny_model("llama_tied_gqa", layers=2)
    steps, lrs = batches(STEPS, M), _lrs(cfg)
    ref_model = copy.deepcopy(base)
    ref = ReferenceStep(ref_model, cfg, grad_clip=CLIP, device=CPU)
    ref_recs = [ref.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
    ref_weights = {k: v.detach().clone() for k, v in ref_model.named_parameters()}
    ref_state = ref.optimizer_state()
    assert all(r["grad_norm"] > CLIP for r in ref_recs)
    for policy, order in (("host", "microbatch-outer"), ("host", "layer-outer"),
                          ("disk", "microbatch-outer"), ("disk", "layer-outer")):
        eng = _engine(copy.deepcopy(base), cfg, tmp_path / f"{policy}-{order}", policy=policy,
                      microbatch_order=order)
        recs = [eng.step(b, lr) for b, lr in zip(steps, lrs, strict=True)]
        weights, state = eng.weights(), eng.optimizer_state()
        eng.close()
        assert_close_run([r["loss"] for r in recs], [r["loss"] for r in ref_recs], weights,
                         ref_weights)
        assert_same_state(state, ref_state, (policy, order))


def test_lion_reference_is_the_papers_update():
    """Lion (optim/lion.py) against the update as Chen et al. 2023 write it, per parameter:
    c = b1 m + (1 - b1) g; p = p - lr (sign(c) + wd p); m = b2 m + (1 - b2) g."""
    torch.manual_seed(0)
    params = [torch.randn(6, 5), torch.randn(5)]
    mine = [p.clone().requires_grad_() for p in params]
    lr, (b1, b2), wd = 3e-3, (0.9, 0.99), 0.1
    opt = Lion([{"params": mine[:1], "weight_decay": wd}, {"params": mine[1:],
                                                           "weight_decay": 0.0}],
               lr=lr, betas=(b1, b2))
    paper = [p.clone() for p in params]
    moments = [torch.zeros_like(p) for p in params]
    for _ in range(6):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(mine, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for i, (g, decay) in enumerate(zip(grads, (wd, 0.0), strict=True)):
            c = b1 * moments[i] + (1 - b1) * g
            paper[i] = paper[i] - lr * (torch.sign(c) + decay * paper[i])
            moments[i] = b2 * moments[i] + (1 - b2) * g
    for p, want, m, want_m in zip(mine, paper, (opt.state[q]["exp_avg"] for q in mine),
                                  moments, strict=True):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, want_m, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("native", NATIVE)
def test_flat_adafactor_is_torch_adafactor(native):
    """On flat buffers (a 3-D parameter too, factored over its last two dimensions) FlatAdafactor
    gives torch.optim.Adafactor's weights and state: bit for bit in torch's operations, to a few
    units in the last place in the C kernel; the reference trainer builds that very optimizer."""
    torch.manual_seed(0)
    shapes = {"w": ((4, 6, 5), True), "m": ((7, 3), True), "b": ((5,), False)}
    params = {n: torch.randn(s) for n, (s, _) in shapes.items()}
    layout = FlatLayout([(n, s, d) for n, (s, d) in shapes.items()])
    cfg = CONFIGS["Adafactor"]
    ref_params = {n: p.clone().requires_grad_() for n, p in params.items()}
    model = torch.nn.Module()
    for n, p in ref_params.items():
        model.register_parameter(n, torch.nn.Parameter(p))
    ref = build_optimizer(model, cfg)
    assert isinstance(ref, torch.optim.Adafactor)
    flat_opt = FlatAdafactor(cfg, native=native)
    assert isinstance(build_flat_optimizer(cfg), FlatAdafactor)
    master = layout.pack(params, torch.empty(layout.numel))
    state = {s.name: torch.zeros(s.numel(layout)) for s in flat_opt.slots}
    steps = [torch.zeros(()) for _ in layout.groups()]
    for i in range(4):
        grads = {n: torch.randn(s) for n, (s, _) in shapes.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        ref.step()
        flat_opt.update_range(layout, 0, master, layout.pack(grads, torch.empty(layout.numel)),
                              state, steps, cfg.lr * (1 - 0.1 * i))
        for group in ref.param_groups:
            group["lr"] = cfg.lr * (1 - 0.1 * (i + 1))
        for s in steps:
            s.add_(1)
    for n, p in model.named_parameters():
        _assert_adafactor_close(layout.views(master)[n], p.detach(), params[n], exact=not native)
        for slot in flat_opt.slots:
            if slot.name in ref.state[p]:
                _assert_adafactor_close(slot.views(layout, state[slot.name])[n],
                                        ref.state[p][slot.name], exact=not native)


@pytest.mark.skipif(kernels.adafactor_kernel() is None, reason="no C compiler")
def test_adafactor_kernel_agrees_with_eager():
    """The C kernel against torch's operations over 6 steps: odd row and column counts, a 3-D
    parameter, a single row, a vector; a gradient row and column that stay zero (the estimate
    clamped at eps1^2), a matrix of tiny gradients (the mean row statistic clamped at eps1, the
    estimate at eps1^2: the update summed element by element);
    weight decay on the matrices; lr above and below rho_t's 1/sqrt(t)."""
    torch.manual_seed(0)
    shapes = {"w": ((3, 129, 17), True), "m": ((37, 53), True), "r": ((1, 9), True),
              "b": ((101,), False)}
    layout = FlatLayout([(n, s, d) for n, (s, d) in shapes.items()])
    start = torch.randn(layout.numel)
    grads = [torch.randn(layout.numel) for _ in range(6)]
    for g in grads:
        m = layout.views(g)["m"]
        m[5].zero_()
        m[:, 7].zero_()
        layout.views(g)["r"].mul_(1e-6)
    cfg = dataclasses.replace(CONFIGS["Adafactor"], weight_decay=0.1)
    runs = []
    for native in (False, True):
        opt = FlatAdafactor(cfg, native=native)
        master = start.clone()
        state = {s.name: torch.zeros(s.numel(layout)) for s in opt.slots}
        steps = [torch.zeros(()) for _ in layout.groups()]
        for i, g in enumerate(grads):
            opt.update_range(layout, 0, master, g, state, steps, 0.6 if i < 3 else 1e-2)
            for s in steps:
                s.add_(1)
        runs.append((master, state))
    (eager, eager_state), (native, native_state) = runs
    assert not torch.equal(eager, start)
    _assert_adafactor_close(native, eager, start, exact=False)
    for name, v in eager_state.items():
        _assert_adafactor_close(native_state[name], v, exact=False)
    row, col = (slot.views(layout, native_state[slot.name])["m"] for slot in opt.slots[:2])
    assert row[5].item() == 0 and col[0, 7].item() == 0  # the zero row and column's statistics


def _assert_adafactor_close(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor | None
                            = None, *, exact: bool) -> None:
    """Equal, or (the C kernel) within 1e-6 of each value and of the largest change from
    `start` (the statistics: from zero): a few units in the last place of either."""
    if exact:
        assert torch.equal(got, want)
    else:
        moved = (want - (0 if start is None else start)).abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * moved)


def _save(eng: Engine, path) -> dict[str, SafetensorsFile]:
    """The engine's state as the trainer checkpoints it: a safetensors file per shard."""
    files = {}
    for name, weights, optim in eng.state_shards():
        for kind, tensors in (("model", weights), ("optim", optim)):
            write_safetensors(path / f"{kind}-{name}.safetensors", tensors)
            files[f"{kind}-{name}"] = SafetensorsFile(path / f"{kind}-{name}.safetensors")
    return files


def _read(files, kind: str) -> dict[str, torch.Tensor]:
    return {k: f.read(k) for n, f in files.items() if n.startswith(kind) for k in f.entries}


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_across_placements_is_bit_exact(name, tmp_path):
    """Host-state run saved after 2 steps, disk-state run (chunked) resumed from the files: the
    last 2 steps give exactly what 4 uninterrupted host steps give."""
    cfg = RESUMED[name]
    base = tiny_model("llama_tied_gqa", layers=2)
    steps, lrs = batches(4, M), _lrs(cfg)[:4]
    straight = _engine(copy.deepcopy(base), cfg, tmp_path / "a", policy="host")
    for b, lr in zip(steps, lrs, strict=True):
        straight.step(b, lr)
    want = {**straight.weights(), **straight.optimizer_state()}
    straight.close()
    first = _engine(copy.deepcopy(base), cfg, tmp_path / "b", policy="host")
    for b, lr in zip(steps[:2], lrs[:2], strict=True):
        first.step(b, lr)
    (tmp_path / "ckpt").mkdir()
    files = _save(first, tmp_path / "ckpt")
    first.close()
    resumed = _engine(copy.deepcopy(base), cfg, tmp_path / "c", policy="disk")
    resumed.load(_read(files, "model"), _read(files, "optim"))
    for b, lr in zip(steps[2:], lrs[2:], strict=True):
        resumed.step(b, lr)
    got = {**resumed.weights(), **resumed.optimizer_state()}
    (tmp_path / "ckpt2").mkdir()
    shards = _save(resumed, tmp_path / "ckpt2")  # disk state read parameter by parameter
    resumed.close()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    saved = {**_read(shards, "model"), **_read(shards, "optim")}
    assert saved.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(saved[k], v.reshape(saved[k].shape)) and saved[k].shape == v.shape, k


class FakeBlockwise(FlatOptimizer):
    """Stands in for an 8-bit optimizer: an int8 elementwise slot and an fp32 slot with one
    element per 256 parameter elements (per parameter, the last block partial), both rewritten
    every step from the gradient, so a chunked update that cut a block or misplaced a byte would
    change the weights."""

    name = "Fake8bit"
    slots = (StateSlot("q", dtype=torch.int8),
             StateSlot("scale", numel_of=lambda p: -(-p.numel // 256), block=256,
                       average=False))
    align = 256

    def update_range(self, layout, lo, master, grad, state, steps, lr):
        hi = lo + master.numel()
        q, scale = state["q"], state["scale"]
        s_lo, _ = self.slots[1].range(layout, lo, hi)
        offsets = dict(zip((p.name for p in layout.slots), self.slots[1].offsets(layout),
                           strict=True))
        for p, a, b in params_in(layout, lo, hi):
            first = offsets[p.name] + (a - p.offset) // 256 - s_lo
            for k, start in enumerate(range(a, b, 256)):
                end = min(start + 256, b)
                g = grad[start - lo : end - lo]
                amax = g.abs().max().clamp(min=1e-12)
                scale[first + k] = scale[first + k] * 0.5 + amax
                q[start - lo : end - lo] = (
                    q[start - lo : end - lo].float() * 0.5 + g / amax * 60).round().to(torch.int8)
                master[start - lo : end - lo] -= lr * q[start - lo : end - lo].float() * \
                    scale[first + k]


def test_int8_and_block_slots_on_chunked_disk_state(tmp_path, monkeypatch):
    """Slots of another dtype and block size go through the state homes, chunked disk staging
    (parts that start inside an O_DIRECT block), checkpoints and delayed sync's check."""
    base = tiny_model("llama_tied_gqa", layers=2)
    cfg = dataclasses.replace(CONFIGS["AdamW"], name="Fake8bit")
    monkeypatch.setitem(OPTIMIZERS, "Fake8bit", (None, FakeBlockwise))
    steps = batches(3, M)
    runs = {}
    for policy in ("host", "disk"):
        eng = _engine(copy.deepcopy(base), cfg, tmp_path / policy, policy=policy)
        if policy == "disk":
            opt = eng.optimizer
            cut = [st for st in eng.states if len(opt.chunk_ranges(st.layout, CHUNK)) > 1]
            assert cut
            for st in cut:  # cut only at parameter starts or 256-multiples inside one
                for lo, _ in opt.chunk_ranges(st.layout, CHUNK):
                    p = next(p for p in st.layout.slots if p.offset <= lo < p.offset + p.numel)
                    assert (lo - p.offset) % 256 == 0
            # some chunk's int8 part starts inside a disk block: the shared-block path runs
            assert any(lo % 4096 for st in cut for lo, _ in opt.chunk_ranges(st.layout, CHUNK))
        for b in steps:
            eng.step(b, 1e-3)
        state = eng.optimizer_state()
        assert {v.dtype for k, v in state.items() if k.endswith(".q")} == {torch.int8}
        runs[policy] = ({**eng.weights(), **state}, eng.ledger.tier_bytes(Tier.DISK))
        if policy == "disk":
            (tmp_path / "ckpt").mkdir()
            files = _save(eng, tmp_path / "ckpt")
            saved = {**_read(files, "model"), **_read(files, "optim")}
            for k, v in runs[policy][0].items():
                assert torch.equal(saved[k], v), k
        eng.close()
    host, disk = runs["host"][0], runs["disk"][0]
    assert host.keys() == disk.keys()
    for k in host:
        assert torch.equal(host[k], disk[k]), k
    assert any(v.abs().sum() > 0 for k, v in host.items() if k.endswith(".q"))
    n = sum(p.numel() for p in base.parameters())  # tied weights once
    # master, gradient, the int8 slot, the scales: the files hold each byte once
    assert runs["disk"][1] == n * (4 + 4 + 1) + 4 * sum(
        v.numel() for k, v in host.items() if k.endswith(".scale"))
    with pytest.raises(NotSupportedYet, match="--opt Fake8bit with --sync-moments average"):
        Delayed(None, DelayedSync(every=2, moments="average")).check_optimizer(FakeBlockwise(cfg))
    Delayed(None, DelayedSync(every=2)).check_optimizer(FakeBlockwise(cfg))  # local: fine


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planner_counts_the_optimizers_state(name, tmp_path):
    """The planner's optimizer-state bytes per tier equal the runtime's ledger, and the plan
    text names the optimizer and its bytes."""
    cfg = CONFIGS[name]
    model = tiny_model("llama_untied", layers=2)
    shape = ModelShape.from_config(copy.deepcopy(model.config), optim=cfg)
    eng = _engine(model, cfg, tmp_path, policy="host")
    optim_bytes = eng.ledger.current_bytes[(Tier.HOST, TensorClass.OPTIM)]
    placements = eng.report.placements
    eng.close()
    assert optim_bytes == sum(shape.optim_state_bytes) > 0
    from tierlm.memory.hardware import PROFILES
    from tierlm.runtime.shapes import TrainShape

    hw = PROFILES["rtx4090"]
    p = evaluate(shape, TrainShape(B, T, M), hw, placements, "microbatch-outer", True,
                 usable_budgets(hw))
    assert p.host_by_class["optim_state"] == optim_bytes
    assert f"{name} state" in describe(p, shape, TrainShape(B, T, M), hw)


def test_plan_prints_each_optimizers_state_bytes(capsys):
    from tierlm.cli import main

    printed = {}
    for name in ("AdamW", "Adafactor"):
        assert main(["plan", "--model-size", "small", "--hardware", "rtx4060ti-16g", "--opt",
                     name]) == 0
        printed[name] = capsys.readouterr().out
        assert f"{name} state" in printed[name]
    # AdamW: 8 bytes per parameter; Adafactor: a few bytes per row and column
    assert "(8.00 B/param)" in printed["AdamW"]
    assert "(0.0" in printed["Adafactor"].split("Adafactor state")[1].split("\n")[0]
    assert main(["plan", "--model-size", "small", "--hardware", "rtx4060ti-16g",
                 "--no-optimizer-table"]) == 0
    assert "each optimizer" not in capsys.readouterr().out
    # every optimizer's row in the comparison, the same whichever --opt was planned
    table = {name: out.split("each optimizer (--opt) in this plan:")[1]
             for name, out in printed.items()}
    assert table["AdamW"] == table["Adafactor"]
    rows = {line.split()[0]: line.split() for line in table["AdamW"].strip().splitlines()[1:]}
    assert set(rows) == set(OPTIMIZERS)
    bpp = {name: float(row[3]) for name, row in rows.items()}  # "<name> <x> GiB <B/param>"
    assert bpp["AdamW"] == 8.0 and bpp["Lion"] == 4.0 and 2.0 < bpp["AdamW8bit"] < 2.1
    assert bpp["Adafactor"] < 0.1 and bpp["GaLoreAdamW"] < bpp["AdamW"]
