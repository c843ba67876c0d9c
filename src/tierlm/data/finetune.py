"""Fine-tuning data end to end: records to masked training and eval sequences, and the summary
printed at the start of a run (so a user sees what the model will learn)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierlm.config import DataConfig
from tierlm.data.errors import DataError
from tierlm.data.examples import (
    ChatRenderer,
    Encoded,
    Schema,
    detect_format,
    encode_examples,
    show_example,
)
from tierlm.data.packing import MaskedSequences, PaddedExamples
from tierlm.data.records import data_files, iter_records

_TRAIN_FLAG, _EVAL_FLAG = "--data (data.train)", "--eval-data (data.eval)"


@dataclass
class FinetuneData:
    train: MaskedSequences | PaddedExamples
    eval: MaskedSequences | PaddedExamples
    encoded: dict[str, Encoded]
    summary: list[str] = field(default_factory=list)
    chat_template: str | None = None
    """The --data.chat_template text the examples were rendered with (None: the tokenizer's own
    or no chat): the run saves it with its tokenizer, so the exported model chats the same way."""

    def check_vocab(self, vocab_size: int) -> None:
        """Reject ids the embedding cannot index, naming the example (file and line or row)."""
        for source, enc in self.encoded.items():
            bad = ((enc.tokens < 0) | (enc.tokens >= vocab_size)).nonzero()
            if bad.numel():
                pos = int(bad[0, 0])
                i = int(torch.searchsorted(enc.offsets, pos, right=True)) - 1
                raise DataError(
                    f"{source}: token id {int(enc.tokens[pos])} in {enc.names[i]} (token "
                    f"{pos - int(enc.offsets[i])} of that example) is outside the model "
                    f"vocabulary of {vocab_size}; the tokenizer does not match the model (use "
                    "the model's own tokenizer, or resize its embeddings)"
                )


def _check_eval_format(data: DataConfig, schema: Schema) -> None:
    if data.eval is None or data.format != "auto":
        return
    file = data_files(Path(data.eval), flag=_EVAL_FLAG)[0]
    for where, record in iter_records(file):
        fmt = detect_format(where, record, data)
        if fmt != schema.format:
            raise DataError(f"{where}: eval records read as {fmt} but the training data as "
                            f"{schema.format}; give --eval-data in the training data's schema")
        return


def load_finetune_data(data: DataConfig, schema: Schema, tokenizer: Any) -> FinetuneData:
    """Encode --data (and --eval-data, else hold out the last `eval_fraction` of the examples)
    and pack them as `--data.packing` says."""
    if data.train is None:
        raise DataError(f"{schema.format} data needs --data; the built-in corpus is plain text")
    _check_eval_format(data, schema)
    train = encode_examples(data.train, schema, tokenizer, flag=_TRAIN_FLAG)
    if data.eval is not None:
        held_out = encode_examples(data.eval, schema, tokenizer, flag=_EVAL_FLAG)
        split = f"eval from {data.eval}"
    else:
        n = len(train)
        if n < 2:
            raise DataError(f"{data.train}: only {n} example, too few to hold one out for "
                            "evaluation; add examples or pass --eval-data")
        n_eval = min(max(1, round(n * data.eval_fraction)), n - 1)
        train, held_out = train.select(0, n - n_eval), train.select(n - n_eval, n)
        split = f"last {n_eval} examples held out"

    def pack(enc: Encoded, source: str) -> MaskedSequences | PaddedExamples:
        if data.packing == "off":
            pad = tokenizer.pad_token_id
            pad = tokenizer.eos_token_id if pad is None else pad
            return PaddedExamples(enc.tokens, enc.trained, enc.offsets, data.seq_len, pad, source)
        starts = None
        if data.packing == "documents":
            starts = torch.zeros(enc.tokens.numel(), dtype=torch.bool)
            starts[enc.offsets[:-1]] = True
        return MaskedSequences(enc.tokens, enc.trained, data.seq_len, source, starts)

    out = FinetuneData(train=pack(train, "training data"), eval=pack(held_out, "held-out data"),
                       encoded={"training data": train, "held-out data": held_out})
    out.summary = _summary(data, schema, tokenizer, out, split)
    if schema.format == "chat" and data.chat_template is not None:
        out.chat_template = ChatRenderer(tokenizer, data.chat_template, schema).template
    return out


def _summary(data: DataConfig, schema: Schema, tokenizer: Any, out: FinetuneData,
             split: str) -> list[str]:
    template = ""
    if schema.format == "chat":
        template = f"; template: {ChatRenderer(tokenizer, data.chat_template, schema).name}"
    lines = [f"data: {data.train}: {schema.format}, training on {schema.train_on} tokens{template}"
             f"; packing {data.packing}; {split}"]
    for (name, enc), seqs in zip(out.encoded.items(), (out.train, out.eval), strict=True):
        tokens, trained = enc.tokens.numel(), int(enc.trained.sum())
        line = (f"  {name}: {len(enc)} examples, {tokens:,} tokens, {trained:,} trained "
                f"({trained / max(tokens, 1):.1%}); {len(seqs)} sequences of {data.seq_len}")
        truncated = getattr(seqs, "truncated", None)
        if truncated is not None:
            line += f"; {truncated} examples truncated to their first {data.seq_len + 1} tokens"
        else:
            longer = int(((enc.offsets[1:] - enc.offsets[:-1]) > data.seq_len + 1).sum())
            line += f"; {longer} examples longer than a row, split across rows"
        if seqs.dropped_rows:
            line += f"; {seqs.dropped_rows} sequences without a trained token dropped"
        lines.append(line)
    enc = out.encoded["training data"]
    a, b = int(enc.offsets[0]), int(enc.offsets[1])
    lines.append(f"  example {enc.names[0]} (trained tokens in [[ ]]):")
    lines.append(show_example(tokenizer, enc.tokens[a:b], enc.trained[a:b]))
    return lines
