"""The command line's own behaviour: help text, how fast it answers, what its errors suggest."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tierlm
from tierlm.cli import build_parser, config_from_args, main
from tierlm.config import leaf_fields

SRC = Path(tierlm.__file__).resolve().parent.parent


@pytest.mark.parametrize("command", ["train", "print-config", "plan", "export"])
def test_help_prints_every_field_doc_verbatim(command, capsys, monkeypatch):
    """argparse %-formats help strings: a '%' in a field's docstring (--disk-endurance-tbw's
    "warn above 1% a day") must reach the help as written, not as argparse's internals."""
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: docs compare unwrapped
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "option_strings" not in text and "%(" not in text
    shown = [(k, doc) for k, _tp, _d, doc in leaf_fields() if command != "export"
             or k == "run.export_dtype"]
    for key, doc in shown:
        assert doc in text, key
    if command != "export":
        assert "and warn above 1% a day (--disk-endurance-tbw). [default: 600.0]" in text


@pytest.mark.parametrize("flag", ["--device-budget", "--host-budget"])
def test_budget_without_offload_policy_suggests_auto(flag, capsys):
    """A budget alone: the error points at the policy that plans within it, and that policy
    takes the budget."""
    assert main(["train", flag, "1GiB", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tierlm: error: {flag} needs the tiered runtime; add "
                          "--offload-policy auto") and "\n" not in err
    args = build_parser().parse_args(["train", flag, "1GiB", "--offload-policy", "auto"])
    assert getattr(config_from_args(args).memory, flag[2:].replace("-", "_")) == "1GiB"


def test_a_field_flag_takes_dashes_as_the_common_flags_do():
    """`--max-steps` is spelled with dashes, so a user writes `--monitor.trace-step` too: both
    spellings set the field."""
    for flag in ("--optim.weight_decay", "--optim.weight-decay"):
        args = build_parser().parse_args(["print-config", flag, "0.25"])
        assert config_from_args(args).optim.weight_decay == 0.25


def test_an_unknown_flag_names_the_command_s_closest(capsys):
    """A misspelt flag: the error names the closest flag of that command (not another
    command's: `tierlm train` has no --json)."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--max-stepz", "3", "--monitor.trace-stepp", "2", "--jsn"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("tierlm train: error: unrecognized arguments: --max-stepz 3 "
                   "--monitor.trace-stepp 2 --jsn (did you mean: --max-stepz -> --max-steps; "
                   "--monitor.trace-stepp -> --monitor.trace-step?)")
    with pytest.raises(SystemExit):
        main(["plan", "--jsn"])
    assert capsys.readouterr().err.strip().endswith("(did you mean: --jsn -> --json?)")


def test_opt_and_lr_help_give_each_optimizers_usual_lr(capsys, monkeypatch):
    """--lr has one default for every --opt: the help says what Lion and Adafactor want."""
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    lines = capsys.readouterr().out.splitlines()
    opt = next(line for line in lines if line.lstrip().startswith("--opt V"))
    lr = next(line for line in lines if line.lstrip().startswith("--lr V"))
    assert "3-10x smaller than AdamW's" in opt  # Lion
    assert re.search(r"Adafactor.*usual lr is 1e-2", opt)
    assert "Adafactor's about 1e-2" in lr and "[default: 0.001]" in lr


# Each command line, run by cli.main in one fresh interpreter: (argv, exit code, a line of its
# output). Help, print-config and every config error are answered before torch is imported.
LIGHT = [
    (["--help"], 0, "COMMAND"),
    (["train", "--help"], 0, "--disk-endurance-tbw"),
    (["plan", "--help"], 0, "--no-optimizer-table"),
    (["export", "--help"], 0, "--export-dtype"),
    (["print-config", "--model-size", "tiny", "--grad-checkpointing", "dynamic",
      "--activations.overrides", "block.0=full"], 0, "block.0=full"),
    (["train", "--max-steps", "x"], 2, "train.max_steps: got 'x'"),
    (["train", "--offload-policy", "bogus"], 2, "memory.offload_policy: got 'bogus'"),
    # a bad value names the flag the user typed, beside the config key
    (["train", "--microbatch-order", "x"], 2, "--microbatch-order / memory.microbatch_order: got"),
    (["train", "--device-budget", "1GiB"], 2, "add --offload-policy auto"),
    (["train", "--nproc", "0"], 2, "--nproc: must be >= 1"),
    (["train", "--sparse-grad-ratio-overrides", "x"], 2, "--sparse-grad-ratio-overrides: 'x'"),
    (["train", "--grad-checkpointing", "dynamic", "--activations.overrides", "block.0=bogus"], 2,
     "unknown policy 'bogus'"),
    (["train", "--backend", "fsdp", "--grad-checkpointing", "full"], 2, "not supported yet"),
    (["plan", "--seq-len", "0"], 2, "--seq-len: must be > 0"),
    (["probe", "--seq-len", "64"], 2, "add --compile segments"),
]

_PROBE = """
import contextlib, io, json, sys
from tierlm.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    out.append({"code": code, "text": text.getvalue(), "heavy": heavy})
print(json.dumps(out))
"""


def test_help_and_config_errors_import_neither_torch_nor_transformers():
    """`tierlm --help` and every config error took 5 s: cli.main imported the trainer's modules
    (torch, transformers) before parsing, and config validation imported torch through the
    distributed and activations packages."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps([a for a, _, _ in LIGHT])],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.splitlines()[-1])
    for (argv, code, line), got in zip(LIGHT, results, strict=True):
        assert got["code"] == code and line in got["text"], (argv, got["text"][-500:])
        assert not got["heavy"], f"tierlm {' '.join(argv)} imported {got['heavy']}"
