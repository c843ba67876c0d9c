"""The precision engine: which layer gets which precision, fp8 matmul error bounds per scaling
mode, delayed and fixed scaling, fallback on persistent overflow, the stop on a non-finite
scale, and fp8 under both runtimes."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.runtime_helpers import OPTIM, VOCAB, batches, tiny_model
from tierlm.config import ConfigError, PrecisionConfig, from_dict
from tierlm.precision import Fp8ScaleError, PrecisionLinear, classify, prepare_precision
from tierlm.precision.formats import E4M3, E5M2, cast_counting, to_fp8_grid
from tierlm.precision.linear import Bf16Linear, Fp8LayerScalers, Fp8Linear
from tierlm.precision.matmul import Emulated, ScaledMM, scaled_mm_works
from tierlm.precision.scaling import DelayedScaling, DynamicScaling, FixedScaling, TensorScaler
from tierlm.runtime.reference import ReferenceStep

CPU = torch.device("cpu")


def quiet(_msg):
    pass


def by_compute(choices) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"fp32": set(), "bf16": set(), "fp8": set()}
    for c in choices:
        out[c.compute].add(c.name)
    return out


def blocks(n: int, *names: str, prefix: str = "model.layers") -> set[str]:
    return {f"{prefix}.{i}.{name}" for i in range(n) for name in names}


LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
GPT2_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


# -- policy ----


def test_policy_tiny_llama_exact_names():
    model = tiny_model("llama_untied")
    got = by_compute(classify(model, PrecisionConfig(mode="fp8"), "fp8"))
    assert got["fp8"] == blocks(2, *LLAMA_LINEARS)
    assert got["fp32"] == {"model.embed_tokens", "model.norm", "lm_head"} | blocks(2, *LLAMA_NORMS)
    assert got["bf16"] == set()
    # bf16 caps the matmuls at bf16; the sensitive layers stay fp32
    got = by_compute(classify(model, PrecisionConfig(mode="bf16"), "bf16"))
    assert got["bf16"] == blocks(2, *LLAMA_LINEARS) and got["fp8"] == set()
    assert "lm_head" in got["fp32"]
    got = by_compute(classify(model, PrecisionConfig(), "fp32"))
    assert got["bf16"] == got["fp8"] == set()


def test_policy_tiny_gpt2_exact_names():
    """GPT-2's Conv1D projections are fp8; its tied head is fp32 and owns no parameter."""
    choices = classify(tiny_model("gpt2"), PrecisionConfig(mode="fp8"), "fp8")
    got = by_compute(choices)
    assert got["fp8"] == blocks(2, *GPT2_LINEARS, prefix="transformer.h")
    assert got["fp32"] == {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"} | (
        blocks(2, "ln_1", "ln_2", prefix="transformer.h")
    )
    head = next(c for c in choices if c.name == "lm_head")
    assert head.params == 0 and "tied" in head.why


def test_name_filters_precedence_and_shape_fallback():
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    pc = PrecisionConfig(mode="fp8", fp32_layers=r"layers\.0\.self_attn\.q_proj",
                         bf16_layers=r"o_proj|q_proj", fp8_layers="lm_head|q_proj")
    choices = {c.name: c for c in classify(model, pc, "fp8")}
    assert choices["model.layers.0.self_attn.q_proj"].compute == "fp32"  # fp32 beats all
    assert choices["model.layers.1.self_attn.q_proj"].compute == "bf16"  # bf16 beats fp8
    assert choices["model.layers.1.self_attn.o_proj"].why == "--bf16-layers"
    assert choices["lm_head"].compute == "fp8" and choices["lm_head"].copy == "e4m3"
    for name in ("gate_proj", "up_proj", "down_proj"):  # 100 is not a multiple of 16
        c = choices[f"model.layers.1.mlp.{name}"]
        assert c.compute == "bf16" and "not divisible by 16" in c.why
    assert choices["model.layers.1.self_attn.k_proj"].compute == "fp8"
    with pytest.raises(ConfigError, match="--fp8-layers 'nothing_here' matches no linear layer"):
        classify(model, PrecisionConfig(mode="fp8", fp8_layers="nothing_here"), "fp8")


