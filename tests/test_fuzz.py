"""Fuzzing (hypothesis): bad input never crashes with a traceback, only with a clear error.

- config files (structured: real and made-up sections, keys and values of every YAML type) and
  raw YAML text, through the CLI;
- command-line flags and values, through the CLI;
- data files (random bytes, random JSON lines, corrupted valid files, directories of them),
  through the data path a run takes: corpus, tokenizer, token check, packing, batches;
- checkpoints with corrupted files (with and without a matching manifest), through
  verification and the tensor reader.

Each runs up to 200 examples (hypothesis's `max_examples`, a ceiling: a strategy with fewer
distinct inputs runs fewer); they exercise the parsing and loading paths
directly, not whole training runs, so the module takes seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tierlm.checkpoint import (
    MANIFEST,
    CheckpointError,
    TrainState,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tierlm.cli import build_parser, main
from tierlm.config import leaf_fields
from tierlm.data import (
    BatchSampler,
    DataError,
    PackedSequences,
    encode_documents,
    load_corpus,
    train_bpe_tokenizer,
)
from tierlm.train.safety import check_token_stream

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

LEAVES = [dotted for dotted, *_ in leaf_fields()]
SECTIONS = sorted({d.split(".")[0] for d in LEAVES})
KEYS = sorted({d.split(".")[1] for d in LEAVES})


def run_cli(argv: list[str]) -> tuple[int, str]:
    """Exit code and stderr of `tierlm <argv>`; an exception escaping main fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own usage errors
            rc = exc.code
    return rc, err.getvalue()


def assert_clean(rc: int, err: str) -> None:
    event("accepted" if rc == 0 else "usage error" if "usage:" in err else "tierlm: error")
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err
    if rc == 2:  # argparse's "prog: error: ..." or tierlm's "tierlm: error: ..."
        assert err.partition("error: ")[2].strip(), f"an error exit must say why: {err!r}"


# -- config ----

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["8GiB", "1.5 gb", "0", "-1", "nan", "inf", "auto", "none", "AdamW", "disk",
                     "tiered", "1e309", "0x10", "1_000", "", "..", "/tmp/x", "../../etc"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)
section_bodies = st.one_of(
    values,
    st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), values, max_size=6),
)
config_docs = st.one_of(
    values,
    st.dictionaries(st.one_of(st.sampled_from(SECTIONS), st.text(max_size=8)), section_bodies,
                    max_size=5),
)


@FUZZ
@given(doc=config_docs)
def test_fuzz_config_files(doc):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        assert_clean(*run_cli(["print-config", "--config", str(path)]))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_fuzz_config_text(raw):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_bytes(raw)
        assert_clean(*run_cli(["print-config", "--config", str(path)]))


FLAGS = sorted({o for a in build_parser()._subparsers._group_actions[0].choices[  # noqa: SLF001
    "print-config"]._actions for o in a.option_strings if o.startswith("--")})


@FUZZ
@given(pairs=st.lists(st.tuples(
    st.one_of(st.sampled_from(FLAGS), st.sampled_from(FLAGS),
              st.text(max_size=10).map(lambda t: "--" + t)),
    st.one_of(st.text(max_size=12), st.integers().map(str), st.floats().map(str),
              st.sampled_from(["auto", "8GiB", "nan", "-5", "true", "none", "../x"])),
), max_size=5))
def test_fuzz_cli_flags(pairs):
    argv = ["print-config"]
    for flag, value in pairs:
        if flag in ("--help", "-h", "--config"):
            continue
        argv += [flag, value]
    assert_clean(*run_cli(argv))


# -- data ----

@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog " * 20], 300)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=5,
)
records = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=80)}),
    st.fixed_dictionaries({"text": json_values}),
    json_values,
)
jsonl = st.lists(st.one_of(records.map(json.dumps), st.text(max_size=30)), max_size=8).map(
    lambda lines: "\n".join(lines).encode())
VALID = "\n".join(json.dumps({"text": f"document {i}: the quick brown fox."})
                  for i in range(40)).encode()


@st.composite
def corrupted(draw):
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[pos : pos + draw(st.integers(1, 20))]
    return bytes(data)


words = st.lists(st.sampled_from(["the", "fox", "über", "日本", "\t", "\n", "\r\n", "\x00",
                                   "\u2028", "\ufeff", "dog.", "🦊", " "]), max_size=120)
contents = st.one_of(st.binary(max_size=400), st.text(max_size=400).map(str.encode), jsonl,
                     corrupted(), words.map(lambda w: " ".join(w).encode()))
files = st.tuples(
    st.sampled_from([".txt", ".txt", ".jsonl", ".jsonl", ".JSONL", ".json", ".parquet", ".arrow",
                     ".md", ""]), contents)


@FUZZ
@given(entries=st.lists(files, min_size=1, max_size=3), as_dir=st.booleans(),
       seq_len=st.integers(1, 16), batch=st.integers(1, 4),
       text_field=st.sampled_from(["text", "content"]))
