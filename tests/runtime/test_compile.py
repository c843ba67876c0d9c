"""--compile segments: the compiled block and chunk loss reproduce eager PyTorch (fp32, and bf16
against eager bf16, within 1e-5), in the reference trainer and the tiered runtime with streamed
segments, under LoRA/QLoRA and 2-rank data parallel, resume like an eager run, and compile once
per distinct graph whatever the number of blocks; the planner scales the blocks' compute by the
ratio `tierlm probe --compile segments` measured.

Compilation dominates the time here: every test uses the same tiny shapes (B=2, T=16, 3 blocks),
so in one session a model class compiles once and later tests reuse the in-memory code, and
the inductor cache is one directory for the session."""

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.runtime_helpers import batches, new_engine, tiny_model
from tierlm.config import ActivationConfig, NotSupportedYet, OptimConfig, PrecisionConfig, from_dict
from tierlm.memory.cuda_allocator import configure_cuda_allocator
from tierlm.precision import prepare_precision
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.compile import (
    NoCompile,
    SegmentCompile,
    block_modules,
    check_compile,
    compiled_graphs,
    inductor_cache_dir,
    kernels_key,
)
from tierlm.runtime.reference import ReferenceStep

CPU = torch.device("cpu")
B, T, LAYERS, STEPS = 2, 16, 3, 4
REL = 1e-5
# The compiled kernels sum in another order (~1e-7 relative). Under AdamW's usual eps an element
# whose gradient is rounding noise (GPT-2's key bias: softmax cancels it) moves by ~lr either
# way in each run; an eps above such noise keeps every update proportional to its gradient, so
# the weights are compared as tightly as the losses.
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-4)


@pytest.fixture(scope="module")
def compiler():
    """One inductor cache for every session's compiled tests, kept between sessions as the C
    kernels' build folder is (a cold cache costs minutes on two cores, a warm one seconds);
    an explicit TORCHINDUCTOR_CACHE_DIR wins. The cache is keyed by the graphs' content."""
    return SegmentCompile(Path(tempfile.gettempdir()) / f"tierlm-test-inductor-{os.getuid()}")


def test_inductor_cache_under_tierlm_unless_the_user_chose_one(monkeypatch, tmp_path):
    """Importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's temporary default: that
    is not the user's choice, so the kernels go under tierlm's cache dir; a directory the user
    set wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    ours, mine = tmp_path / "ours", tmp_path / "mine"
    keyed = ours / f"kernels-{kernels_key()}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert inductor_cache_dir(ours) == keyed
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(keyed)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert inductor_cache_dir(ours) == keyed
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    assert inductor_cache_dir(ours) == mine
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)


@pytest.mark.parametrize("change", ["torch", "code"])
def test_kernels_of_another_torch_or_other_code_go_to_another_folder(change, monkeypatch,
                                                                     tmp_path):
    """The kernel cache is shared by runs and clones: its folder is keyed by the library
    versions and the source of the code that builds the graphs (tierlm.cache_keys)."""
    import tierlm.cache_keys as keys

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = inductor_cache_dir(tmp_path)
    if change == "code":
        files = []
        real_digest = keys.source_digest
        monkeypatch.setattr(keys, "source_digest",
                            lambda *f: files.extend(f) or real_digest(*f) + "edit")
    else:
        versions = tuple((n, v + "+other" if n == "torch" else v)
                         for n, v in keys.library_versions())
        monkeypatch.setattr(keys, "library_versions", lambda: versions)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    after = inductor_cache_dir(tmp_path)
    assert after.parent == before.parent == tmp_path and after != before
    if change == "code":  # the module that compiles and the loss it compiles
        assert {Path(f).name for f in files} == {"compile.py", "chunked_loss.py"}


def _engine(model, tmp_path, compiled, policy, acts="none", optim=OPTIM, autocast=None):
    return new_engine(model, tmp_path / f"off-{policy}", optim=optim, policy=policy,
                      grad_clip=1.0, chunk_loss=compiled.chunk_loss,
                      activations=ActivationConfig(policy=acts),
                      **({"autocast": autocast} if autocast else {}))


def _run(stepper, steps, lr=OPTIM.lr):
    return [stepper.step(b, lr)["loss"] for b in steps]


def _assert_close(losses, ref_losses, weights, ref_weights, what):
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= REL * abs(b), (what, losses, ref_losses)
    for k, ref in ref_weights.items():
        rel = ((weights[k] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert rel <= REL, (what, k, rel)


def _fresh_compile_counts():
    """Empty dynamo's in-memory cache (kernels still come from the inductor cache) and return
    a function giving the graphs compiled and the graph breaks since: a compiled test asserts
    them, or an eager fallback (a compile error suppressed, a block left uncompiled) would pass
    its comparison with eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs, breaks = compiled_graphs(), sum(counters["graph_break"].values())
    return lambda: (compiled_graphs() - graphs, sum(counters["graph_break"].values()) - breaks)


