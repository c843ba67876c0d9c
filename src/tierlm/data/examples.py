"""Fine-tuning examples: chat and prompt/completion records, as tokens and a loss mask.

Each record renders to one string and the character spans the loss covers: a conversation
through the tokenizer's chat template (the assistant turns, each found as the difference between
the template's rendering up to that turn and up to the turn before it with the generation
prompt), a prompt/completion pair as prompt + completion (the completion). The string is
tokenized once, with offsets, and a token is trained when its characters overlap a trained span,
so the mask follows the model's own tokenization of the whole example. Each example ends with
eos, trained for prompt/completion (the model learns to stop) and under `train_on all`; a
conversation's end of turn is the template's own tokens. An example the template already ends
with eos (ChatML whose eos is its end of turn, before a trailing newline) gets no second one
(`_ends_with_eos`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierlm.config import DataConfig
from tierlm.data.corpus import text_of
from tierlm.data.errors import DataError
from tierlm.data.records import data_files, iter_records

# What each format trains on by default, and what it allows.
TRAIN_ON = {"text": ("all",), "chat": ("assistant", "all"),
            "prompt_completion": ("completion", "all")}
_ENCODE_BATCH = 256  # records tokenized per call: the Rust tokenizer runs them in parallel


@dataclass(frozen=True)
class Schema:
    """How the records of one run read: the format and what the loss covers."""

    format: str
    train_on: str
    fields: DataConfig


def detect_format(where: str, record: Any, data: DataConfig) -> str:
    """The format of one record (see `--data.format`), or an error naming the record."""
    if isinstance(record, str):
        return "text"  # a .txt file
    if isinstance(record, dict):
        if data.messages_field in record:
            return "chat"
        if data.prompt_field in record and data.completion_field in record:
            return "prompt_completion"
        if "instruction" in record and "output" in record:
            return "prompt_completion"
        if data.text_field in record:
            return "text"
    found = (f"fields: {', '.join(sorted(map(str, record))) or 'none'}"
             if isinstance(record, dict) else f"a {type(record).__name__}, not an object")
    raise DataError(
        f"{where}: unknown schema ({found}); expected '{data.text_field}' (text), "
        f"'{data.messages_field}' (chat), "
        f"'{data.prompt_field}' + '{data.completion_field}' or 'instruction' + 'output' "
        "(prompt/completion); set --data.format and the field names (--data.text_field, "
        "--data.messages_field, --data.prompt_field, --data.completion_field)"
    )


def resolve_schema(data: DataConfig) -> Schema:
    """The run's format (`--data.format`, or detected from the first record of --data) and
    what its loss trains on (`--data.train_on`, or the format's default)."""
    fmt = data.format
    if fmt == "auto":
        fmt = "text"  # the built-in corpus
        if data.train is not None:
            file = data_files(Path(data.train), flag="--data (data.train)")[0]
            # a .txt file is one text document: no need to read it here
            for where, record in iter_records(file) if file.suffix.lower() != ".txt" else ():
                fmt = detect_format(where, record, data)
                break
    allowed = TRAIN_ON[fmt]
    train_on = allowed[0] if data.train_on == "auto" else data.train_on
    if train_on not in allowed:
        raise DataError(
            f"--data.train_on {train_on} does not apply to {fmt} data; use "
            f"{' or '.join(allowed)} (or --data.format to read the records differently)"
        )
    return Schema(format=fmt, train_on=train_on, fields=data)


# ---- rendering --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    where: str
    text: str
    spans: tuple[tuple[int, int], ...]
    """Character ranges [start, end) the loss covers."""
    eos_trained: bool


def _string_field(where: str, record: dict, key: str, label: str | None = None) -> str:
    label = label or key
    if key not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(f"{where}: record has no field '{label}' (fields: {fields}); set the "
                        "field names (--data.prompt_field, --data.completion_field) or "
                        "--data.format")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{label}' is {type(value).__name__}, not a string")
    return value


def render_prompt_completion(where: str, record: Any, schema: Schema) -> Rendered:
    """prompt + completion; the Alpaca layout's prompt is the instruction, then its input after
    a blank line when there is one, then a blank line; its completion is the output."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object, got {type(record).__name__}")
    f = schema.fields
    if f.prompt_field in record or "instruction" not in record:
        prompt = _string_field(where, record, f.prompt_field)
        completion_key = f.completion_field
    else:
        prompt = _string_field(where, record, "instruction")
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: field 'input' is {type(extra).__name__}, not a string")
        prompt = prompt + (f"\n\n{extra}" if extra.strip() else "") + "\n\n"
        completion_key = "output"
    completion = _string_field(where, record, completion_key)
    if not completion.strip():
        raise DataError(f"{where}: field '{completion_key}' is empty: nothing to train on; "
                        "remove the record or fill it in")
    text = prompt + completion
    start = 0 if schema.train_on == "all" else len(prompt)
    return Rendered(where, text, ((start, len(text)),), eos_trained=True)


class ChatRenderer:
    """Conversations through a chat template: the tokenizer's own, or `--data.chat_template`."""

    def __init__(self, tokenizer: Any, template_path: str | None, schema: Schema) -> None:
        if template_path is not None:
            path = Path(template_path)
            if not path.is_file():
                raise DataError(f"{path}: no such chat template file; check --data.chat_template")
            self.template = path.read_text(encoding="utf-8")
            self.name = str(path)
        else:
            self.template = getattr(tokenizer, "chat_template", None)
            if isinstance(self.template, dict):  # several named templates: use the default
                self.template = self.template.get("default")
            self.name = "the tokenizer's chat template"
        if not self.template:
            raise DataError(
                "chat data needs a chat template and the model's tokenizer has none (no "
                "chat_template in tokenizer_config.json or chat_template.jinja); pass a Jinja "
                "template file with --data.chat_template PATH"
            )
        self.tokenizer = tokenizer
        self.schema = schema

    def _render(self, where: str, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as err:  # jinja2 errors, raise_exception() in the template
            raise DataError(f"{where}: the chat template ({self.name}) failed on this "
                            f"conversation: {err}") from err

    def __call__(self, where: str, record: Any) -> Rendered:
        key = self.schema.fields.messages_field
        messages = _messages(where, record, key)
        text = self._render(where, messages)
        if self.schema.train_on == "all":
            return Rendered(where, text, ((0, len(text)),), eos_trained=True)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(where, messages[:i], generation_prompt=True)
            upto = self._render(where, messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(
                    f"{where}: {self.name} does not render this conversation turn by turn (the "
                    f"text up to turn {i + 1} is not a prefix of the whole), so the assistant's "
                    "tokens cannot be found; use --data.train_on all, or a template without "
                    "turn-dependent rewriting via --data.chat_template"
                )
            spans.append((len(before), len(upto)))
        return Rendered(where, text, tuple(spans), eos_trained=False)


def _messages(where: str, record: Any, key: str) -> list[dict]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with '{key}', got {type(record).__name__}")
    messages = record.get(key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field '{key}' must be a non-empty list of {{role, content}} "
                        f"messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        at = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: field '{at}' is {type(m).__name__}, not an object with "
                            "role and content")
        if "role" not in m:
            raise DataError(f"{where}: field '{at}.role' is missing; every message needs a role "
                            "(system, user, assistant)")
        if not isinstance(m["role"], str):
            raise DataError(f"{where}: field '{at}.role' is {type(m['role']).__name__}, not a "
                            "string")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field '{at}.content' is "
                            f"{type(m.get('content')).__name__}, not a string")
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: field '{at}.content' is an empty assistant turn: nothing "
                            "to train on; remove the message or fill it in")
    return messages


# ---- tokens and masks -------------------------------------------------------------------------


@dataclass
class Encoded:
    """Examples as one flat token stream with its loss mask and the examples' boundaries."""

    tokens: torch.Tensor  # (N,) int64
    trained: torch.Tensor  # (N,) bool: the loss predicts this token
    offsets: torch.Tensor  # (examples + 1,) int64: example i is tokens[offsets[i]:offsets[i+1]]
    names: list[str]

    def __len__(self) -> int:
        return len(self.names)

    def select(self, start: int, stop: int) -> Encoded:
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        return Encoded(self.tokens[a:b], self.trained[a:b], self.offsets[start : stop + 1] - a,
                       self.names[start:stop])


def _records(path: str, flag: str) -> Iterator[tuple[str, Any]]:
    for file in data_files(Path(path), flag=flag):
        yield from iter_records(file)


def example_texts(path: str, schema: Schema, flag: str) -> Iterator[str]:
    """The plain text of every example, for training a tokenizer when the model brings none."""
    f = schema.fields
    for where, record in _records(path, flag):
        if schema.format == "chat":
            yield "\n".join(m["content"] for m in _messages(where, record, f.messages_field))
        elif schema.format == "prompt_completion":
            yield render_prompt_completion(where, record, schema).text
        else:
            yield text_of(where, record, f.text_field)


def encode_examples(path: str, schema: Schema, tokenizer: Any, *, flag: str) -> Encoded:
    """Stream the records of `path`, render and tokenize them a batch at a time; only the
    tokens and their mask are kept."""
    if schema.format == "chat":
        render = ChatRenderer(tokenizer, schema.fields.chat_template, schema)
    elif schema.format == "prompt_completion":
        def render(where: str, record: Any) -> Rendered:
            return render_prompt_completion(where, record, schema)
    else:
        def render(where: str, record: Any) -> Rendered:
            text = record if isinstance(record, str) else text_of(where, record,
                                                                   schema.fields.text_field)
            return Rendered(where, text, ((0, len(text)),), eos_trained=True)
    # one tensor per batch of records, not per example: millions of small tensors would cost
    # more than their tokens
    tokens: list[torch.Tensor] = []
    trained: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    names: list[str] = []
    batch: list[Rendered] = []

    def flush() -> None:
        ids, mask = _tokenize(tokenizer, batch)
        tokens.append(torch.cat(ids))
        trained.append(torch.cat(mask))
        lengths.append(torch.tensor([i.numel() for i in ids], dtype=torch.int64))
        names.extend(r.where for r in batch)
        batch.clear()

    for where, record in _records(path, flag):
        batch.append(render(where, record))
        if len(batch) == _ENCODE_BATCH:
            flush()
    if batch:
        flush()
    if not names:
        raise DataError(f"{path}: no examples; check {flag}")
    offsets = torch.zeros(len(names) + 1, dtype=torch.int64)
    offsets[1:] = torch.cat(lengths).cumsum(0)
    return Encoded(torch.cat(tokens), torch.cat(trained), offsets, names)


def _tokenize(
    tokenizer: Any, batch: list[Rendered]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if tokenizer.eos_token_id is None:
        raise DataError("tokenizer has no eos token, needed to separate examples")
    enc = tokenizer(
        [r.text for r in batch], add_special_tokens=False, return_offsets_mapping=True,
        return_attention_mask=False, verbose=False,
    )
    eos = tokenizer.eos_token_id
    ids_out, mask_out = [], []
    for r, ids, offs in zip(batch, enc["input_ids"], enc["offset_mapping"], strict=True):
        offs_t = torch.tensor(offs, dtype=torch.int64).reshape(-1, 2)  # (tokens, 2) chars
        closed = _ends_with_eos(r.text, ids, offs_t, eos)
        ids_t = torch.tensor(ids if closed else [*ids, eos], dtype=torch.int64)
        mask = torch.zeros(ids_t.numel(), dtype=torch.bool)
        for s, e in r.spans:
            mask[: len(ids)] |= (offs_t[:, 1] > s) & (offs_t[:, 0] < e)
        if not closed:
            mask[-1] = r.eos_trained
        ids_out.append(ids_t)
        mask_out.append(mask)
    return ids_out, mask_out


def _ends_with_eos(text: str, ids: list[int], offs: torch.Tensor, eos: int) -> bool:
    """Whether the rendered example already ends with eos, so that none is appended.

    A chat template whose end of turn is the tokenizer's eos (ChatML with eos `<|im_end|>`)
    closes the example itself, and usually adds a newline after it: "...<|im_end|>\n". Another
    eos there would teach the model doubled end markers. The rule: take the last token that
    starts before the text's trailing whitespace (tokens lying wholly in that whitespace, such
    as the template's newline, are skipped; they stay in the example, as the template renders
    them at inference too); the example is closed when that token is eos. When anything else
    ends the text, the example gets its eos as before: so does a template whose end of turn is
    another token (Llama 3's `<|eot_id|>` with eos `<|end_of_text|>`), where the eos separates
    examples."""
    body_chars = len(text.rstrip())
    before = (offs[:, 0] < body_chars).nonzero()  # tokens starting inside the body
    return before.numel() > 0 and ids[int(before[-1, 0])] == eos


def show_example(tokenizer: Any, ids: torch.Tensor, trained: torch.Tensor,
                 max_tokens: int = 400) -> str:
    """The example's text with its trained spans between [[ and ]]."""
    ids, trained = ids[:max_tokens].tolist(), trained[:max_tokens].tolist()
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tokenizer.decode(ids[start:i])
            out.append(f"[[{text}]]" if trained[start] else text)
            start = i
    return "".join(out)
