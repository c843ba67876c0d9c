"""Glue between the run config and the planner: hardware, step shape, and the plan itself."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from tierlm.config import (
    Config,
    ConfigError,
    NotSupportedYet,
    PrecisionConfig,
    base_format_of,
    check_precision_flags,
    check_supported,
    lora_of,
    mode_only_flags,
    parse_bytes,
)
from tierlm.memory.device import sim_profile
from tierlm.memory.hardware import HardwareProfile, resolve
from tierlm.memory.tiers import Link
from tierlm.memory.wear import DiskWear
from tierlm.plan.result import Plan
from tierlm.plan.search import plan
from tierlm.runtime.shapes import ModelShape, TrainShape


def hardware_for(cfg: Config) -> HardwareProfile:
    mem = cfg.memory

    def size(v: str | None, flag: str) -> int | None:
        return parse_bytes(v, flag) if v else None

    hardware = mem.hardware
    simulated = sim_profile(cfg.run.device)
    if hardware == "auto" and simulated is not None:
        hardware = simulated.name  # plan for the GPU the run simulates
    return resolve(
        hardware,
        gpu_memory_bytes=size(mem.gpu_memory, "--gpu-memory"),
        host_memory_bytes=size(mem.host_memory, "--host-memory"),
        disk_budget_bytes=size(mem.disk_budget, "--disk-budget"),
        offload_dir=mem.offload_dir,
    )


def cap_gpu_memory(cfg: Config, device: torch.device) -> None:
    """`--gpu-memory` on a CUDA run also caps what this process may allocate on the GPU
    (`torch.cuda.set_per_process_memory_fraction`), so a large card stands in for the smaller
    one the plan is made for; an allocation past the cap raises CUDA's out-of-memory error."""
    if device.type != "cuda" or not cfg.memory.gpu_memory:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    cap = parse_bytes(cfg.memory.gpu_memory, "--gpu-memory")
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


@dataclass(frozen=True)
class PrecisionChoice:
    """The run's compute precision (fp32 | bf16 | fp8) and, when --precision auto chose it,
    why."""

    mode: str
    why: str | None = None  # None: the user named the precision

    def describe(self) -> str:
        return f"precision: auto -> {self.mode} ({self.why})" if self.why else (
            f"precision: {self.mode}")


def resolve_precision(
    p: PrecisionConfig, device: torch.device | None, hw: HardwareProfile | None, *,
    backend: str = "engine", compiled: bool = False, context_parallel: int = 1,
) -> PrecisionChoice:
    """`auto`: fp8 where the device has fp8 units (CUDA sm_89+; a profile with
    `fp8_matmul_flops`) or the user asked for emulation (`--fp8-emulate`), else bf16 where the
    device computes it natively, else fp32; at most bf16 under `--backend fsdp` (no fp8 there),
    under `--compile segments` (`compiled`; fp8 is not compiled yet, tierlm.runtime.compile) and
    under `--context-parallel` above 1 (its ring has no fp8 path, tierlm.distributed.context).
    Judged against `device` at train time, against the profile `hw` when planning. A flag the
    resolved precision would ignore (`--fp8-history` under bf16, ...) is an error."""
    if p.mode != "auto":
        return PrecisionChoice(p.mode)
    mode, why = _auto_precision(device, hw)
    if mode != "fp8" and p.fp8_emulate:
        mode, why = "fp8", f"--fp8-emulate on {why}"
    if mode == "fp8" and backend == "fsdp":
        mode, why = "bf16", f"{why}; bf16 at most: --backend fsdp has no fp8"
    if mode == "fp8" and compiled and not p.fp8_emulate:
        mode, why = "bf16", f"{why}; bf16 at most: --compile segments has no fp8 yet"
    if mode == "fp8" and context_parallel > 1 and not p.fp8_emulate:
        mode, why = "bf16", f"{why}; bf16 at most: --context-parallel has no fp8 yet"
    check_precision_flags(p, mode, auto_why=why)
    return PrecisionChoice(mode, why)