@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_compiled_matches_eager_resident_host_and_disk(compiler, name, tmp_path):
    """The reference trainer with compiled blocks, and the tiered runtime with the blocks
    streamed from host and disk (recomputed in the backward), against the eager reference."""
    base = tiny_model(name, layers=LAYERS)
    steps = batches(STEPS, 1, B, T)
    eager = copy.deepcopy(base)
    ref_losses = _run(ReferenceStep(eager, OPTIM, grad_clip=1.0, device=CPU), steps)
    ref_weights = {k: v.detach().clone() for k, v in eager.named_parameters()}

    model = copy.deepcopy(base)
    compiler.apply(model, lambda msg: None)
    assert all(b._compiled_call_impl is not None for b in block_modules(model))
    resident = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU)
    _assert_close(_run(resident, steps), ref_losses, resident.weights(), ref_weights, "resident")

    for policy in ("host", "disk"):
        model = copy.deepcopy(base)
        compiler.apply(model, lambda msg: None)
        eng = _engine(model, tmp_path, compiler, policy, "full")
        assert not any(p.resident for p in eng.report.placements[1:-1])  # blocks stream
        losses = _run(eng, steps)
        weights = eng.weights()
        eng.close()
        _assert_close(losses, ref_losses, weights, ref_weights, policy)


def test_streaming_compiles_the_block_once(compiler, tmp_path):
    """From an empty in-memory cache, 3 streamed steps of a 3-block model compile one graph per
    distinct call (the block without grad, the block recomputed with grad, the chunk loss), not
    one per block, and steps 2 and 3 compile nothing."""
    torch._dynamo.reset()
    base = tiny_model("llama_tied_gqa", layers=LAYERS)
    compiler = SegmentCompile(compiler.cache_dir)  # a fresh compiled chunk loss after reset
    compiler.apply(base, lambda msg: None)
    eng = _engine(base, tmp_path, compiler, "host", "full")
    before = compiled_graphs()
    recs = []
    for step in batches(3, 1, B, T):  # the trainer adds end_step's count to metrics.jsonl
        recs.append(compiler.end_step(eng.step(step, OPTIM.lr))["compiled_graphs"])
    eng.close()
    assert recs[0] - before == 3  # block no-grad, block with grad, chunk loss
    assert recs[1:] == recs[:1] * 2  # no recompiles while streaming


def test_compiled_resume_equals_eager_resume(compiler, tmp_path):
    """2 steps host-streamed, the state handed to a fresh disk-tier engine (a resume), 2 more
    steps: compiled and eager agree."""
    base = tiny_model("llama_tied_gqa", layers=LAYERS)
    steps = batches(STEPS, 1, B, T)
    results = {}
    for compiled in (NoCompile(), compiler):
        model = copy.deepcopy(base)
        compiled.apply(model, lambda msg: None)
        first = _engine(model, tmp_path / type(compiled).__name__, compiled, "host", "full")
        losses = _run(first, steps[:2])
        weights, optim = first.weights(), first.optimizer_state()
        first.close()
        model = copy.deepcopy(base)
        compiled.apply(model, lambda msg: None)
        second = _engine(model, tmp_path / type(compiled).__name__, compiled, "disk", "full")
        second.load(weights, optim)
        losses += _run(second, steps[2:])
        results[type(compiled)] = losses, second.weights()
        second.close()
    (losses, weights), (ref_losses, ref_weights) = results[SegmentCompile], results[NoCompile]
    _assert_close(losses, ref_losses, weights, ref_weights, "resume")