def test_fuzz_data_files(tokenizer, entries, as_dir, seq_len, batch, text_field):
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, (suffix, data) in enumerate(entries):
            p = Path(d) / "data" / f"part{i}{suffix}"
            p.parent.mkdir(exist_ok=True)
            p.write_bytes(data)
            paths.append(p)
        target = paths[0].parent if as_dir else paths[0]
        try:
            corpus = load_corpus(str(target), None, text_field=text_field)
            ids = encode_documents(tokenizer, corpus.train)
            check_token_stream(ids, len(tokenizer), corpus.train, tokenizer.eos_token_id,
                               "training data")
            sampler = BatchSampler(PackedSequences(ids, seq_len, "training data"), batch, 0)
            b = sampler.next_batch()
            assert b.shape == (batch, seq_len + 1) and int(b.max()) < len(tokenizer)
            event("batches")
        except DataError as exc:
            event("DataError: " + str(exc).split(": ", 1)[-1][:25])
            # it says which input is bad: a file, the directory, or the corpus as a whole
            where = [p.name for p in paths] + [str(target), "training data"]
            assert any(w in str(exc) for w in where), str(exc)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
texts = st.one_of(st.text(max_size=20), st.sampled_from(["", " ", "the fox"]))
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", ""]),
                           "content": st.one_of(texts, json_values)}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": texts}),
    st.fixed_dictionaries({"content": texts}),
    json_values,
)
example_records = st.one_of(
    st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=4), json_values)}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant"]), "content": texts}), min_size=1,
        max_size=4)}),
    st.fixed_dictionaries({"prompt": st.one_of(texts, json_values),
                           "completion": st.one_of(texts, json_values)}),
    st.fixed_dictionaries({"prompt": texts, "completion": texts}),
    st.fixed_dictionaries({"instruction": texts, "input": st.one_of(texts, st.none(), json_values),
                           "output": texts}),
    records,
)
words_text = st.lists(st.sampled_from(["the", "fox", "über", "日本", "\n", "🦊", "dog."]),
                      min_size=1, max_size=12).map(" ".join)
valid_chats = st.lists(st.fixed_dictionaries({"messages": st.tuples(words_text, words_text).map(
    lambda p: [{"role": "user", "content": p[0]}, {"role": "assistant", "content": p[1]}])}),
    min_size=2, max_size=6)
valid_pairs = st.lists(st.fixed_dictionaries({"prompt": words_text, "completion": words_text}),
                       min_size=2, max_size=6)


def _write_records(path: Path, recs: list, suffix: str) -> None:
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:  # mixed records may not make one table; then the file is garbage, also a case
            pq.write_table(pa.Table.from_pylist(recs), path)
            return
        except Exception:  # noqa: BLE001 - the writer, not the code under test
            pass
    if suffix == ".json":
        path.write_text(json.dumps(recs))
    else:
        path.write_text("\n".join(json.dumps(r) for r in recs))


@FUZZ
@given(recs=st.one_of(st.lists(example_records, min_size=1, max_size=6), valid_chats, valid_pairs),
       suffix=st.sampled_from([".jsonl", ".json", ".parquet"]), seq_len=st.integers(1, 16),
       packing=st.sampled_from(["stream", "off", "documents"]),
       train_on=st.sampled_from(["auto", "all", "assistant", "completion"]),
       fmt=st.sampled_from(["auto", "auto", "chat", "prompt_completion", "text"]))
def test_fuzz_example_files(tokenizer, recs, suffix, seq_len, packing, train_on, fmt):
    from tierlm.config import DataConfig
    from tierlm.data.examples import resolve_schema
    from tierlm.data.finetune import load_finetune_data

    tokenizer.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"part{suffix}"
        _write_records(path, recs, suffix)
        data = DataConfig(train=str(path), seq_len=seq_len, packing=packing, train_on=train_on,
                          format=fmt)
        try:
            schema = resolve_schema(data)
            got = load_finetune_data(data, schema, tokenizer)
            got.check_vocab(len(tokenizer))
            b = BatchSampler(got.train, 1, 0).next_batch()
            assert b.shape == (1, 3 if packing == "documents" else 2, seq_len + 1)
            ids, labels = b[:, 0], b[:, 1]
            assert bool(((labels == -100) | (labels == ids)).all())
            assert bool((labels[:, 1:] != -100).any())
            event("batches " + schema.format)
        except DataError as exc:
            event("DataError: " + str(exc).split(": ", 1)[-1][:25])
            where = [path.name, "training data", "held-out data", "--data"]
            assert any(w in str(exc) for w in where), str(exc)


# -- checkpoints ----