def finetune_precision(cfg: Config, choice: PrecisionChoice) -> PrecisionChoice:
    """--finetune lora/qlora computes in fp32 or bf16: the frozen base's copy in the dtype its
    layers compute in (bf16 for the blocks' linear layers: LoRA's base stored and streamed as
    bf16, QLoRA's NF4 decoded to bf16), the adapters' fp32 masters and AdamW state, and every
    matmul under the bf16 policy of full training (tierlm.models.frozen). fp8 is not built for
    a frozen base (it would need an E4M3 copy of it, or NF4 re-quantised to E4M3 per action):
    `auto` choosing fp8 becomes bf16, saying why; a named fp8 is refused, naming the flag."""
    if cfg.train.finetune == "full" or choice.mode != "fp8":
        return choice
    if choice.why is None:
        raise NotSupportedYet(f"--finetune {cfg.train.finetune} with --precision fp8",
                              "use --precision bf16 (or auto)")
    for flag, modes in mode_only_flags(cfg.precision):  # asked for fp8 only: nothing reads it
        if "bf16" not in modes:
            raise ConfigError(f"{flag} has no effect under --finetune {cfg.train.finetune}: it "
                              f"computes in bf16 at most; drop {flag.split()[0]}")
    return PrecisionChoice("bf16", f"{choice.why}; bf16 at most: --finetune "
                                   f"{cfg.train.finetune} has no fp8 (its frozen base and "
                                   "adapters compute in bf16)")


def _auto_precision(device: torch.device | None, hw: HardwareProfile | None) -> tuple[str, str]:
    if device is not None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return "fp8", f"{name} (sm_{major}{minor}) has fp8 units"
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{name} (sm_{major}{minor}) computes bf16, has no fp8 units"
        return "fp32", f"{name} (sm_{major}{minor}) has no bf16 or fp8 units"
    if device is not None:
        return "fp32", f"device {device.type}: no fp8 units, no native bf16"
    if hw is None:
        raise ValueError("resolve_precision: give the device or the hardware profile")
    if hw.fp8_matmul_flops is not None:
        return "fp8", f"{hw.name} has fp8 units"
    if hw.device_is_cpu:
        return "fp32", f"{hw.name}: a CPU profile, no fp8 units, no native bf16"
    return "bf16", f"{hw.name} computes bf16, has no fp8 units"


def train_shape(cfg: Config, precision: str) -> TrainShape:
    """One rank's step: under context parallel its 1/N share of every row; with --nproc
    ranks (dp x cp, at least the CP group) the gradient sync --grad-sync chose."""
    from tierlm.distributed.sync import sync_config

    d = cfg.distributed
    cp = d.context_parallel
    nproc = max(d.nproc, cp)
    return TrainShape(
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len // cp,
        micro_batches=cfg.train.grad_accum_steps,
        precision=precision,
        context_parallel=cp,
        compiled=cfg.run.compile == "segments",
        nproc=nproc,
        grad_sync=sync_config(d, cfg.train.max_steps) if nproc > 1 else None,
        tf32=cfg.precision.tf32,
    )


def make_plan(
    cfg: Config, model_config: Any, hw: HardwareProfile, precision: str,
    shape: ModelShape | None = None, *, advise: bool = True,
) -> tuple[Plan, ModelShape, TrainShape]:
    """`shape`: the model's (default: from `model_config` under the run's optimizer);
    `advise`: a plan that does not fit says what would (the planner searches again for it)."""
    mem = cfg.memory
    shape = shape or ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                            base_format=base_format_of(cfg, precision),
                                            precision=precision)
    train = train_shape(cfg, precision)
    p = plan(
        shape,
        train,
        hw,
        device_budget=parse_bytes(mem.device_budget) if mem.device_budget else None,
        host_budget=parse_bytes(mem.host_budget) if mem.host_budget else None,
        # parked boundaries need every segment to recompute (--boundary-activations), or
        # `dynamic`, which parks the inputs of the segments it recomputes
        park_boundaries=cfg.activations.policy == "dynamic" or (
            cfg.activations.policy in ("none", "full") and not cfg.activations.overrides),
        advise=advise,
    )
    return p, shape, train