@pytest.mark.parametrize("base_format, precision", [
    ("fp32", "fp32"), ("nf4", "fp32"),
    # the bf16 LoRA graph is qlora's under bf16 (the base's format only changes the load action)
    pytest.param("bf16", "bf16", marks=pytest.mark.slow), ("nf4", "bf16")])
def test_lora_and_qlora_compiled_match_eager(compiler, base_format, precision, tmp_path):
    """--finetune lora (base_format fp32; bf16: its bf16 compute copy) and qlora (nf4: decoded
    by the load action, outside the graph) with every block streamed from host and recomputed,
    3 steps, compiled against eager in the same precision: losses and adapters within 1e-5
    (measured: losses 8e-8 relative, adapters 7e-7 of their norm, bf16 bitwise). fp32 LoRA also
    on the reference trainer (everything resident, the model's own forward). The LoRA graphs
    are shared by lora and qlora; the steps after the first compile nothing."""
    from tests.runtime_helpers import bf16_autocast, bf16_model
    from tierlm.config import LoraConfig
    from tierlm.finetune.lora import apply_lora

    base = tiny_model("llama_tied_gqa", layers=LAYERS)
    apply_lora(base, LoraConfig(rank=4, alpha=8.0), seed=3)
    autocast = None
    if precision == "bf16":
        bf16_model(base)
        autocast = bf16_autocast
    steps = batches(3, 1, B, T)

    def host_run(compiled):
        counts = _fresh_compile_counts()
        compiled = compiled()  # after the reset: its chunk loss compiles afresh
        model = copy.deepcopy(base)
        compiled.apply(model, lambda msg: None)
        opts = EngineOptions(policy="host", offload_dir=str(tmp_path / type(compiled).__name__),
                             batch_size=B, seq_len=T, grad_clip=1.0, base_format=base_format,
                             chunk_loss=compiled.chunk_loss,
                             activations=ActivationConfig(policy="full"),
                             **({"autocast": autocast} if autocast else {}))
        eng = build_engine(model, OPTIM, opts, device=CPU)
        assert all(st.frozen for st in eng.states[1:-1])  # a frozen base streamed
        graphs, losses = [], []
        for step in steps:
            losses.append(eng.step(step, OPTIM.lr)["loss"])
            graphs.append(compiled_graphs())
        weights = eng.weights()
        eng.close()
        assert graphs[1:] == graphs[:1] * (len(steps) - 1)  # no recompiles
        return losses, weights, counts()

    eager_losses, eager_weights, eager_counts = host_run(NoCompile)
    assert eager_counts == (0, 0)
    assert all("lora_" in k for k in eager_weights)  # the adapters alone are trained
    losses, weights, counts = host_run(
        lambda: SegmentCompile(compiler.cache_dir, precision=precision))
    # block without grad, block recomputed with grad, chunk loss; unbroken
    assert counts == (3, 0)
    _assert_close(losses, eager_losses, weights, eager_weights, f"{base_format} {precision}")
    if (base_format, precision) == ("fp32", "fp32"):
        runs = []
        for compiled in (NoCompile, lambda: SegmentCompile(compiler.cache_dir)):
            counts = _fresh_compile_counts()
            compiled = compiled()
            model = copy.deepcopy(base)
            compiled.apply(model, lambda msg: None)
            ref = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU)
            runs.append((_run(ref, steps), ref.weights(), counts()))
        (losses, weights, counts), (eager_losses, eager_weights, eager_counts) = runs[1], runs[0]
        # the block with grad, twice: block 0's input (the frozen embedding's output) does
        # not require grad, the later blocks' does
        assert eager_counts == (0, 0) and counts == (2, 0)
        _assert_close(losses, eager_losses, weights, eager_weights, "lora resident")


