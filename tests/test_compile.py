"""--compile segments: the compiled block and chunk loss reproduce eager PyTorch (fp32, and bf16
against eager bf16, within 1e-5), in the reference trainer and the tiered runtime with streamed
segments, resume like an eager run, and compile once per distinct graph whatever the number of
blocks.

Compilation dominates the time here: every test uses the same tiny shapes (B=2, T=16, 3 blocks),
so in one session a model class compiles once and later tests reuse the in-memory code, and
the inductor cache is one directory for the session."""

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
from runtime_helpers import batches, tiny_model

from tierlm.config import ActivationConfig, NotSupportedYet, OptimConfig, PrecisionConfig, from_dict
from tierlm.memory.cuda_allocator import configure_cuda_allocator
from tierlm.precision import prepare_precision
from tierlm.runtime import Engine, EngineOptions
from tierlm.runtime.compile import (
    NoCompile,
    SegmentCompile,
    block_modules,
    check_compile,
    compiled_graphs,
)
from tierlm.train.reference import ReferenceStep

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


def _engine(model, tmp_path, compiled, policy, acts="none", optim=OPTIM, autocast=None):
    opts = EngineOptions(policy=policy, offload_dir=str(tmp_path / f"off-{policy}"),
                         batch_size=B, seq_len=T, grad_clip=1.0, chunk_loss=compiled.chunk_loss,
                         activations=ActivationConfig(policy=acts),
                         **({"autocast": autocast} if autocast else {}))
    return Engine(model, optim, opts, device=CPU)


def _run(stepper, steps, lr=OPTIM.lr):
    return [stepper.step(b, lr)["loss"] for b in steps]


def _assert_close(losses, ref_losses, weights, ref_weights, what):
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= REL * abs(b), (what, losses, ref_losses)
    for k, ref in ref_weights.items():
        rel = ((weights[k] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert rel <= REL, (what, k, rel)


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
    ({"train__finetune": "lora"}, "fp32", "--finetune lora"),
    ({"distributed__nproc": 2}, "fp32", "--nproc"),
])
def test_unsupported_combinations_are_refused(over, precision, flag):
    with pytest.raises(NotSupportedYet, match="--compile off") as err:
        check_compile(_cfg(**over), precision)
    assert flag in str(err.value)


def test_torchrun_is_refused():
    with pytest.raises(NotSupportedYet, match="torchrun"):
        check_compile(_cfg(), "fp32", distributed=True)


def test_supported_combinations_pass():
    for over in ({}, {"activations__policy": "full"}, {"activations__policy": "offload"},
                 {"memory__offload_policy": "disk"}):
        check_compile(_cfg(**over), "fp32")
        check_compile(_cfg(**over), "bf16")
    check_compile(from_dict({"activations": {"policy": "selective"}}), "bf16")  # compile off


def test_precision_auto_stops_at_bf16_when_compiled(capsys):
    """On an fp8 GPU, --precision auto with --compile segments runs bf16 (saying why) instead
    of refusing its own default; fp8 asked for (named, or --fp8-emulate) is still refused."""
    from tierlm.cli import main
    from tierlm.memory.hardware import PROFILES
    from tierlm.train.planning import resolve_precision

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