def model_config_for(cfg: Config) -> Any:
    """The model's config without weights: the preset's (with its default vocabulary) or the
    checkpoint directory's config.json."""
    if cfg.model.path:
        from pathlib import Path

        from transformers import AutoConfig

        from tierlm.models.hf import _check_checkpoint_dir

        _check_checkpoint_dir(Path(cfg.model.path))
        return AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)
    from tierlm.models import preset_config

    return preset_config(cfg.model.size, max_seq_len=cfg.data.seq_len)


def check_trainable(cfg: Config, precision: str) -> None:
    """Refuse, as `tierlm train` would, a plan whose run is not built: the plan ends with the
    flags to train it (`--nproc` = dp x `--context-parallel`)."""
    from dataclasses import replace

    from tierlm.runtime.compile import check_compile

    dist = cfg.distributed
    run = replace(cfg, distributed=replace(dist, nproc=max(dist.nproc, dist.context_parallel)))
    check_supported(run)
    check_compile(run, precision)


def print_plan(cfg: Config, *, as_json: bool = False, optimizer_table: bool = True) -> int:
    """`tierlm plan`: 0 when a plan fits, 3 when nothing does (the output says what would).
    `optimizer_table`: also what each --opt would change (the run planned once per optimizer)."""
    import json

    from tierlm.plan.describe import describe
    from tierlm.plan.timing import compiled_block_factor, compiled_block_source

    hw = hardware_for(cfg)
    choice = resolve_precision(cfg.precision, None, hw, backend=cfg.distributed.backend,
                               compiled=cfg.run.compile != "off",
                               context_parallel=cfg.distributed.context_parallel)
    full_precision = choice.mode
    choice = finetune_precision(cfg, choice)
    precision = choice.mode
    check_trainable(cfg, precision)
    p, shape, train = make_plan(cfg, model_config_for(cfg), hw, precision)
    wear = DiskWear(write_bytes_per_step=p.moved_bytes.get(Link.DISK_WRITE.value, 0),
                    step_s=p.step_s, endurance_tbw=cfg.memory.disk_endurance_tbw)
    if as_json:
        print(json.dumps({**p.to_json(), "disk_wear": wear.to_json(),
                          "precision": {"requested": cfg.precision.mode, "resolved": precision,
                                        "why": choice.why},
                          "compile": {"mode": cfg.run.compile,
                                      "block_factor": compiled_block_factor(train, hw),
                                      "source": compiled_block_source(train, hw)}}, indent=1))
    else:
        print(choice.describe())
        print(describe(p, shape, train, hw, run_flags=_input_flags(cfg, precision)))
        if wear.write_bytes_per_step:
            print(wear.describe())
            if wear.warning():
                print(wear.warning())
        if cfg.train.finetune != "full":
            print(finetune_table_text(cfg, model_config_for(cfg), hw, full_precision, p))
        if optimizer_table:
            print(optimizer_table_text(cfg, model_config_for(cfg), hw, precision, shape, p))
    return 0 if p.fits else 3


def finetune_table_text(cfg: Config, model_config: Any, hw: HardwareProfile,
                        full_precision: str, chosen: Plan) -> str:
    """`tierlm plan --finetune lora|qlora`: the plan of each --finetune on the same model,
    hardware and step (full fine-tuning in the precision --precision resolves to for it; lora
    and qlora in what `finetune_precision` makes of it): trained parameters, the placement,
    device bytes (the ledger's peak and the total with activation workspace), host and disk
    bytes, tokens/s."""
    from dataclasses import replace

    from tierlm.memory.placement import gib

    rows = ["", "each fine-tuning method (--finetune) on this model and hardware:",
            "  method  precision  trained   state on dev/host/disk  resident  device peak"
            "  device total       host       disk  tokens/s  fits"]
    for method in ("full", "lora", "qlora"):
        c = replace(cfg, train=replace(cfg.train, finetune=method))
        # as auto would resolve it: a named fp8 maps to what lora/qlora compute in, too
        precision = finetune_precision(c, PrecisionChoice(full_precision, "the table")).mode
        if method == cfg.train.finetune:
            p = chosen
        else:
            p = make_plan(c, model_config, hw, precision, advise=False)[0]
        shape_numel = sum(p.numels)
        trained = shape_numel if method == "full" else _trained_numel(cfg, model_config)
        tiers = p.tier_counts()
        fits = "yes" if p.fits else "no: " + "; ".join(p.problems)
        rows.append(
            f"  {method:<8}{precision:<9}"
            f"{trained / 1e6:>8,.1f}M  {tiers['device']:>6}/{tiers['host']}/{tiers['disk']:<13}"
            f"{len(p.resident_names()):>8}  {gib(p.device_peak_bytes):>11}  "
            f"{gib(p.device_total_bytes):>12}  {gib(p.host_peak_bytes):>9}  {gib(p.disk_bytes):>9}"
            f"  {p.tokens_per_s:>8,.0f}  {fits}")
    return "\n".join(rows)