def _data_parallel_runs(world, compiler, tmp: str) -> dict:
    """Per rank: 3 steps of 2-rank data parallel (dense sync, blocks streamed from host),
    eager and compiled, on this rank's half of each global batch."""
    import numpy as np

    from tierlm.distributed.comm import Comm
    from tierlm.distributed.data_parallel import DataParallelStep
    from tierlm.distributed.sync import DenseSync
    from tierlm.memory.ledger import Ledger

    out = {}
    for name, make in (("eager", NoCompile),
                       ("compiled", lambda: SegmentCompile(compiler.cache_dir))):
        counts = _fresh_compile_counts()  # what this rank compiles (the kernels are cached)
        compiled = make()
        model = tiny_model("llama_tied_gqa", layers=LAYERS)
        compiled.apply(model, lambda msg: None)
        comm = Comm(world.size, Ledger())
        sync = DenseSync().build(comm)
        opts = EngineOptions(policy="host", offload_dir=f"{tmp}/{name}{world.rank}",
                             batch_size=B, seq_len=T, grad_clip=1.0, grad_sync=sync,
                             chunk_loss=compiled.chunk_loss,
                             activations=ActivationConfig(policy="full"))
        engine = build_engine(model, OPTIM, opts, device=CPU)
        comm.ledger = engine.ledger
        dp = DataParallelStep(engine, sync, world, comm)
        losses = [dp.step([b.tensor_split(world.size)[world.rank] for b in step], OPTIM.lr)[
            "loss"] for step in batches(3, 1, B * world.size, T)]
        out[name] = losses, {k: np.array(v) for k, v in dp.weights().items()}, counts()
        dp.close()
    return out


def test_data_parallel_compiled_matches_eager(compiler, tmp_path):
    """--nproc 2 over gloo with --compile segments: each rank's compiled run equals its eager
    run within 1e-5 (losses and weights), and the ranks hold the same weights."""
    from tests.distributed.test_distributed import run_ranks

    # compile here first, on one thread as each rank runs (inductor's CPU kernels are keyed by
    # the thread count): the forked ranks then read the kernels from the cache instead of both
    # compiling them at once on one core each (minutes with a cold cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model("llama_tied_gqa", layers=LAYERS)
        compiler.apply(model, lambda msg: None)
        warm = _engine(model, tmp_path, compiler, "host", "full")
        _run(warm, batches(1, 1, B, T))
        warm.close()
    finally:
        torch.set_num_threads(threads)
    ranks = run_ranks(lambda w: _data_parallel_runs(w, compiler, str(tmp_path)))
    for rank in ranks:
        (losses, weights, counts), (ref_losses, ref_weights, ref_counts) = (rank["compiled"],
                                                                            rank["eager"])
        # each rank ran the compiled block (without grad, recomputed with grad) and chunk loss
        assert counts == (3, 0) and ref_counts == (0, 0)
        _assert_close(losses, ref_losses, {k: torch.from_numpy(v) for k, v in weights.items()},
                      {k: torch.from_numpy(v) for k, v in ref_weights.items()}, "dp")
    assert all((ranks[0]["compiled"][1][k] == ranks[1]["compiled"][1][k]).all()
               for k in ranks[0]["compiled"][1])