@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig

    run = tmp_path_factory.mktemp("ckpt-run")
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2)
    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(8, 4, generator=g), "b": torch.randn(3, generator=g)}
    optim = {"a.weight.exp_avg": torch.randn(8, 4, generator=g), "a.weight.step": torch.tensor(3.)}
    state = TrainState(step=5, sampler={"epoch": 0, "index": 1}, run_config={})
    save_checkpoint(run, shards=[("", weights, optim)], model_config=config, tokenizer=None,
                    state=state)
    return run, weights, optim


def _rewrite_manifest(path: Path) -> None:
    import hashlib

    manifest = json.loads((path / MANIFEST).read_text())
    for name in manifest:
        f = path / name
        if f.is_file():
            manifest[name] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                              "size_bytes": f.stat().st_size}
    (path / MANIFEST).write_text(json.dumps(manifest))


def _listed(manifest: bytes) -> list[str]:
    """The file names a (possibly damaged) manifest lists."""
    try:
        entries = json.loads(manifest)
    except ValueError:
        return []
    return [name for name in entries if isinstance(name, str)] if isinstance(entries, dict) else []


def test_a_renamed_tensor_under_a_forged_manifest_is_refused(good_checkpoint, tmp_path):
    """Found by the fuzz test below: one flipped byte in a header turned 'a.weight' into
    'a.weighu', a valid file; with the manifest rewritten to match, only state.json's list of
    each file's tensors tells."""
    run, _, _ = good_checkpoint
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "checkpoints" / "step_00000005"
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes().replace(b'"a.weight"', b'"a.weighu"', 1))
    _rewrite_manifest(ckpt)
    with pytest.raises(CheckpointError, match="model.safetensors does not hold the tensors"):
        load_checkpoint(latest_valid_checkpoint(copy, warn=lambda m: None))


@FUZZ
@given(target=st.sampled_from(["model.safetensors", "optimizer.safetensors", "rng.safetensors",
                               "state.json", MANIFEST, "config.json"]),
       damage=st.sampled_from(["flip", "truncate", "garbage", "delete", "append"]),
       pos=st.floats(0, 1), byte=st.integers(1, 255), garbage=st.binary(max_size=64),
       fix_manifest=st.booleans())
# found by fuzzing: whitespace appended to the manifest changes its bytes, not what it says
@example(target=MANIFEST, damage="append", pos=0.0, byte=1, garbage=b"\t", fix_manifest=False)
# the file no load reads: only verification can refuse the checkpoint without it
@example(target="config.json", damage="delete", pos=0.0, byte=1, garbage=b"", fix_manifest=True)
def test_fuzz_checkpoint_files(good_checkpoint, target, damage, pos, byte, garbage,
                               fix_manifest):
    """Damage one file of a good checkpoint. Verification must catch it (naming the file);
    with the manifest rewritten to match (a checksum-passing forgery), loading must still end
    in a CheckpointError naming the file or in the saved tensors, never in another exception.
    A deleted file never loads."""
    run, weights, optim = good_checkpoint
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "run"
        shutil.copytree(run, copy)
        ckpt = copy / "checkpoints" / "step_00000005"
        f = ckpt / target
        data = bytearray(f.read_bytes())
        at = min(int(pos * len(data)), len(data) - 1)
        if damage == "flip":
            data[at] ^= byte
        elif damage == "truncate":
            del data[at:]
        elif damage == "garbage":
            data[at : at + len(garbage)] = garbage
        elif damage == "append":
            data += garbage or b"x"
        if damage == "delete":
            f.unlink()
        else:
            f.write_bytes(bytes(data))
        forged = fix_manifest and target != MANIFEST
        if forged:
            _rewrite_manifest(ckpt)
        warnings: list[str] = []
        try:
            path = latest_valid_checkpoint(copy, warn=warnings.append)
            w, o, _ = load_checkpoint(path)
            loaded = {k: w[k] for k in w}, {k: o[k] for k in o}
        except CheckpointError as exc:
            event("CheckpointError" + (" (forged manifest)" if forged else ""))
            said = "\n".join([str(exc), *warnings])
            # a damaged manifest can misdescribe a file: then the error names that file
            named = [MANIFEST, *_listed(bytes(data))] if target == MANIFEST else [target]
            assert any(name in said for name in named), said
            return
        event("loaded")
        assert damage != "delete", f"loaded a checkpoint whose {target} was deleted"
        if not forged:
            # the only way through without the manifest fixed: the damage changed nothing (in
            # the manifest, which no checksum covers, nothing it says: e.g. appended whitespace)
            original = (run / "checkpoints" / "step_00000005" / target).read_bytes()
            if target == MANIFEST:
                assert json.loads(bytes(data)) == json.loads(original)
            else:
                assert bytes(data) == original
        for got, saved in zip(loaded, (weights, optim), strict=True):
            assert got.keys() == saved.keys()
            if forged and target in ("model.safetensors", "optimizer.safetensors"):
                continue  # a forged tensor file may carry other values: only its names are held
            for k, v in saved.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
