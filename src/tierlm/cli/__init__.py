"""Command line: `tierlm train | plan | print-config | export | report | probe`.

The flags are generated from the config dataclasses (`--optim.lr`, `--data.seq_len`, ...; help text
from the field docstrings); the seed-compatible flags (`--model-size`, `--lr`, ...) are aliases onto
the same fields. Precedence: defaults < `--config FILE` < flags.

This module parses and checks the command line without importing torch or transformers, so
`--help`, print-config and a bad flag answer at once; commands.py runs the command.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from tierlm.config import SEED_FLAGS, Config, ConfigError, leaf_fields, to_dict
from tierlm.logs import quiet_library_noise
from tierlm.plan.checks import check_supported, resolve

_ALIAS_FOR = {dotted: flag for flag, dotted in SEED_FLAGS.items()}


def _field_help(doc: str, default: Any) -> str:
    """A field's help text for argparse, which %-formats help strings (for %(default)s): a
    literal '%' in a docstring ("warn above 1% a day") must be doubled, or argparse prints its
    own internals in its place ('% a' is the ascii() conversion) or fails on a lone '%'."""
    shown = "empty" if default is None else default
    return f"{doc} [default: {shown}]".replace("%", "%%")


_CONFIG_COMMANDS = ("train", "print-config", "plan")


def _error(exc: Exception) -> int:
    print(f"tierlm: error: {exc}", file=sys.stderr)
    return 2


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file with config sections")
    seed = p.add_argument_group("common flags")
    full = p.add_argument_group("all config fields (section.key)")
    for dotted, tp, default, doc in leaf_fields():
        help_text = _field_help(doc, default)
        names = [f"--{dotted}"]
        if "_" in dotted:  # --monitor.trace-step, spelled as the seed flags are (--max-steps)
            names.append(f"--{dotted.replace('_', '-')}")
        # a bare boolean flag (--trust-remote-code) means true
        switch = {"nargs": "?", "const": "true"} if tp is bool else {}
        if dotted in _ALIAS_FOR:
            seed.add_argument(
                _ALIAS_FOR[dotted], dest=dotted, default=argparse.SUPPRESS, metavar="V",
                help=help_text, **switch,
            )
        full.add_argument(*names, dest=dotted, default=argparse.SUPPRESS, metavar="V",
                          help=argparse.SUPPRESS if dotted in _ALIAS_FOR else help_text,
                          **switch)


def _add_field_flag(p: argparse.ArgumentParser, dotted: str) -> None:
    """One config field as a flag of a command that takes no config (`tierlm export`): its
    seed-compatible name, choices and help text from the field."""
    for key, tp, default, doc in leaf_fields():
        if key == dotted:
            choices = typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None
            p.add_argument(_ALIAS_FOR[dotted], dest=dotted, default=default, choices=choices,
                           metavar=None if choices else "V", help=_field_help(doc, default))
            return
    raise KeyError(dotted)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose error for an unknown flag names the command's closest flags."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = {name: sub for a in self._actions
                        if isinstance(a, argparse._SubParsersAction)
                        for name, sub in a.choices.items()}
            parser = commands.get(getattr(ns, "command", None), self)
            flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
            hints = []
            for arg in extras:
                flag = arg.split("=", 1)[0]
                close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
                if flag.startswith("--") and close:
                    hints.append(f"{flag} -> {close[0]}")
            hint = f" (did you mean: {'; '.join(hints)}?)" if hints else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tierlm",
        description="Full-parameter LLM training over GPU memory, host RAM and disk.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser("train", help="train a model", description="Train a model.")
    _add_config_flags(train)
    show = sub.add_parser("print-config", help="print the resolved config as YAML")
    _add_config_flags(show)
    export = sub.add_parser(
        "export", help="export a checkpoint as a Hugging Face model directory"
    )
    export.add_argument("checkpoint", help="a checkpoint directory, or a run directory "
                        "(its newest valid checkpoint is used)")
    export.add_argument("out_dir", help="directory to write the Hugging Face model into")
    _add_field_flag(export, "run.export_dtype")
    report = sub.add_parser(
        "report", help="plot a run's metrics (PNG) and write report.md; two runs are overlaid",
        description="Write loss, step-time, memory and transfer plots and a report.md with a "
        "summary table for RUN_DIR (into RUN_DIR/report), or overlay two runs.",
    )
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one or two run directories")
    report.add_argument("--out", default=None, help="directory for the report (default: "
                        "RUN_DIR/report, or RUN_DIR/report-vs-<RUN_DIR2> for two runs)")
    plan = sub.add_parser(
        "plan", help="print the memory plan and predicted step time, allocating nothing",
        description="Plan placement, activations and micro-batch order for a run, under the "
        "budgets of --hardware / --gpu-memory / --host-memory / --disk-budget.",
    )
    _add_config_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--no-optimizer-table", action="store_true",
                      help="skip the table of what each --opt would change (it plans the run "
                      "once more per optimizer: seconds each for a 7B model)")
    probe = sub.add_parser(
        "probe", help="measure this machine's disk, memory, CPU-update and matmul rates",
    )
    probe.add_argument("--dir", default=None, help="directory to measure the disk at "
                       "(default: the current directory; use your --offload-dir)")
    probe.add_argument("--compile", default="off", choices=["off", "segments"],
                       help="segments: also time one decoder block's forward+backward eager "
                       "against compiled (tens of seconds of compiling on a CPU); `tierlm plan "
                       "--compile segments` multiplies the blocks' compute by the ratio")
    probe.add_argument("--model-size", default=None, help="with --compile segments: the preset "
                       "whose block is timed (default: small on a CPU, 1b on a GPU)")
    probe.add_argument("--seq-len", type=int, default=None, help="with --compile segments: "
                       "tokens per row (default: 256 on a CPU, 2048 on a GPU)")
    probe.add_argument("--memory-node", default=None, metavar="ADDRESS:PORT",
                       help="measure the link to this memory node instead (its `tierlm "
                       "memory-node --listen`): its memory and the rate each way, and the "
                       "--memory-node-memory and --net-bandwidth to plan with")
    probe.add_argument("--memory-node-token-file", default=None,
                       help="with --memory-node: the file holding the node's secret")
    probe.add_argument("--memory-node-transport", default="socket", choices=["socket", "gloo"],
                       help="with --memory-node: how tensors cross (as `tierlm train` would)")
    from tierlm.node.cli import add_memory_node_parser  # its flags and logic live in node/

    add_memory_node_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        k: v for k, v in vars(args).items() if "." in k and not k.startswith("_")
    }
    config_file = args.config
    resume = overrides.get("run.resume")
    if resume == "auto":  # the same command line is rerun after a crash: flags say it all
        return resolve(config_file, overrides)
    if resume and config_file is None:
        # A resumed run continues with the config it was started with; flags given now
        # (for example a larger --max-steps) override it.
        saved = Path(resume) / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume}: no config.yaml there; is it a run directory?")
        config_file = str(saved)
    if resume:
        overrides["run.out"] = resume
    return resolve(config_file, overrides)


def main(argv: list[str] | None = None) -> int:
    # Parsing and the config's resolution and checks import neither torch nor transformers
    # (seconds to import): `--help`, print-config and a bad flag answer at once. The modules
    # that run a command, and the errors they raise, are imported after.
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "memory-node":
        from tierlm.node.cli import memory_node_main  # as its parser above: node/ owns it

        return memory_node_main(args)
    cfg = None
    try:
        if args.command in _CONFIG_COMMANDS:
            cfg = config_from_args(args)
        if args.command == "print-config":
            sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return 0
        if args.command == "train":
            check_supported(cfg)
        if args.command == "probe" and args.memory_node and not args.memory_node_token_file:
            raise ConfigError("tierlm probe --memory-node needs --memory-node-token-file: the "
                              "file holding the secret the node was started with")
        if args.command == "probe" and args.compile == "off" and (args.model_size or args.seq_len):
            raise ConfigError("tierlm probe: --model-size and --seq-len choose the block "
                              "--compile segments times; add --compile segments")
    except ConfigError as exc:
        return _error(exc)

    quiet_library_noise()  # before transformers imports torchao
    # torch and transformers (seconds to import): only once the command line has been checked
    from tierlm.cli import commands

    try:
        return commands.COMMANDS[args.command](args, cfg, sys.argv[1:] if argv is None else argv)
    except commands.USER_ERRORS as exc:
        return _error(exc)
    except KeyboardInterrupt:
        return 130