def _trained_numel(cfg: Config, model_config: Any) -> int:
    """Parameters --finetune lora/qlora trains: the adapters --lora.* adds."""
    from tierlm.models import build_model
    from tierlm.runtime.shapes import _lora_layout

    return _lora_layout(build_model(model_config, device="meta"), cfg.lora).numel


def optimizer_table_text(cfg: Config, model_config: Any, hw: HardwareProfile, precision: str,
                    shape: ModelShape, chosen: Plan) -> str:
    """What each --opt would change in this plan: its state bytes, the state left on disk (or
    how far it is from fitting), the disk traffic and the predicted tokens/s."""
    from dataclasses import replace

    from tierlm.memory.placement import gib
    from tierlm.optim import OPTIMIZERS

    # --finetune lora/qlora: the optimizer holds state for the adapters only
    n = shape.trained_numel if shape.frozen else sum(shape.numels)
    rows = ["", "each optimizer (--opt) in this plan:",
            "  optimizer     state     B/param  state on disk   disk r+w/step  tokens/s  "
            "simulated  fits"]
    for name in OPTIMIZERS:
        if name == cfg.optim.name:
            s, p = shape, chosen
        else:
            s = shape.with_optimizer(model_config, replace(cfg.optim, name=name))
            p = make_plan(cfg, model_config, hw, precision, shape=s, advise=False)[0]
        state = s.trained_optim_bytes if s.frozen else sum(s.optim_state_bytes)
        on_disk = p.disk_bytes
        moved = p.moved_bytes.get("disk_read", 0) + p.moved_bytes.get("disk_write", 0)
        fits = "yes" if p.fits else "no: " + "; ".join(p.problems)
        # the formula's tokens/s and the simulated step's (the plan was chosen by the latter)
        sim = p.times_s.get("simulated_step")
        simulated = f"{p.tokens_per_s * p.step_s / sim:>9,.0f}" if sim else f"{'-':>9}"
        rows.append(f"  {name:<12}{gib(state):>10}{state / n:>9.2f}  {gib(on_disk):>13}  "
                    f"{gib(moved):>13}  {p.tokens_per_s:>8,.0f}  {simulated}  {fits}")
    return "\n".join(rows)


def _input_flags(cfg: Config, precision: str) -> list[str]:
    """The flags that reproduce this plan's inputs on `tierlm train`."""
    m = cfg.memory
    out = ["--model", cfg.model.path] if cfg.model.path else ["--model-size", cfg.model.size]
    if cfg.train.finetune != "full":
        out += ["--finetune", cfg.train.finetune]
    out += ["--batch-size", str(cfg.train.batch_size), "--seq-len", str(cfg.data.seq_len),
            "--grad-accum-steps", str(cfg.train.grad_accum_steps), "--precision", precision,
            "--hardware", m.hardware]
    if cfg.run.compile != "off":
        out += ["--compile", cfg.run.compile]
    d = cfg.distributed
    if max(d.nproc, d.context_parallel) > 1:
        out += ["--nproc", str(max(d.nproc, d.context_parallel))]
    if d.context_parallel > 1:
        out += ["--context-parallel", str(d.context_parallel)]
    for flag, value in (("--gpu-memory", m.gpu_memory), ("--host-memory", m.host_memory),
                        ("--disk-budget", m.disk_budget), ("--device-budget", m.device_budget),
                        ("--host-budget", m.host_budget)):
        if value:
            out += [flag, value]
    return out


