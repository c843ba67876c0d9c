"""`tierlm plan`'s output: the plan described, the flags that reproduce it, and the tables of
fine-tuning methods and optimizers that would fit beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierlm.config import Config
from tierlm.memory.hardware import HardwareProfile
from tierlm.memory.placement import gib
from tierlm.memory.tiers import Link
from tierlm.memory.wear import DiskWear
from tierlm.models import build_model
from tierlm.optim import OPTIMIZERS
from tierlm.plan.describe import describe
from tierlm.plan.inputs import (
    check_trainable,
    hardware_for,
    make_plan,
    model_config_for,
)
from tierlm.plan.result import Plan
from tierlm.plan.timing import compiled_block_factor, compiled_block_source
from tierlm.precision.choice import PrecisionChoice, finetune_precision, resolve_precision
from tierlm.runtime.shapes import ModelShape, _lora_layout

if TYPE_CHECKING:
    from tierlm.node.client import NodeHello

def print_plan(cfg: Config, *, as_json: bool = False, optimizer_table: bool = True,
               node: NodeHello | None = None) -> int:
    """`tierlm plan`: 0 when a plan fits, 3 when nothing does (the output says what would).
    `optimizer_table`: also what each --opt would change (the run planned once per optimizer);
    `node`: what --memory-node said at its handshake (its memory, the link measured)."""
    import json

    hw = hardware_for(cfg, node=node)
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
    return _lora_layout(build_model(model_config, device="meta"), cfg.lora).numel


def optimizer_table_text(cfg: Config, model_config: Any, hw: HardwareProfile, precision: str,
                    shape: ModelShape, chosen: Plan) -> str:
    """What each --opt would change in this plan: its state bytes, the state left on disk (or
    how far it is from fitting), the disk traffic and the predicted tokens/s."""
    from dataclasses import replace

    # --finetune lora/qlora: the optimizer holds state for the adapters only
    n = shape.trained_numel if shape.frozen else sum(shape.numels)
    rows = ["", "each optimizer (--opt) in this plan:",
            "  optimizer     state     B/param  state on disk   disk r+w/step  tokens/s  fits"]
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
        rows.append(f"  {name:<12}{gib(state):>10}{state / n:>9.2f}  {gib(on_disk):>13}  "
                    f"{gib(moved):>13}  {p.tokens_per_s:>8,.0f}  {fits}")
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