def _cfg(**over):
    data = {"run": {"compile": "segments"}}
    for key, value in over.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return from_dict(data)


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_bf16_compiled_matches_eager_bf16_resident_and_host(compiler, tmp_path):
    """--precision bf16 compiled: the reference trainer (the whole model resident, the layers
    cast fp32 weights) and the tiered runtime streaming every block from host (the layers read
    the stored bf16 copy, a graph input beside the fp32 gradient stand-in), 4 steps each,
    against eager bf16 within the fp32 bound (measured: losses 8e-8 relative, the compiled chunk
    loss; updates 1.6e-7 of their norm; eager bf16 against fp32 is 4.3e-5 and 2.9e-3). Inductor
    rounds to bf16 where eager's casts do (`emulate_precision_casts`) and the bf16 layer's
    backward keeps its fp32 GEMMs out of the forward's autocast. AdamW's eps far above the
    gradients makes every update proportional to its gradient, so the updates compare
    gradients rather than their signs. The streamed steps after the first compile nothing."""
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, eps=1.0)
    base = tiny_model("llama_tied_gqa", layers=LAYERS)
    start = {k: v.detach().clone() for k, v in base.named_parameters()}
    steps = batches(STEPS, 1, B, T)
    bf16_compiler = SegmentCompile(compiler.cache_dir, precision="bf16")

    def bf16_model(compiled):
        model = copy.deepcopy(base)
        prepare_precision(model, PrecisionConfig(mode="bf16"), "bf16", CPU, log=lambda m: None)
        compiled.apply(model, lambda msg: None)
        return model

    eager = ReferenceStep(bf16_model(NoCompile()), optim, grad_clip=1.0, device=CPU,
                          autocast=_bf16_autocast)
    eager = _run(eager, steps), eager.weights()
    resident = ReferenceStep(bf16_model(bf16_compiler), optim, grad_clip=1.0, device=CPU,
                             autocast=_bf16_autocast)
    resident = _run(resident, steps), resident.weights()

    eng = _engine(bf16_model(bf16_compiler), tmp_path, bf16_compiler, "host", "full", optim,
                  _bf16_autocast)
    assert eng.states[2].compute_format.kinds.count("bf16") == 7  # q k v o gate up down
    graphs, losses = [compiled_graphs()], []
    for step in steps:
        losses.append(eng.step(step, optim.lr)["loss"])
        graphs.append(compiled_graphs())
    host = losses, eng.weights()
    eng.close()
    assert graphs[1] - graphs[0] <= 3  # block no-grad, block with grad, chunk loss
    assert graphs[2:] == graphs[1:2] * (STEPS - 1)  # no recompiles while streaming

    for what, (losses, weights) in (("resident", resident), ("host", host)):
        for a, b in zip(losses, eager[0], strict=True):
            assert abs(a - b) <= REL * abs(b), (what, losses, eager[0])
        diff = sum(((weights[k] - eager[1][k]) ** 2).sum() for k in start)
        norm = sum(((eager[1][k] - w0) ** 2).sum() for k, w0 in start.items())
        assert (diff / norm).sqrt() <= REL, what


@pytest.mark.parametrize("over, precision, flag", [
    ({}, "fp8", "--precision fp8"),
    ({"activations__policy": "selective"}, "fp32", "selective"),
    ({"activations__overrides": "block.0=selective"}, "fp32", "selective"),
    ({"activations__policy": "dynamic"}, "fp32", "dynamic"),
    ({"distributed__nproc": 2, "distributed__backend": "fsdp"}, "fp32", "--backend fsdp"),
    ({"distributed__nproc": 2, "distributed__context_parallel": 2}, "fp32",
     "--context-parallel 2"),
])
def test_unsupported_combinations_are_refused(over, precision, flag):
    with pytest.raises(NotSupportedYet, match="--compile off") as err:
        check_compile(_cfg(**over), precision)
    assert flag in str(err.value)


def test_supported_combinations_pass():
    for over in ({}, {"activations__policy": "full"}, {"activations__policy": "offload"},
                 {"memory__offload_policy": "disk"}, {"train__finetune": "lora"},
                 {"train__finetune": "qlora"}, {"distributed__nproc": 2}):
        check_compile(_cfg(**over), "fp32")
        check_compile(_cfg(**over), "bf16")
    check_compile(from_dict({"activations": {"policy": "selective"}}), "bf16")  # compile off