def plan_auto(cfg: Config, model_config: Any, precision: str) -> Plan:
    """`--offload-policy auto`: the planner's choice, or a PlacementError saying what fits."""
    from tierlm.memory.placement import PlacementError

    hw = hardware_for(cfg)
    p, _, _ = make_plan(cfg, model_config, hw, precision)
    if not p.fits:
        raise PlacementError(
            f"--offload-policy auto: no plan fits on {hw.name}: " + "; ".join(p.problems)
        )
    return p


def predict_for_engine(cfg: Config, model_config: Any, engine: Any, precision: str) -> Plan:
    """The planner's prediction for the placement the engine actually runs."""
    from tierlm.plan.evaluate import evaluate
    from tierlm.plan.result import usable_budgets

    hw = hardware_for(cfg)
    shape = ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                   base_format=base_format_of(cfg, precision),
                                   precision=precision)
    placements = engine.report.placements
    # the engine's own choice per segment (`none` keeps streamed graphs where the budget holds
    # them); the head keeps as the planner's rule says
    keep = (*(not p.recomputes for p in engine.policies),
            placements[-1].resident and engine.opts.keep_resident_activations)
    return evaluate(
        shape, train_shape(cfg, precision), hw, placements,
        engine.opts.microbatch_order, keep,
        usable_budgets(hw), engine.host_boundaries, readahead=engine.opts.readahead,
        writeback=engine.opts.writeback,
    )


def predicted_rates(p: Plan | None, tokens_per_step: int, trained_share: float
                    ) -> dict[str, float | None]:
    """The plan's step time and tokens/s for the whole run (`tokens_per_step`: all ranks),
    both all tokens and trained ones (tokens with a loss: `trained_share` of them, measured on
    the training data; the planner times every token, masked or not). None without a plan (the
    reference trainer)."""
    if p is None:
        return dict.fromkeys(("predicted_step_time_s", "predicted_tokens_per_s",
                              "predicted_trained_tokens_per_s"))
    tokens_per_s = tokens_per_step / p.step_s
    return {"predicted_step_time_s": p.step_s, "predicted_tokens_per_s": tokens_per_s,
            "predicted_trained_tokens_per_s": tokens_per_s * trained_share}


def plan_start_lines(p: Plan, rates: dict[str, float | None], trained_share: float
                     ) -> list[str]:
    """What a run on the tiered runtime says of its plan before the first step: where each
    segment's state lives, which compute weights stay on the device, and the predicted step
    time and tokens/s (all and trained)."""
    from tierlm.plan.describe import _short

    counts = p.tier_counts()
    resident = p.resident_names()
    n = len(p.placements)
    return [
        f"plan: state of {n} segments: {counts['device']} on device, {counts['host']} in host "
        f"RAM, {counts['disk']} on disk; compute weights resident on the device: "
        f"{_short(resident)}; streamed: {n - len(resident)}; micro-batch order {p.order}",
        f"plan: predicted step {p.step_s:.3f} s (bottleneck: {p.bottleneck}), "
        f"{rates['predicted_tokens_per_s']:,.0f} tok/s, trained "
        f"{rates['predicted_trained_tokens_per_s']:,.0f} tok/s ({trained_share:.1%} of the "
        "tokens have a loss)",
    ]


