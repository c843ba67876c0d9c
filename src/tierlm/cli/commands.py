"""What each command runs once the CLI (tierlm.cli) has parsed and checked its command line.
This module imports torch and transformers (seconds): tierlm.cli imports it only after `--help`,
print-config and the config's own errors have answered."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from tierlm.checkpoint import (
    CheckpointError,
    checkpoint_export_dtype,
    export_hf_from_checkpoint,
    latest_valid_checkpoint,
)
from tierlm.config import Config, ConfigError
from tierlm.data import DataError
from tierlm.distributed.world import launch_if_asked
from tierlm.memory import PlacementError
from tierlm.memory.hardware import probe_path
from tierlm.models import ModelLoadError
from tierlm.paths import cache_dir
from tierlm.plan.probe import run_probe
from tierlm.plan.tables import print_plan
from tierlm.precision import Fp8ScaleError
from tierlm.progress import open_progress
from tierlm.runtime.compile import check_compile
from tierlm.train import run_training
from tierlm.train.node import connect_node, probe_node
from tierlm.train.rundir import precheck_run_dir
from tierlm.train.safety import ReliabilityError

# What a user can cause (a flag, a file, the machine): tierlm.cli prints each as one line
# `tierlm: error: ...`, never a traceback.
USER_ERRORS = (
    ConfigError, DataError, ModelLoadError, CheckpointError, PlacementError, ReliabilityError,
    Fp8ScaleError,
)


def export_checkpoint(checkpoint: str, out_dir: str, dtype: str) -> Path:
    path = Path(checkpoint)
    if (path / "checkpoints").is_dir():
        path = latest_valid_checkpoint(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"export: {path} is not a tierlm checkpoint (no config.json)")
    # what was read, in which dtype, to where: a run directory names no single checkpoint
    dtype_name = str(checkpoint_export_dtype(path, dtype)).removeprefix("torch.")
    print(f"export: checkpoint {path} as {dtype_name} (--export-dtype {dtype}) to {out_dir}")
    # streamed from the checkpoint's files: the model is never built in RAM
    out = export_hf_from_checkpoint(path, Path(out_dir), dtype=dtype,
                                    progress=open_progress(print))
    print(f"exported checkpoint {path} as {dtype_name} to {out}")
    return out


# Each command: (its parsed arguments, the resolved config (train and plan; else None), the
# command line as given, for torchrun) -> exit code.


def _report(args: argparse.Namespace, cfg: Config | None, argv: list[str]) -> int:
    # matplotlib (tens of MiB of RSS): only `tierlm report` draws; a training run never loads it
    from tierlm.monitor.report import report_main

    return report_main(args.runs, args.out)


def _export(args: argparse.Namespace, cfg: Config | None, argv: list[str]) -> int:
    export_checkpoint(args.checkpoint, args.out_dir, getattr(args, "run.export_dtype"))
    return 0


def _probe(args: argparse.Namespace, cfg: Config | None, argv: list[str]) -> int:
    if args.memory_node:  # the link to a memory node, not this machine
        return probe_node(args.memory_node, args.memory_node_token_file,
                          transport=args.memory_node_transport)
    run_probe(args.dir, probe_path(), compile=args.compile, compile_size=args.model_size,
              compile_seq_len=args.seq_len, cache_dir=cache_dir() / "inductor")
    return 0


def _plan(args: argparse.Namespace, cfg: Config | None, argv: list[str]) -> int:
    assert cfg is not None  # resolved by tierlm.cli
    hello = None
    if cfg.memory.memory_node is not None:  # its memory and link, measured at the handshake
        client = connect_node(cfg, lambda line: print(line, file=sys.stderr))
        hello = client.hello
        client.close()  # the node frees the session: the plan holds nothing there
    return print_plan(cfg, as_json=args.json, optimizer_table=not args.no_optimizer_table,
                      node=hello)


def _train(args: argparse.Namespace, cfg: Config | None, argv: list[str]) -> int:
    assert cfg is not None  # resolved by tierlm.cli
    # before torchrun: refused here, not by every rank with a launcher traceback
    check_compile(cfg, cfg.precision.mode)
    precheck_run_dir(cfg)  # before torchrun, and before any model is built
    launch_if_asked(cfg.distributed.nproc, argv)
    run_training(cfg)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace, Config | None, list[str]], int]] = {
    "report": _report, "export": _export, "probe": _probe, "plan": _plan, "train": _train,
}
