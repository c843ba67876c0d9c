import re
from pathlib import Path

import pytest
import yaml

from tierlm.cli import build_parser, config_from_args, main
from tierlm.config import (
    SEED_FLAGS,
    Config,
    ConfigError,
    NotSupportedYet,
    check_supported,
    field_docs,
    from_dict,
    leaf_fields,
    resolve,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def parse(*argv: str) -> Config:
    return config_from_args(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """Every value the file sets reaches its field (none dropped or defaulted)."""
    cfg = resolve(str(path), {})
    data = yaml.safe_load(path.read_text())
    assert data
    for section, values in data.items():
        for key, value in values.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_configs_dir_not_empty():
    assert len(CONFIGS) >= 3


def test_every_field_has_a_docstring():
    for dotted, _tp, _default, doc in leaf_fields():
        assert doc, f"{dotted} has no docstring"
    assert field_docs(Config)["optim"]


def test_typo_key_names_the_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"optim\.lrr.*did you mean 'lr'"):
        resolve(str(f), {})


def test_typo_section_names_the_section():
    with pytest.raises(ConfigError, match="unknown section 'optimm'"):
        from_dict({"optimm": {"lr": 1.0}})


def test_typo_flag_is_rejected_by_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--optim.lrr", "1"])
    assert "--optim.lrr" in capsys.readouterr().err


@pytest.mark.parametrize(
    "data, match",
    [
        ({"train": {"batch_size": "eight"}}, r"train\.batch_size: got 'eight', expected an int"),
        ({"precision": {"mode": "fp16"}}, r"precision\.mode.*one of 'auto', 'fp32'"),
        ({"train": {"batch_size": 0}}, r"--batch-size: must be > 0"),
        ({"optim": {"lr": -1}}, r"--lr: must be > 0"),
        ({"optim": {"beta2": 1.0}}, r"optim\.beta2"),
        ({"train": {"max_steps": True}}, r"train\.max_steps"),
        ({"data": {"seq_len": 1.5}}, r"data\.seq_len"),
        ({"data": {"format": "csv"}}, r"data\.format.*one of 'auto', 'text', 'chat'"),
        ({"data": {"format": "chat", "train_on": "completion"}},
         r"--data\.train_on completion does not apply to --data\.format chat; use assistant"),
        ({"data": {"format": "text", "train_on": "assistant"}},
         r"--data\.train_on assistant .* --data\.format text; use all"),
    ],
)
def test_bad_values_say_what_is_allowed(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(data)


EXAMPLE_VALUES = {
    "--model-size": "tiny",
    "--model": "/some/model",
    "--precision": "bf16",
    "--grad-checkpointing": "full",
    "--offload-policy": "host",
    "--opt": "Adafactor",
    "--batch-size": "3",
    "--grad-accum-steps": "5",
    "--sparse-grad-ratio": "0.05",
    "--sparse-grad-ratio-overrides": "mlp=0.1",
    "--nproc": "2",
    "--context-parallel": "2",
    "--backend": "fsdp",
    "--grad-sync": "dense",
    "--sync-every": "4",
    "--sync-moments": "average",
    "--lr": "0.0003",
    "--max-steps": "7",
    "--seq-len": "99",
    "--data": "corpus.txt",
    "--eval-data": "held.txt",
    "--out": "runs/x",
    "--seed": "11",
    "--save-every": "4",
    "--eval-every": "6",
    "--device": "cpu",
    "--microbatch-order": "layer-outer",
    "--resident": "embed|head",
    "--device-budget": "8GiB",
    "--host-budget": "1.5GiB",
    "--offload-dir": "/tmp/off",
    "--tensorboard": "True",
    "--overwrite": "True",
    "--keep-checkpoints": "5",
    "--max-skipped-in-a-row": "4",
    "--trust-remote-code": "True",
    "--fp8-scaling": "delayed",
    "--fp8-history": "4",
    "--fp8-layers": "lm_head",
    "--bf16-layers": "down_proj",
    "--fp32-layers": "q_proj",
    "--fp8-emulate": "True",
    "--tf32": "True",
    "--hardware": "rtx4090",
    "--gpu-memory": "24GiB",
    "--host-memory": "64GiB",
    "--disk-budget": "200GiB",
    "--disk-endurance-tbw": "1200",
    "--boundary-activations": "host",
    "--speculative-update": "on",
    "--export-dtype": "bfloat16",
    "--memory-node": "10.0.0.2:29600",
    "--memory-node-token-file": "/etc/tierlm/node.token",
    "--memory-node-transport": "gloo",
    "--memory-node-timeout": "30.0",
    "--remote": "block.[0-9]",
    "--memory-node-memory": "128GiB",
    "--net-bandwidth": "25Gbit",
    "--compile": "segments",
    "--finetune": "lora",
}
# fp8 flags only make sense with --precision fp8 (auto: checked once resolved).
NEEDS_FP8 = {
    "--fp8-scaling", "--fp8-history", "--fp8-layers", "--bf16-layers", "--fp32-layers",
    "--fp8-emulate",
}
# Flags of the tiered runtime only make sense with an offload policy.
NEEDS_OFFLOAD = {
    "--microbatch-order", "--resident", "--device-budget", "--host-budget", "--offload-dir",
    "--boundary-activations", "--speculative-update",
}


@pytest.mark.parametrize("flag", sorted(SEED_FLAGS))
def test_each_seed_flag_maps_to_its_field(flag, tmp_path):
    dotted = SEED_FLAGS[flag]
    if flag == "--resume":
        run = tmp_path / "run"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"train": {"max_steps": 3}}))
        cfg = parse(flag, str(run))
        assert cfg.run.resume == str(run) and cfg.run.out == str(run)
        assert cfg.train.max_steps == 3  # the saved config is the base of a resumed run
        return
    extra = ["--offload-policy", "host"] if flag in NEEDS_OFFLOAD else []
    extra += ["--precision", "fp8"] if flag in NEEDS_FP8 else []
    extra += ["--sync-every", "2"] if flag == "--sync-moments" else []  # delayed sync only
    extra += ["--grad-checkpointing", "full"] if flag == "--boundary-activations" else []
    extra += ["--nproc", "2"] if flag == "--context-parallel" else []  # dp x cp processes
    cfg = parse(flag, EXAMPLE_VALUES[flag], *extra)
    section, key = dotted.split(".")
    value = getattr(getattr(cfg, section), key)
    default = getattr(getattr(Config(), section), key)
    assert value != default
    assert str(value) == EXAMPLE_VALUES[flag] or value == float(EXAMPLE_VALUES[flag])