def test_precision_auto_stops_at_bf16_when_compiled(capsys):
    """On an fp8 GPU, --precision auto with --compile segments runs bf16 (saying why) instead
    of refusing its own default; fp8 asked for (named, or --fp8-emulate) is still refused."""
    from tierlm.cli import main
    from tierlm.memory.hardware import PROFILES
    from tierlm.precision.choice import resolve_precision

    auto = PrecisionConfig(mode="auto")
    got = resolve_precision(auto, None, PROFILES["rtx4090"], compiled=True)
    assert got.describe() == ("precision: auto -> bf16 (rtx4090 has fp8 units; bf16 at most: "
                              "--compile segments has no fp8 yet)")
    assert resolve_precision(auto, None, PROFILES["rtx3090"], compiled=True).mode == "bf16"
    assert resolve_precision(auto, None, PROFILES["rtx4090"]).mode == "fp8"  # compile off
    emulate = resolve_precision(PrecisionConfig(mode="auto", fp8_emulate=True), CPU, None,
                                compiled=True)
    with pytest.raises(NotSupportedYet, match="--precision fp8"):
        check_compile(_cfg(), emulate.mode)
    assert main(["plan", "--model-size", "tiny", "--hardware", "rtx4090", "--compile",
                 "segments", "--no-optimizer-table"]) == 0
    assert "precision: auto -> bf16" in capsys.readouterr().out


