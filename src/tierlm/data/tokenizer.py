"""Tokenizers: a byte-level BPE trained on the corpus, or the one shipped with a model.

Everything is a `transformers.PreTrainedTokenizerFast`, so a trained tokenizer saves into a
Hugging Face model directory and loads back with `AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tierlm.cache_keys import producer_key
from tierlm.data.corpus import DataError, Document

EOS_TOKEN = "<|endoftext|>"
# Bump when training settings change, so old caches are not mistaken for new tokenizers.
_CACHE_FORMAT_VERSION = 1
_MIN_VOCAB_SIZE = 256 + 1  # every byte plus the end-of-text token
# Any one of these means the directory ships a tokenizer AutoTokenizer can try to load.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style) with `<|endoftext|>` as eos, bos and pad.

    Deterministic for the same texts and vocab size. The vocabulary may come out smaller than
    `vocab_size` when the texts have too few distinct pairs to merge; use `len(tokenizer)`.
    """
    if vocab_size < _MIN_VOCAB_SIZE:
        raise DataError(
            f"data.vocab_size={vocab_size} is too small for a byte-level BPE; use at least "
            f"{_MIN_VOCAB_SIZE} (256 bytes + end-of-text)"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 bytes up front, so text unseen in training still encodes without <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # Byte-level decoding is already exact; the cleanup would alter spaces before punctuation.
        clean_up_tokenization_spaces=False,
    )


def _producer_key() -> str:
    """The versions of torch, tokenizers and transformers and this module's source: another
    release may train or encode other ids from the same texts (tierlm.cache_keys)."""
    return producer_key(sys.modules[__name__])


def _cache_key(texts: Sequence[str], vocab_size: int) -> str:
    digest = hashlib.sha256()
    digest.update(f"tierlm-bpe-v{_CACHE_FORMAT_VERSION}\0vocab={vocab_size}\0".encode())
    digest.update(f"{_producer_key()}\0".encode())
    for text in texts:
        data = text.encode("utf-8")
        # Length prefixes keep ["ab", "c"] and ["a", "bc"] apart.
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


def load_or_train_tokenizer(
    texts: Sequence[str], vocab_size: int, cache_dir: Path
) -> PreTrainedTokenizerFast:
    """Load the BPE for these texts and vocab size from `cache_dir`, training it on a miss."""
    cache_dir = Path(cache_dir)
    final_dir = cache_dir / f"bpe-{_cache_key(texts, vocab_size)}"
    if final_dir.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(final_dir)
    tokenizer = train_bpe_tokenizer(texts, vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Save beside the final path and rename: a crash mid-save never leaves a half cache.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}-", dir=cache_dir))
    try:
        tokenizer.save_pretrained(tmp_dir)
        os.replace(tmp_dir, final_dir)
    except OSError:
        # Another process finished the same cache first; its copy is equivalent.
        if not final_dir.is_dir():
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return tokenizer


def load_model_tokenizer(
    model_dir: str | Path, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerFast:
    """The tokenizer shipped in a Hugging Face model directory; pad falls back to eos. Code it
    ships runs only with `trust_remote_code` (--trust-remote-code)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise DataError(f"{model_dir}: no such model directory; check --model (model.path)")
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise DataError(
            f"{model_dir}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)}); copy "
            "the tokenizer of the checkpoint into this directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as err:  # loaders raise OSError, ValueError, KeyError... depending on format
        raise DataError(f"{model_dir}: could not load its tokenizer: {err}") from err
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise DataError(
            f"{model_dir}: tokenizer loads as {type(tokenizer).__name__}, not a fast tokenizer; "
            "add a tokenizer.json (e.g. save it once with a recent `transformers`)"
        )
    if tokenizer.eos_token is None:
        raise DataError(
            f"{model_dir}: tokenizer has no eos token, needed to separate documents; set "
            "eos_token in tokenizer_config.json"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_documents(tok: PreTrainedTokenizerFast, docs: Sequence[Document]) -> torch.Tensor:
    """One flat int64 token stream: each document's ids followed by eos."""
    if tok.eos_token_id is None:
        raise DataError("tokenizer has no eos token, needed to separate documents")
    if not docs:
        return torch.empty(0, dtype=torch.int64)
    # One batch call lets the Rust tokenizer encode documents in parallel. verbose=False: whole
    # documents exceed a model's max length on purpose; packing cuts them later.
    encoded = tok(
        [doc.text for doc in docs],
        add_special_tokens=False,
        return_attention_mask=False,
        verbose=False,
    )["input_ids"]
    eos = [tok.eos_token_id]
    flat = list(itertools.chain.from_iterable(itertools.chain(ids, eos) for ids in encoded))
    return torch.tensor(flat, dtype=torch.int64)


def encode_documents_cached(
    tok: PreTrainedTokenizerFast, docs: Sequence[Document], cache_dir: Path
) -> torch.Tensor:
    """`encode_documents`, kept in `cache_dir` between runs. The key is the tokenizer's own
    serialisation, its eos id, every document's text and the producing code and libraries
    (`_producer_key`), so a change to any of them encodes again; a corpus is otherwise encoded
    once, not at every start (Shakespeare: 3.5 s each)."""
    digest = hashlib.sha256()
    digest.update(f"tierlm-tokens-v1\0{type(tok).__name__}\0{tok.eos_token_id}\0".encode())
    digest.update(f"{_producer_key()}\0".encode())
    digest.update(tok.backend_tokenizer.to_str().encode("utf-8"))
    for doc in docs:
        data = doc.text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    path = Path(cache_dir) / f"tokens-{digest.hexdigest()[:24]}.int32"
    if path.is_file():
        return torch.from_file(str(path), size=path.stat().st_size // 4,
                               dtype=torch.int32).to(torch.int64)
    ids = encode_documents(tok, docs)
    if ids.numel() and int(ids.max()) < 2**31:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the final name and renamed: a crash never leaves half a cache.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(ids.to(torch.int32).numpy().tobytes())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ids


def check_token_ids(ids: torch.Tensor, vocab_size: int, source: str) -> None:
    """Fail early, with a readable message, on ids the model's embedding cannot index."""
    flat = ids.flatten()
    bad = (flat < 0) | (flat >= vocab_size)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        token_id = int(flat[position])
        raise DataError(
            f"{source}: token id {token_id} at position {position} is outside the model "
            f"vocabulary of {vocab_size}; the tokenizer does not match the model (use the "
            "model's own tokenizer, or resize its embeddings)"
        )
