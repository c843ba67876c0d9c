"""Training data: corpora, tokenizers, and packed, resumable batches."""

from tierlm.data.corpus import HELD_OUT_PLAYS, Corpus, DataError, Document, load_corpus
from tierlm.data.packing import BatchSampler, PackedSequences, eval_batches
from tierlm.data.tokenizer import (
    EOS_TOKEN,
    check_token_ids,
    encode_documents,
    encode_documents_cached,
    load_model_tokenizer,
    load_or_train_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "HELD_OUT_PLAYS",
    "BatchSampler",
    "Corpus",
    "DataError",
    "Document",
    "PackedSequences",
    "check_token_ids",
    "encode_documents",
    "encode_documents_cached",
    "eval_batches",
    "load_corpus",
    "load_model_tokenizer",
    "load_or_train_tokenizer",
    "train_bpe_tokenizer",
]