@pytest.mark.parametrize(
    "data, match",
    [
        ({"mode": "bf16", "fp8_layers": "mlp"}, "--fp8-layers has no effect with --precision bf16"),
        ({"mode": "fp32", "bf16_layers": "mlp"}, "--bf16-layers has no effect"),
        ({"mode": "bf16", "fp8_scaling": "delayed"}, "--fp8-scaling delayed has no effect"),
        ({"mode": "fp8", "fp8_layers": "("}, "--fp8-layers: '\\(' is not a regex"),
        ({"mode": "fp8", "fp8_history": 0}, "--fp8-history: must be > 0"),
    ],
)
def test_precision_flags_are_validated(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict({"precision": data})


def test_prepare_swaps_modules_keeps_parameters_and_logs_the_table():
    model = tiny_model("llama_untied")
    before = dict(model.named_parameters())
    lines = []
    watch = prepare_precision(model, PrecisionConfig(mode="fp8"), "fp8", CPU, log=lines.append)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert isinstance(model.lm_head, PrecisionLinear) and model.lm_head.compute.name == "fp32"
    assert set(watch.layers) == blocks(2, *LLAMA_LINEARS)
    table = lines[0]
    assert "| model.layers.*.mlp.down_proj (x2) | linear | large matmul |" in table
    assert "| e4m3 | fp8 | dynamic |" in table and "| lm_head | head | sensitive |" in table


# -- fp8 matmul numerics ----

BACKENDS = [Emulated()] + ([ScaledMM()] if scaled_mm_works(CPU) else [])
RULES = {
    "dynamic": (DynamicScaling(), DynamicScaling()),
    "delayed": (DelayedScaling(4), DelayedScaling(4)),
    "fixed": (FixedScaling(8.0), FixedScaling(2.0**16)),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("mode", list(RULES))
def test_fp8_linear_error_against_fp64(mode, backend):
    """Stated bounds (relative Frobenius error against fp64): output <= 5% (two E4M3 operands,
    unit roundoff 2^-4 each), input and weight gradients <= 10% (E5M2 gradient, roundoff 2^-3).
    The lower bound proves the matmul really ran in fp8."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 128, generator=g)  # (B, T, in): 256 tokens
    w = torch.randn(96, 128, generator=g) * 0.05  # (out, in)
    b = torch.randn(96, generator=g) * 0.1
    gout = torch.randn(4, 64, 96, generator=g) * 1e-3
    scalers = Fp8LayerScalers("layer", *RULES[mode])
    layer = Fp8Linear(scalers, backend)
    for _ in range(2):  # the second step has history for delayed scaling
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        out = layer(xs, ws, bs)
        out.backward(gout)
        for s in scalers.all():
            s.end_step()
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    ref = F.linear(x64, w64, b64)
    ref.backward(gout.double())
    assert ws.grad.dtype == torch.float32
    errors = {"out": rel_err(out, ref), "grad_x": rel_err(xs.grad, x64.grad),
              "grad_w": rel_err(ws.grad, w64.grad), "grad_b": rel_err(bs.grad, b64.grad)}
    assert 1e-3 < errors["out"] <= 0.05, errors
    assert 1e-3 < errors["grad_x"] <= 0.10, errors
    assert 1e-3 < errors["grad_w"] <= 0.10, errors
    assert errors["grad_b"] < 1e-5  # the bias gradient is summed in fp32 from the exact gradient


def test_bf16_linear_rounds_operands_like_autocast_and_keeps_fp32_gradients_fp32():
    """The forward is autocast's, bit for bit; the weight gradient and the gradient of an fp32
    input are the fp32 sums of the bf16 products (fp64 agrees to fp32 rounding), where autocast
    rounds them to bf16; a bf16 input's gradient is autocast's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 96, generator=g, requires_grad=True)
    w = (torch.randn(48, 96, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g, requires_grad=True)
    gy = torch.randn(4, 64, 48, generator=g)

    def run(f):
        x.grad = w.grad = b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x, w, b)
        y.backward(gy.to(y.dtype))
        return y.detach(), x.grad.clone(), w.grad.clone(), b.grad.clone()

    y, gx, gw, gb = run(Bf16Linear())
    y_ac, gx_ac, gw_ac, _ = run(F.linear)
    assert y.dtype == torch.bfloat16 and gw.dtype == gx.dtype == torch.float32
    assert torch.equal(y, y_ac)
    bf = torch.bfloat16
    gy_b, x_b, w_b = (t.detach().to(bf).double() for t in (gy, x, w))
    exact = {"w": gy_b.reshape(-1, 48).t() @ x_b.reshape(-1, 96), "x": gy_b @ w_b}
    for name, ours, autocast in (("w", gw, gw_ac), ("x", gx, gx_ac)):
        err = ((ours.double() - exact[name]).abs().max() / exact[name].abs().max()).item()
        err_ac = ((autocast.double() - exact[name]).abs().max() / exact[name].abs().max()).item()
        assert err < 1e-6 < 1e-3 < err_ac, (name, err, err_ac)
    torch.testing.assert_close(gb, gy.to(bf).float().sum((0, 1)), rtol=1e-6, atol=1e-5)
    xb = x.detach().to(bf).requires_grad_()  # a bf16 input: its gradient is bf16, as autocast's
    Bf16Linear()(xb, w, b).backward(gy.to(bf))
    gx_bf16 = xb.grad.clone()
    xb.grad = None
    with torch.autocast("cpu", dtype=bf):
        F.linear(xb, w, b).backward(gy.to(bf))
    assert gx_bf16.dtype == bf and torch.equal(gx_bf16, xb.grad)


def test_scaled_mm_and_emulation_agree():
    if not scaled_mm_works(CPU):
        pytest.skip("torch._scaled_mm does not run here")
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(40, 48, generator=g) * 50).to(E4M3.dtype)  # inner dim 48: padded to 48
    b = (torch.randn(48, 32, generator=g) * 50).to(E5M2.dtype)
    inv_a, inv_b = torch.tensor(0.02), torch.tensor(0.5)
    emu = Emulated()
    exact = ScaledMM()(a, b, inv_a, inv_b, torch.float32)
    emulated = emu(a.float(), b.float(), inv_a, inv_b, torch.float32)
    torch.testing.assert_close(exact, emulated, rtol=1e-5, atol=1e-4)
    odd = ScaledMM()(a[:, :45], b[:45], inv_a, inv_b, torch.float32)  # 45 -> padded to 48
    emulated = emu(a[:, :45].float(), b[:45].float(), inv_a, inv_b, torch.float32)
    torch.testing.assert_close(odd, emulated, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_emulation_grid_equals_the_real_cast(fmt):
    """The emulation's fp32 rounding gives exactly the values of the fp8 cast, over the whole
    range: normals, subnormals, ties, zero and the saturation bound."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(1 << 16, generator=g) * torch.exp(torch.randn(1 << 16, generator=g) * 4)
    every = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).float()
    every = every[torch.isfinite(every)]
    ties = (every[1:] + every[:-1]) / 2  # halfway between neighbours (sorted by bits per sign)
    y = torch.cat([y, every, ties, -ties, torch.tensor([0.0, -0.0, fmt.max])])
    y = y.clamp(-fmt.max, fmt.max)
    assert torch.equal(to_fp8_grid(y, fmt), y.to(fmt.dtype).float())


# -- scaling rules ----


def test_cast_saturates_and_counts_underflow_and_overflow():
    x = torch.tensor([1.0, 300.0, -1000.0, 2.0**-12, 0.0, 2.0**-9])
    x8, under, over = cast_counting(x, torch.tensor(2.0), E4M3)
    assert x8.float().tolist() == [2.0, 448.0, -448.0, 0.0, 0.0, 2.0**-8]
    assert (under.item(), over.item()) == (1, 2)  # 2^-11 flushed; 600 and 2000 saturated
    g8, under, over = cast_counting(torch.tensor([1e5, 2.0**-18, 1.0]), torch.tensor(1.0), E5M2)
    assert g8.float().tolist() == [57344.0, 0.0, 1.0] and (under.item(), over.item()) == (1, 1)


def test_fixed_scaling_uses_the_given_scale():
    s = TensorScaler("t", E4M3, FixedScaling(4.0))
    x8, inv = s.quantize(torch.tensor([1.0, 200.0]))
    assert inv.item() == 0.25 and x8.float().tolist() == [4.0, 448.0]
    stats, count = s.end_step()
    amax, scale, under, over = stats.tolist()
    assert (amax, scale, under, over, count) == (200.0, 4.0, 0.0, 1.0, 2)


def test_delayed_scaling_uses_exactly_the_last_n_steps():
    n = 3
    s = TensorScaler("t", E4M3, DelayedScaling(n))

    def step(amax: float) -> float:
        _, inv = s.quantize(torch.tensor([amax, -amax / 2]))
        s.end_step()
        return 1 / inv.item()

    # scale = 448 / amax rounded down to a power of two
    assert step(1.0) == 256.0  # no history yet: the tensor's own amax
    assert step(7.0) == 256.0  # history [1]: 7 saturates
    assert step(0.5) == 64.0  # history [7, 1]
    assert step(0.5) == 64.0  # history [0.5, 7, 1]
    assert step(0.5) == 64.0  # history [0.5, 0.5, 7]: 7 is still inside
    assert step(0.5) == 512.0  # history [0.5, 0.5, 0.5]: n steps, 7 fell out
    assert s.history.numel() == n


def test_delayed_scale_is_constant_within_a_step_and_saturation_is_counted():
    s = TensorScaler("t", E4M3, DelayedScaling(4))
    s.quantize(torch.tensor([1.0]))
    s.end_step()
    x8, inv = s.quantize(torch.tensor([1.0, 3.0, 0.5]))
    x8b, inv_b = s.quantize(torch.tensor([1.0, 3.0, 0.5]))  # e.g. a recomputed forward
    assert inv.item() == inv_b.item() == 1 / 256  # from the last step's amax, 1.0
    assert torch.equal(x8.view(torch.uint8), x8b.view(torch.uint8))
    stats, count = s.end_step()
    amax, _, _, over = stats.tolist()
    assert (amax, over, count) == (3.0, 2.0, 6)  # 3.0 * 256 saturated in both calls


# -- the watch: fallback, non-finite stop, pause ----


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


class Loop:
    """The reference step plus the watch, as the trainer calls them."""

    def __init__(self, model, watch) -> None:
        self.ref = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU, autocast=bf16_autocast)
        self.watch = watch
        self.step = 0
        self.data = iter(batches(20, 1))

    def run(self, steps: int) -> list[dict]:
        recs = []
        for _ in range(steps):
            out = self.ref.step(next(self.data), 1e-3)
            self.step += 1
            out.update(self.watch.end_step(self.step))
            recs.append(out)
        return recs


def test_persistent_overflow_switches_the_layer_to_bf16():
    """Fixed scaling with an activation scale far too large saturates the inputs of the layers
    fed by the normed residual stream; after K steps in a row exactly those are switched to bf16
    (logged and recorded), while the layers whose inputs stay in range keep fp8."""
    model = tiny_model("llama_untied")
    logged = []
    cfg = PrecisionConfig(mode="fp8", fp8_scaling="fixed", fp8_input_scale=1e6,
                          fp8_overflow_steps=3, fp8_overflow_fraction=0.01)
    watch = prepare_precision(model, cfg, "fp8", CPU, log=logged.append)
    fp8 = set(watch.layers)
    saturating = blocks(2, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "mlp.gate_proj", "mlp.up_proj")
    loop = Loop(model, watch)
    recs = loop.run(2)
    assert all(not r["fp8_switched"] for r in recs) and set(watch.layers) == fp8
    over = {k.rsplit(".", 1)[0] for k, v in recs[-1]["fp8_tensors"].items() if v["overflow"] > 0.01}
    assert over == saturating
    recs = loop.run(1)
    assert set(recs[-1]["fp8_switched"]) == saturating
    assert set(watch.layers) == fp8 - saturating
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n].compute, Bf16Linear) for n in saturating)
    assert all(isinstance(modules[n].compute, Fp8Linear) for n in fp8 - saturating)
    assert any(m.startswith("fp8: model.layers.0.mlp.up_proj switched to bf16 at step 3")
               for m in logged)
    assert all(math.isfinite(r["loss"]) and not r["fp8_switched"] for r in loop.run(2))


def test_overflow_that_stops_resets_the_count():
    """Two saturating steps (fixed scale far too large) build a streak; one step in range
    (the scalers turned dynamic) resets it before it reaches K = 3, and nothing is switched."""
    model = tiny_model("llama_untied")
    cfg = PrecisionConfig(mode="fp8", fp8_scaling="fixed", fp8_input_scale=1e6,
                          fp8_overflow_steps=3, fp8_overflow_fraction=0.01)
    watch = prepare_precision(model, cfg, "fp8", CPU, log=quiet)
    saturating = blocks(2, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                        "mlp.gate_proj", "mlp.up_proj")
    loop = Loop(model, watch)
    loop.run(2)
    assert {k: v for k, v in watch.streak.items() if v} == dict.fromkeys(saturating, 2)
    for layer in watch.layers.values():  # the inputs come back into range
        for s in layer.compute.scalers.all():
            s.rule = DynamicScaling()
    assert loop.run(1)[-1]["fp8_switched"] == []
    assert all(v == 0 for v in watch.streak.values()) and len(watch.layers) == 14


def test_non_finite_scale_stops_naming_the_layer():
    model = tiny_model("llama_untied")
    watch = prepare_precision(model, PrecisionConfig(mode="fp8"), "fp8", CPU, log=quiet)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    x = torch.randint(0, VOCAB, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=x)
    with pytest.raises(Fp8ScaleError) as err:
        watch.end_step(7)
    msg = str(err.value)
    assert "model.layers.1.mlp.down_proj.weight" in msg and "step 7" in msg
    assert "--fp8-scaling fixed" in msg and "check the data" in msg


def test_paused_watch_records_nothing():
    model = tiny_model("llama_untied")
    watch = prepare_precision(model, PrecisionConfig(mode="fp8"), "fp8", CPU, log=quiet)
    with watch.paused(), torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))
    assert watch.end_step(1) == {"fp8_tensors": {}, "fp8_switched": []}


# -- both runtimes ----


def test_reference_and_tiered_runtime_agree_in_fp8(tmp_path):
    """The tiered runtime calls the same swapped modules through functional_call, recomputing
    streamed blocks; with dynamic scaling the recompute quantises exactly as the forward did."""
    from tierlm.runtime import EngineOptions, build_engine

    base = tiny_model("llama_untied", layers=2)
    steps = batches(3, 2)
    autocast = bf16_autocast
    runs = []
    for tiered in (False, True):
        model = copy.deepcopy(base)
        watch = prepare_precision(model, PrecisionConfig(mode="fp8"), "fp8", CPU, log=quiet)
        if tiered:
            opts = EngineOptions(policy="host", offload_dir=str(tmp_path), batch_size=2,
                                 seq_len=16, micro_batches=2, autocast=autocast)
            stepper = build_engine(model, OPTIM, opts, device=CPU)
        else:
            stepper = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU, autocast=autocast)
        losses, stats = [], []
        for i, b in enumerate(steps):
            losses.append(stepper.step(b, 1e-2)["loss"])
            stats.append(watch.end_step(i + 1)["fp8_tensors"])
        runs.append((losses, stats, stepper.weights()))
    (ref_l, ref_s, ref_w), (eng_l, eng_s, eng_w) = runs
    for a, b in zip(ref_l, eng_l, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (ref_l, eng_l)
    assert ref_s[-1].keys() == eng_s[-1].keys()
    name = "model.layers.1.mlp.up_proj.input"
    assert ref_s[-1][name]["amax"] == pytest.approx(eng_s[-1][name]["amax"], rel=1e-3)
    for k, v in ref_w.items():
        assert (eng_w[k] - v).abs().max().item() < 1e-4, k


# -- fp8 streaming ----


def streamed(mode: str, tmp_path, steps: int = 2):
    """A 2-block model on the tiered runtime as `--offload-policy tiered` places a model whose
    blocks do not fit the device: embed and head (state and all) on the device, the blocks'
    state in host RAM and their weights streamed. What crosses is the blocks' weights."""
    from tierlm.memory.placement import SegmentPlacement
    from tierlm.memory.tiers import Tier
    from tierlm.runtime import EngineOptions, build_engine

    model = tiny_model("llama_untied", layers=2)
    prepare_precision(model, PrecisionConfig(mode=mode), mode, CPU, log=quiet)
    on_device = SegmentPlacement(resident=True, state_tier=Tier.DEVICE)
    from_host = SegmentPlacement(resident=False, state_tier=Tier.HOST)
    opts = EngineOptions(policy="tiered", offload_dir=str(tmp_path / mode), batch_size=2,
                         seq_len=16, placements=[on_device, from_host, from_host, on_device],
                         autocast=bf16_autocast if mode != "fp32" else contextlib.nullcontext)
    engine = build_engine(model, OPTIM, opts, device=CPU)
    losses = [engine.step(b, 1e-2)["loss"] for b in batches(steps, 1)]
    return engine, model, losses


def expected_copy_bytes(mode: str) -> int:
    """Bytes of the blocks' compute copies: linear weights at 1 (fp8, plus a 4-byte scale) or
    2 (bf16) bytes per parameter, norms at 4."""
    total = 0
    for name, p in tiny_model("llama_untied", layers=2).named_parameters():
        if ".layers." not in name:
            continue
        if p.ndim == 2:
            total += p.numel() + 4 if mode == "fp8" else 2 * p.numel()
        else:
            total += 4 * p.numel()
    return total


def test_fp8_compute_copies_are_half_of_bf16_and_h2d_at_most_055x(tmp_path):
    from tierlm.memory.tiers import TensorClass, Tier

    runs = {mode: streamed(mode, tmp_path) for mode in ("fp32", "bf16", "fp8")}
    copy_bytes = {m: e.ledger.current_bytes[(Tier.HOST, TensorClass.COMPUTE)]
                  for m, (e, _, _) in runs.items()}
    h2d = {m: e.ledger.snapshot()["h2d_bytes"] for m, (e, _, _) in runs.items()}
    assert copy_bytes["fp32"] == 0  # fp32 streams the masters themselves
    assert copy_bytes["bf16"] == expected_copy_bytes("bf16")
    assert copy_bytes["fp8"] == expected_copy_bytes("fp8")
    assert copy_bytes["fp8"] / copy_bytes["bf16"] < 0.51  # half, plus scales and fp32 norms
    assert h2d["fp8"] <= 0.55 * h2d["bf16"] and h2d["bf16"] <= 0.55 * h2d["fp32"], h2d
    for mode, (engine, _, losses) in runs.items():
        assert all(math.isfinite(x) for x in losses), mode
        engine.close()


def test_bf16_streaming_matches_the_reference_bit_for_bit(tmp_path):
    """bf16 compute copies round the weights as autocast does: no numerical change."""
    engine, _, losses = streamed("bf16", tmp_path, steps=3)
    model = tiny_model("llama_untied", layers=2)
    prepare_precision(model, PrecisionConfig(mode="bf16"), "bf16", CPU, log=quiet)
    ref = ReferenceStep(model, OPTIM, grad_clip=1.0, device=CPU, autocast=bf16_autocast)
    ref_losses = [ref.step(b, 1e-2)["loss"] for b in batches(3, 1)]
    assert losses == ref_losses
    weights = engine.weights()
    for k, v in ref.weights().items():
        assert torch.equal(weights[k], v), k
    engine.close()


# -- the trainer ----


def test_trainer_logs_the_table_and_records_fp8_statistics(tmp_path):
    """`--precision fp8 --fp8-scaling delayed` through the trainer: the layer table is logged,
    every step record carries per-tensor statistics and the probe's rates, and evaluation
    (at step 0, 2 and the end) does not enter the delayed-scaling history."""
    from tierlm.monitor.metrics import read_metrics
    from tierlm.train import Trainer

    cfg = from_dict({
        "model": {"size": "tiny"},
        "data": {"seq_len": 32, "vocab_size": 512},
        "train": {"max_steps": 3, "batch_size": 2, "eval_every": 2, "eval_batches": 1},
        "precision": {"mode": "fp8", "fp8_scaling": "delayed", "fp8_history": 8},
        "run": {"out": str(tmp_path), "device": "cpu"},
    })
    logged = []
    trainer = Trainer(cfg, log=logged.append)
    trainer.train()
    assert any("| model.layers.*.mlp.down_proj (x2) | linear | large matmul |" in m
               for m in logged)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 3
    for rec in steps:
        stats = rec["fp8_tensors"]["model.layers.1.self_attn.o_proj.grad"]
        assert set(stats) == {"amax", "scale", "underflow", "overflow"}
        assert stats["amax"] > 0 and math.log2(stats["scale"]).is_integer()
        by_layer = rec["fp8_underflow_by_layer"]
        assert len(by_layer) == 14 and rec["fp8_switched"] == []
        # run-wide: the mean over layers; a layer's: over the values of its three tensors
        assert rec["fp8_underflow_rate"] == pytest.approx(sum(by_layer.values()) / 14)
        assert 0 <= rec["fp8_underflow_rate"] < 0.5 and 0 <= rec["fp8_overflow_rate"] <= 1
        for layer, rate in by_layer.items():
            parts = [v["underflow"] for k, v in rec["fp8_tensors"].items()
                     if k.rsplit(".", 1)[0] == layer]
            assert len(parts) == 3 and min(parts) - 1e-6 <= rate <= max(parts) + 1e-6, layer
    scaler = trainer.fp8.layers["model.layers.0.mlp.up_proj"].compute.scalers.input
    assert scaler.history.numel() == 3  # one amax per training step, none from evaluation


def test_planner_predicts_the_compute_copies_and_their_h2d_bytes(tmp_path):
    """The planner's replay counts what `streamed` measures, byte for byte: the blocks' host
    compute copies and the bytes that cross per step, per precision (fp8: with the scales)."""
    from tierlm.memory.hardware import PROFILES
    from tierlm.memory.tiers import Link, TensorClass, Tier
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets
    from tierlm.runtime.shapes import ModelShape, TrainShape

    hw = PROFILES["cpu"]
    shape = ModelShape.from_config(copy.deepcopy(tiny_model("llama_untied", layers=2).config))
    for mode in ("fp32", "bf16", "fp8"):
        engine, _, _ = streamed(mode, tmp_path, steps=2)
        before = engine.ledger.total_moved_bytes[Link.H2D]
        engine.step(batches(1, 1)[0], 1e-2)
        engine.synchronize()
        per_step = engine.ledger.total_moved_bytes[Link.H2D] - before
        copies = engine.ledger.current_bytes[(Tier.HOST, TensorClass.COMPUTE)]
        placements = engine.report.placements
        engine.close()
        plan = evaluate(shape, TrainShape(2, 16, 1, mode), hw, placements, "layer-outer",
                        True, usable_budgets(hw))
        assert plan.moved_bytes[Link.H2D.value] == per_step, mode
        assert plan.host_by_class.get("compute", 0) == copies, mode


@pytest.mark.parametrize("precision", [
    {"fp8_scaling": "delayed", "fp8_history": 4},
    {"fp8_scaling": "fixed", "fp8_input_scale": 1e6, "fp8_overflow_steps": 2,
     "fp8_overflow_fraction": 0.01},
], ids=["delayed-history", "switched-layers"])
def test_fp8_scaling_state_survives_a_resume(tmp_path, precision):
    """A run interrupted at step 3 and resumed repeats the uninterrupted run bit for bit: the
    delayed-scaling amax histories, the overflow streaks and the layers switched to bf16 (here
    at step 2, by an activation scale far too large) come back from the checkpoint."""
    from tierlm.train import Trainer

    def cfg(out):
        return from_dict({
            "model": {"size": "tiny"},
            "data": {"seq_len": 32, "vocab_size": 512},
            "train": {"max_steps": 6, "batch_size": 2, "eval_every": 0, "eval_batches": 1},
            "precision": {"mode": "fp8", **precision},
            "run": {"out": str(out), "device": "cpu", "seed": 1},
        })

    straight = Trainer(cfg(tmp_path / "a"), log=quiet)
    full = straight.train()
    first = Trainer(cfg(tmp_path / "b"), log=quiet)
    part1 = first.train(until_step=3)
    resumed_cfg = cfg(tmp_path / "b")
    resumed_cfg.run.resume = str(tmp_path / "b")
    logged = []
    second = Trainer(resumed_cfg, log=logged.append)
    assert second.step == 3
    assert set(second.fp8.layers) == set(first.fp8.layers)
    assert second.fp8.switched == first.fp8.switched
    if precision["fp8_scaling"] == "delayed":
        s1 = first.fp8.layers["model.layers.0.mlp.up_proj"].compute.scalers.grad
        s2 = second.fp8.layers["model.layers.0.mlp.up_proj"].compute.scalers.grad
        assert torch.equal(s1.history, s2.history) and s2.history.numel() == 3
    else:
        assert len(first.fp8.switched) == 10  # q, k, v, gate, up of both blocks
        assert any("stays in bf16" in m for m in logged)
    part2 = second.train()
    assert part1.losses + part2.losses == full.losses