def test_precision_defaults_to_auto_and_named_modes_refuse_flags_they_ignore():
    assert Config().precision.mode == "auto"
    assert parse("--fp8-history", "4").precision.fp8_history == 4  # auto: checked at resolution
    with pytest.raises(ConfigError, match="--fp8-history has no effect with --precision bf16; "
                       "use --precision fp8"):
        parse("--precision", "bf16", "--fp8-history", "4")
    with pytest.raises(ConfigError, match="--fp32-layers has no effect with --precision fp32; "
                       "use --precision bf16 or fp8"):
        parse("--precision", "fp32", "--fp32-layers", "q_proj")


def test_flags_override_yaml_and_dotted_flags_work(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 0.5\ntrain:\n  max_steps: 9\n")
    cfg = parse("--config", str(f), "--lr", "0.25", "--train.batch_size", "2")
    assert cfg.optim.lr == 0.25 and cfg.train.max_steps == 9 and cfg.train.batch_size == 2


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--backend", "fsdp", "--grad-checkpointing", "full"],
         "--grad-checkpointing full with --backend fsdp"),
    ],
)
def test_unbuilt_features_fail_loudly(argv, flag, capsys):
    with pytest.raises(NotSupportedYet, match=f"not supported yet: {flag}"):
        check_supported(parse(*argv))
    assert main(["train", *argv, "--max-steps", "1"]) == 2
    assert f"not supported yet: {flag}" in capsys.readouterr().err


def test_print_config_shows_resolved_values(capsys):
    assert main(["print-config", "--model-size", "tiny", "--optim.lr", "0.01"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["model"]["size"] == "tiny" and out["optim"]["lr"] == 0.01


def test_help_lists_seed_flags_with_docs(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in SEED_FLAGS:  # the flag itself, not a longer one it starts (--model-size)
        assert re.search(rf"{re.escape(flag)}(?![\w-])", text), flag
    assert "Peak learning rate" in text


@pytest.mark.parametrize("flag", sorted(NEEDS_OFFLOAD))
def test_runtime_flags_without_offload_policy_name_the_flag_to_add(flag):
    with pytest.raises(ConfigError, match=f"{flag}.*--offload-policy"):
        parse(flag, EXAMPLE_VALUES[flag])


@pytest.mark.parametrize(
    "text, nbytes",
    [("8GiB", 8 * 2**30), ("1.5GiB", 3 * 2**29), ("512MiB", 2**29), ("2GB", 2 * 10**9),
     ("4096", 4096)],
)
def test_byte_sizes_parse(text, nbytes):
    from tierlm.config import parse_bytes

    assert parse_bytes(text) == nbytes


def test_bad_byte_size_names_the_flag():
    with pytest.raises(ConfigError, match="--host-budget: '12 potatoes' is not a size"):
        parse("--offload-policy", "host", "--host-budget", "12 potatoes")
