"""Section `data`: corpus, record formats, tokenizer and packing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DataConfig:
    train: str | None = None
    """Training data: a .txt, .jsonl, .json or .parquet file, a directory of them, or a directory
    written by datasets' save_to_disk; empty means the built-in Shakespeare corpus (--data)."""
    eval: str | None = None
    """Held-out text in the same formats; empty means the corpus's held-out plays, or the last
    `eval_fraction` of the training documents for user data (--eval-data)."""
    text_field: str = "text"
    """Field of each record (.jsonl, .json, .parquet, Arrow) that holds the text."""
    format: Literal["auto", "text", "chat", "prompt_completion"] = "auto"
    """How records read: text (plain LM), chat (a list of {role, content} messages),
    prompt_completion (prompt + completion, or Alpaca instruction/input/output); auto detects it
    from the first record's fields."""
    train_on: Literal["auto", "all", "completion", "assistant"] = "auto"
    """Tokens the loss covers: assistant turns (chat), the completion (prompt_completion) or all;
    auto: assistant for chat, completion for prompt_completion, all for text."""
    messages_field: str = "messages"
    """Field of a chat record that holds its messages."""
    prompt_field: str = "prompt"
    """Field of a prompt_completion record that holds the prompt."""
    completion_field: str = "completion"
    """Field of a prompt_completion record that holds the completion."""
    chat_template: str | None = None
    """Jinja chat template file for chat data; empty: the model tokenizer's own template."""
    packing: Literal["stream", "documents", "off"] = "stream"
    """stream: examples joined by eos (none added after an example the chat template already
    ends with eos) and cut into seq_len rows (an example may see the one
    before it); documents: the same rows, each example attending only to itself (per-example
    positions, block-diagonal causal mask); off: one example per row, padded, longer ones
    truncated to their first seq_len+1 tokens."""
    seq_len: int = 256
    """Tokens per training sequence (--seq-len)."""
    vocab_size: int = 8192
    """Vocabulary size of the byte-level BPE tokenizer trained when the model brings none."""
    eval_fraction: float = 0.05
    """Share of user documents held out for evaluation when no `eval` data is given."""