def test_compile_with_context_parallel_is_refused_before_launch_and_by_plan(capsys, tmp_path):
    """The refusal comes from the command itself, not from every torchrun rank under a launcher
    traceback; `tierlm plan` refuses it too rather than print train flags that fail."""
    from tierlm.cli import main

    argv = ["--model-size", "tiny", "--compile", "segments", "--nproc", "2",
            "--context-parallel", "2"]
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    assert main(["plan", *argv, "--hardware", "rtx4090", "--no-optimizer-table"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["tierlm: error: not supported yet: --compile segments with "
                   "--context-parallel 2 (the ring attention's collectives inside the block "
                   "are not verified compiled; or --compile off)"] * 2
    assert not (tmp_path / "run").exists()


def test_allocator_settings_are_cuda_only():
    assert configure_cuda_allocator(CPU, lambda msg: None) is False



def test_trainer_builds_the_compiled_run(compiler, tmp_path):
    """--compile segments through the trainer's build: the blocks compile lazily (the log line
    says so), the tiered runtime gets the compiled head loss. (Compiling the preset's shapes
    costs a minute on two cores; the tests above run the compiled step.)"""
    from tierlm.train import Trainer

    cfg = from_dict({
        "model": {"size": "tiny"},
        "data": {"seq_len": T, "vocab_size": 512},
        "train": {"max_steps": 3, "batch_size": B, "eval_every": 0, "eval_batches": 1},
        "memory": {"offload_policy": "host"},
        "run": {"out": str(tmp_path), "device": "cpu", "compile": "segments"},
    })
    logs: list[str] = []
    trainer = Trainer(cfg, log=logs.append)
    assert trainer.stepper.engine.opts.chunk_loss is trainer.compiled.chunk_loss
    assert all(b._compiled_call_impl is not None for b in block_modules(trainer.model))
    assert any(line.startswith("compiling the block: LlamaDecoderLayer x 2") for line in logs)


# -- the planner's compiled-speed factor (tierlm probe --compile segments) ----


def _times_of(compiled: bool, ratio: float | None):
    from dataclasses import replace

    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.memory.tiers import Tier
    from tierlm.models import preset_config
    from tierlm.plan.timing import _times
    from tierlm.runtime.shapes import ModelShape, TrainShape

    shape = ModelShape.from_config(preset_config("tiny"))
    train = TrainShape(batch_size=2, seq_len=64, micro_batches=1, compiled=compiled)
    hw = replace(PROFILES["cpu"], compiled_block_time_ratio=ratio)
    resident = [SegmentPlacement(True, Tier.DEVICE)] * len(shape.names)
    block_s = train.tokens_per_step * 6 * sum(shape.numels[1:-1]) / hw.matmul_flops
    return _times(shape, train, hw, resident, True, {}), block_s


def test_a_probed_factor_scales_the_blocks_compute_only_when_compiled():
    """A probed ratio of 0.5 halves the planned blocks' compute (the head and the attention
    scores stay at the eager rate); eager runs, and compiled runs on a profile without a
    measurement, keep the eager time."""
    eager, block_s = _times_of(False, 0.5)
    compiled, _ = _times_of(True, 0.5)
    assert compiled["compute"] == pytest.approx(eager["compute"] - 0.5 * block_s, rel=1e-12)
    assert compiled["compute"] > 0.5 * eager["compute"]  # the rest is not scaled
    assert _times_of(True, None)[0]["compute"] == eager["compute"]


def test_plan_says_where_the_factor_came_from(tmp_path, monkeypatch, capsys):
    """`tierlm plan --compile segments --hardware auto` reads the factor `tierlm probe
    --compile segments` saved and says so; without one it plans at 1.0 and says how to
    measure it."""
    import json

    from tierlm.cli import main
    from tierlm.memory.hardware import probe_path

    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path))
    argv = ["plan", "--model-size", "tiny", "--hardware", "auto", "--no-optimizer-table",
            "--json"]

    def planned(*extra):
        assert main(argv + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    unprobed = planned("--compile", "segments")
    assert unprobed["compile"]["block_factor"] == 1.0
    assert "not probed: run `tierlm probe --compile segments`" in unprobed["compile"]["source"]
    probe_path().write_text(json.dumps({
        "compiled_block_time_ratio": 0.5, "compiled_block_probe": "one small block, test"}))
    eager, compiled = planned(), planned("--compile", "segments")
    assert eager["compile"] == {"mode": "off", "block_factor": 1.0, "source": None}
    assert compiled["compile"]["block_factor"] == 0.5
    assert "probed: one small block, test" in compiled["compile"]["source"]
    assert compiled["times_s"]["compute"] < eager["times_s"]["compute"]
    assert compiled["tokens_per_s"] > eager["tokens_per_s"]
    argv.remove("--json")
    assert main(argv + ["--compile", "segments"]) == 0
    out = capsys.readouterr().out
    assert "compile: segments; blocks' compute x0.50 of eager (probed: one small block" in out
    assert "tierlm train --model-size tiny" in out and "--compile segments" in out


def test_probe_measures_the_compiled_block_and_keeps_it(compiler, tmp_path, monkeypatch):
    """`tierlm probe --compile segments` times one block eager and compiled (here a tiny one,
    the shapes the tests above compile) and saves the ratio; a later probe without --compile
    keeps it."""
    import json

    from tierlm.models.testing import tiny_hf_configs
    from tierlm.plan import probe

    monkeypatch.setattr(probe, "measure", lambda target, **kw: {"matmul_flops": 1.0})
    # the runs are real (the block compiles), their durations scripted: the compile, then
    # eager and compiled interleaved; a duration measured here would depend on the load
    durations_s = iter([40.0, 2.0, 1.0, 1.5, 0.9, 3.0, 0.6])

    def scripted(fn):
        fn()
        return next(durations_s)

    monkeypatch.setattr(probe, "_seconds", scripted)
    monkeypatch.setattr(probe, "COMPILE_PROBE_DEFAULTS", {"cpu": ("small", T, "fp32")})
    tiny = tiny_hf_configs(vocab_size=256)["llama_tied_gqa"]
    monkeypatch.setattr("tierlm.models.preset_config", lambda size, **kw: tiny)
    out = tmp_path / "probe.json"
    got = probe.run_probe(str(tmp_path), out, compile="segments", cache_dir=compiler.cache_dir,
                          log=lambda m: None)
    # the best of each (noise only adds), the compile apart
    assert got["compiled_block_time_ratio"] == 0.6 / 1.5 and got["compiled_block_compile_s"] == 40
    assert next(durations_s, None) is None  # three runs of each
    assert got["compiled_block_probe"].startswith(f"one small block, 1 x {T} tokens, fp32 on cpu")
    again = probe.run_probe(str(tmp_path), out, log=lambda m: None)
    assert json.loads(out.read_text()) == again
    assert {k: again[k] for k in probe.COMPILED_KEYS} == {k: got[k] for k in probe.COMPILED_KEYS}
