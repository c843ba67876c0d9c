"""Fixed-length training sequences from a token stream, and deterministic, resumable batches."""

from __future__ import annotations

import torch

from tierlm.data.batch import IGNORE_INDEX
from tierlm.data.errors import DataError

# Keeps one seed's epoch seeds clear of the next seed's (for runs under a million epochs).
_EPOCH_SEED_STRIDE = 1_000_003


class PackedSequences:
    """Fixed-length training sequences cut from one flat token stream.

    Row i holds tokens[i*seq_len : i*seq_len + seq_len + 1]: inputs are [:-1], targets [1:], so
    consecutive rows share one token and every token is a target exactly once.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, source: str) -> None:
        if tokens.dim() != 1:
            raise DataError(
                f"{source}: expected a flat token stream, got shape {tuple(tokens.shape)}"
            )
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}; check --seq-len")
        rows = (tokens.numel() - 1) // seq_len
        if rows <= 0:
            raise DataError(
                f"corpus {source} has {tokens.numel()} tokens, shorter than one sequence of "
                f"seq_len+1 = {seq_len + 1}; use a smaller --seq-len or more data"
            )
        self.seq_len = seq_len
        self.source = source
        # A strided view (no copy): row i starts at token i*seq_len and spans seq_len+1 tokens.
        self._rows = tokens.to(torch.int64).unfold(0, seq_len + 1, seq_len)  # (rows, seq_len+1)

    def __len__(self) -> int:
        return self._rows.shape[0]

    def get(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` as a new (B, seq_len+1) int64 tensor."""
        return self._rows[idx]


class BatchSampler:
    """Deterministic shuffled batches with a resumable position.

    Epoch e visits rows in `torch.randperm` order seeded from (seed, e), so any position can be
    rebuilt from {"epoch", "index"} alone; the last partial batch of each epoch is dropped.
    """

    def __init__(self, data: PackedSequences, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}; check --batch-size")
        if len(data) < batch_size:
            raise DataError(
                f"corpus {data.source} holds only {len(data)} sequences of {data.seq_len} tokens, "
                f"fewer than one batch of {batch_size}; lower --batch-size or --seq-len"
            )
        self._data = data
        self._batch_size = batch_size
        self._seed = seed
        self._batches_per_epoch = len(data) // batch_size
        self._epoch = 0
        self._index = 0  # batches already drawn in the current epoch
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        """Epoch the next batch comes from (= completed epochs)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self._seed * _EPOCH_SEED_STRIDE + epoch)
        return torch.randperm(len(self._data), generator=generator)

    def next_batch(self) -> torch.Tensor:
        """The next (batch_size, seq_len+1) int64 batch; rolls over into the next epoch."""
        start = self._index * self._batch_size
        batch = self._data.get(self._order[start : start + self._batch_size])
        self._index += 1
        if self._index == self._batches_per_epoch:
            self._epoch += 1
            self._index = 0
            self._order = self._epoch_order(self._epoch)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self._batches_per_epoch:
            raise DataError(
                f"sampler state {state} does not fit corpus {self._data.source} "
                f"({self._batches_per_epoch} batches per epoch); resume with the data, "
                "--batch-size and --seq-len the checkpoint was made with"
            )
        self._epoch, self._index = epoch, index
        self._order = self._epoch_order(epoch)


def eval_batches(data: PackedSequences, batch_size: int, max_batches: int) -> list[torch.Tensor]:
    """The first `max_batches` batches in row order: full ones, then the remaining rows as one
    short batch while batches are left (a small held-out set is evaluated whole; the loss is
    averaged over tokens, so a short batch weighs what its tokens weigh)."""
    if batch_size < 1:
        raise DataError(f"eval batch size must be at least 1, got {batch_size}")
    starts = list(range(0, len(data), batch_size))[:max_batches]
    return [data.get(torch.arange(i, min(i + batch_size, len(data)))) for i in starts]


class MaskedSequences:
    """PackedSequences with a loss mask: rows of (ids, labels), (2, seq_len+1) each.

    Cut from the flat stream as PackedSequences cuts it; a row whose targets are all masked
    (a long prompt) is dropped, so every batch has a token to average the loss over.

    With `starts` (True at each example's first token: --data.packing documents) rows gain a
    third line, each token's position within its example (a row that begins inside an example
    counts from 0 there), which the steppers turn into a block-diagonal causal mask; an
    example's first token is then not a target (nothing of its own precedes it).
    """

    def __init__(self, tokens: torch.Tensor, trained: torch.Tensor, seq_len: int,
                 source: str, starts: torch.Tensor | None = None) -> None:
        self._packed = PackedSequences(tokens, seq_len, source)
        self.seq_len, self.source = seq_len, source
        self._starts = None
        if starts is not None:
            trained = trained & ~starts
            self._starts = starts.unfold(0, seq_len + 1, seq_len)[: len(self._packed)]
        self._trained = trained.unfold(0, seq_len + 1, seq_len)[: len(self._packed)]
        self._keep = self._trained[:, 1:].any(dim=1).nonzero().squeeze(1)  # (rows kept,)
        self.dropped_rows = len(self._packed) - self._keep.numel()
        if self._keep.numel() == 0:
            raise DataError(f"{source}: no sequence of {seq_len} tokens has a trained token; "
                            "check --data.train_on, or use a larger --seq-len")

    def __len__(self) -> int:
        return self._keep.numel()

    def get(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` as a new (B, 2, seq_len+1) int64 tensor: ids and labels."""
        rows = self._keep[idx]
        ids = self._packed.get(rows)
        lines = [ids, ids.masked_fill(~self._trained[rows], IGNORE_INDEX)]
        if self._starts is not None:
            at = torch.arange(self.seq_len + 1).expand_as(ids)
            # position = index - index of the latest example start at or before it (row start: 0)
            begun = torch.where(self._starts[rows], at, 0).cummax(dim=1).values
            lines.append(at - begun)
        return torch.stack(lines, dim=1)


class PaddedExamples:
    """One example per row (--data.packing off): padded to seq_len+1 with `pad_id` (label
    IGNORE_INDEX); a longer example keeps its first seq_len+1 tokens (counted in `truncated`).
    Padding sits after the example, so causal attention keeps it out of every trained
    position. Examples left with no trained target are dropped (counted in `dropped_rows`)."""

    def __init__(self, tokens: torch.Tensor, trained: torch.Tensor, offsets: torch.Tensor,
                 seq_len: int, pad_id: int, source: str) -> None:
        width = seq_len + 1
        lengths = offsets[1:] - offsets[:-1]
        self.truncated = int((lengths > width).sum())
        n = lengths.numel()
        ids = torch.full((n, width), pad_id, dtype=torch.int64)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.int64)
        for i in range(n):
            a = int(offsets[i])
            k = min(int(lengths[i]), width)
            ids[i, :k] = tokens[a : a + k]
            labels[i, :k] = tokens[a : a + k].masked_fill(~trained[a : a + k], IGNORE_INDEX)
        keep = (labels[:, 1:] != IGNORE_INDEX).any(dim=1)
        self.dropped_rows = int((~keep).sum())
        self._rows = torch.stack([ids[keep], labels[keep]], dim=1)  # (rows, 2, seq_len+1)
        self.seq_len, self.source = seq_len, source
        if len(self) == 0:
            raise DataError(f"{source}: no example has a trained token within its first "
                            f"{width} tokens; check --data.train_on, or use a larger --seq-len")

    def __len__(self) -> int:
        return self._rows.shape[0]

    def get(self, idx: torch.Tensor) -> torch.Tensor:
        return self._rows[idx]
