"""The config's checks run from one place (`tierlm.plan.checks`): the config package checks its own
values and imports nothing above it; each feature's checks (distributed, activation overrides,
simulated devices) run on every way into a run: the CLI's commands and the Python API."""

import ast
import re
from pathlib import Path

import pytest

import tierlm.config
from tierlm.cli import main
from tierlm.config import ConfigError, from_dict

CONFIG_DIR = Path(tierlm.config.__file__).parent

# one bad flag per feature whose check lives in that feature's package
FEATURE_ERRORS = [
    ({"distributed": {"sync_every": 2, "grad_sync": "dense"}}, "--sync-every is for --grad-sync"),
    ({"activations": {"overrides": "block.0=fast"}}, "--activations.overrides: .*unknown policy"),
    ({"run": {"device": "sim:nope"}, "memory": {"offload_policy": "host"}},
     "--device sim:nope: no hardware profile"),
]


def test_the_config_package_imports_nothing_of_tierlm_above_it():
    """Module- and function-level imports alike: the config is the bottom layer."""
    for path in sorted(CONFIG_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("tierlm") or name.startswith("tierlm.config"), (
                    f"{path.name} imports {name}")


@pytest.mark.parametrize(("data", "message"), FEATURE_ERRORS)
def test_the_trainer_runs_every_features_check(data, message, tmp_path):
    """A config built with the config package alone (its own checks) is checked again, features
    included, before the trainer builds anything."""
    from tierlm.train import Trainer

    cfg = from_dict({**data, "model": {"size": "tiny"}, "run": {
        **data.get("run", {}), "out": str(tmp_path / "run")}})
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg, log=lambda msg: None)
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.parametrize("command", ["train", "plan", "print-config"])
@pytest.mark.parametrize(
    "argv, message",
    [(["--sync-every", "2", "--grad-sync", "dense"], "--sync-every is for --grad-sync delayed"),
     (["--activations.overrides", "head=full"], "--activations.overrides: .*always keeps")],
)
def test_every_config_command_runs_the_features_checks(command, argv, message, capsys):
    assert main([command, "--model-size", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierlm: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