def prediction_record(p: Plan, engine: Any | None, step: int,
                      measured: dict[str, float] | None = None,
                      rates: dict[str, float | None] | None = None) -> dict[str, Any]:
    """Predicted vs measured peak bytes per tier and of pinned host memory (measured: the
    engine's ledger; on CUDA also torch.cuda.max_memory_allocated), and with `rates`
    (`predicted_rates`) and `measured` (the run's median `step_time_s`, `tokens_per_s`,
    `trained_tokens_per_s`) the step time and tokens/s beside them."""
    from tierlm.memory.tiers import Tier

    rec: dict[str, Any] = {"step": step, "predicted_device_total_bytes": p.device_total_bytes,
                           "predicted_device_peak_bytes": p.device_peak_bytes,
                           "predicted_host_peak_bytes": p.host_peak_bytes,
                           "predicted_disk_bytes": p.disk_bytes,
                           "predicted_pinned_peak_bytes": p.pinned_peak_bytes}
    if engine is not None:
        led = engine.ledger
        rec.update(measured_device_peak_bytes=led.peak_tier_bytes[Tier.DEVICE],
                   measured_host_peak_bytes=led.peak_tier_bytes[Tier.HOST],
                   measured_disk_bytes=led.tier_bytes(Tier.DISK),
                   measured_pinned_peak_bytes=led.pinned_peak_bytes)
    if torch.cuda.is_available():
        rec["measured_cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    rec.update(rates or {})
    rec.update({f"measured_{k}": v for k, v in (measured or {}).items()})
    return rec


def prediction_lines(rec: dict[str, Any]) -> list[str]:
    """The run's closing lines of `prediction_record`: predicted vs measured peak per tier,
    step time and tokens/s (all and trained)."""
    lines = []
    for tier, key in (("device", "peak_bytes"), ("host", "peak_bytes"), ("disk", "bytes"),
                      ("pinned", "peak_bytes")):  # pinned: host bytes locked for PCIe copies
        measured = rec.get(f"measured_{tier}_{key}")
        predicted = rec.get(f"predicted_{tier}_{key}")
        if measured is None or predicted is None:
            continue
        # a tier the plan leaves empty: a ratio to nothing would read as a misprediction
        ratio = (f"{measured / predicted:.2f}x" if predicted
                 else "as planned" if not measured else "none planned")
        label = f"peak {tier} bytes" if key == "peak_bytes" else f"{tier} tier bytes"
        lines.append(f"{label}: predicted {predicted / 2**20:.1f} MiB, measured "
                     f"{measured / 2**20:.1f} MiB ({ratio})")
    for key, label, fmt in (("step_time_s", "step time (median)", "{:.3f} s"),
                            ("tokens_per_s", "tokens/s (median)", "{:,.0f}"),
                            ("trained_tokens_per_s", "trained tokens/s (median)", "{:,.0f}")):
        measured, predicted = rec.get(f"measured_{key}"), rec.get(f"predicted_{key}")
        if measured is None:
            continue
        if predicted is None:  # the reference trainer: no plan to compare with
            lines.append(f"{label}: measured {fmt.format(measured)}")
            continue
        ratio = f" ({measured / predicted:.2f}x)" if predicted else ""
        lines.append(f"{label}: predicted {fmt.format(predicted)}, measured "
                     f"{fmt.format(measured)}{ratio}")
    return lines


SIM_KEYS = ("sim_step_s", "sim_compute_s", "sim_h2d_s", "sim_d2h_s", "sim_disk_s",
            "sim_cpu_update_s", "sim_cpu_s", "sim_transfer_wait_s")


def simulated_step_line(device: str, steps: list[dict[str, float]], p: Plan | None) -> str:
    """`--device sim:PROFILE`'s end line: the median simulated step, each lane's busy time in
    it, and the plan's step beside it."""
    med = {k: statistics.median(s[k] for s in steps) for k in SIM_KEYS}
    parts = ", ".join(f"{label} {med[k]:.4g} s" for label, k in (
        ("compute", "sim_compute_s"), ("H2D", "sim_h2d_s"), ("D2H", "sim_d2h_s"),
        ("disk", "sim_disk_s"), ("CPU update", "sim_cpu_update_s"),
        ("CPU adds", "sim_cpu_s"), ("compute waiting for copies", "sim_transfer_wait_s")))
    planned = "" if p is None else f"; the plan predicted {p.step_s:.4g} s"
    if p is not None and "simulated_step" in p.times_s:  # its replay on the same simulator
        planned += f" (its replay simulated {p.times_s['simulated_step']:.4g} s)"
    return (f"simulated step on {device} (median of {len(steps)}): {med['sim_step_s']:.4g} s "
            f"({med['sim_step_s'] / max(med['sim_compute_s'], 1e-30):.2f}x its compute); "
            f"lanes busy: {parts}{planned}")
