"""Delayed sync (local SGD): ranks step on their own gradients and average weights every k steps.

No gradient crosses the network; every `every` steps (and at the run's last step, so the model
that is exported is the average) each segment's master weights are all-reduced and divided by
the world size. Traffic per step is the model size / k instead of a gradient per step.

Optimizer state stays local: each rank's AdamW moments keep tracking its own gradients, as in
PyTorch's post-local-SGD optimizer. Averaging the moments as well would triple the bytes of
every sync (weights + two moments) and, for the second moment, average quantities that are
only meaningful with the gradients they were built from. Because weights (between syncs) and
moments (always) differ between ranks, the data-parallel stepper writes every rank's state
into rank 0's checkpoint, so a resume with the same world size continues exactly.

Clipping. Dense training clips by the norm of the ranks' mean gradient. A rank's own gradient
is noisier than that mean, so its norm is larger, and clipping each rank by its own norm clips
harder and at other steps than dense training does: on Shakespeare it cost 5.5% held-out
perplexity at k=1 over 40 steps, and half of k=2's gap over 150 steps (bench/sync_parity.py).
By default every rank therefore clips by an estimate of the mean gradient's norm: each rank
adds its gradient into a count sketch (`GradSketch`, 8192 floats: every entry lands in one
hashed bucket with a hashed sign), the sketches are all-reduced (32 KiB per step, counted in the
ledger), and the norm of the mean sketch estimates the mean gradient's norm without bias in
its square (relative error about sqrt(2 / 8192) = 1.6%). Every rank gets the same number, so
they clip, and skip a non-finite step, together.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from tierlm.distributed.comm import Comm
from tierlm.distributed.sync import DONE, DelayedSync, NoSync, Pending
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.state import free_copies, read_copies


class Delayed(NoSync):
    engine_state_per_rank = True

    def __init__(self, comm: Comm, cfg: DelayedSync) -> None:
        self.comm = comm
        self.cfg = cfg
        self.steps = 0
        self.sketch = GradSketch() if cfg.clip == "mean" else None

    def start(self, segment: str, grad: torch.Tensor, slots) -> Pending:
        if self.sketch is not None:
            self.sketch.add(segment, grad)
        return DONE

    def clip_norm(self, local: torch.Tensor) -> torch.Tensor:
        if self.sketch is None:
            return local
        return self.sketch.mean_norm(self.comm).to(local.device)

    def after_step(self, engine, skipped: bool) -> None:
        self.steps += 1
        # Every rank counts every step (skipped or not), so all of them average at once.
        if self.steps % self.cfg.every == 0 or self.steps == self.cfg.final_step:
            average_weights(engine, self.comm)

    def local_state(self) -> dict[str, torch.Tensor]:
        return {"steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if "steps" in state:
            self.steps = int(state["steps"])


def average_weights(engine, comm: Comm) -> None:
    """Replace every segment's master weights by their mean over ranks, wherever they live,
    and mark device copies stale (the same write-back `Engine.load` does)."""
    engine.synchronize()  # the last step's updates must be in the masters
    for st in engine.states:
        bufs = read_copies(engine.store, st, ("master",))
        master = bufs["master"]
        comm.all_reduce_sum(master)
        master.div_(comm.size)
        if st.tier == Tier.DISK:
            engine.store.write_file(st.file("master"), master, TensorClass.MASTER).result()
            free_copies(engine.store, st, bufs)
        if st.device_weights is not None and st.device_weights is not st.master:
            st.device_stale = True
    engine.cache.drop_all()


class GradSketch:
    """A count sketch of one step's gradient: each entry adds ±g[i] to one of `BUCKETS`
    buckets, the same bucket and sign on every rank. The sketch is linear, so the sum of the
    ranks' sketches is the sketch of their summed gradient, and the squared norm of a sketch
    estimates the squared norm of what went in without bias.

    Hashing every entry each step would cost a dozen passes over the gradient, so one pattern
    of `CHUNK` hashed buckets and signs is made once; chunk c of a segment uses it rotated by
    (base + c * stride) buckets and times a sign, base and sign hashed from the segment's name
    and c. With an odd stride no two chunks of a segment share a rotation, so a constant run
    of gradient never lines up with itself; the cost is three passes per entry."""

    BUCKETS = 8192  # a power of two
    CHUNK = 1 << 22  # entries per pattern: 16 MiB of bucket indices and 16 MiB of signs
    _STRIDE = 2654435761 % BUCKETS | 1

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self._pattern: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def pattern(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._pattern:
            h = _mix32(torch.arange(self.CHUNK, dtype=torch.int64, device=device))
            sign = ((h >> 31) * 2 - 1).float()  # the top bit; the bucket takes the low bits
            self._pattern[device] = ((h & (self.BUCKETS - 1)).int(), sign)
        return self._pattern[device]

    def add(self, segment: str, grad: torch.Tensor) -> None:
        flat = grad.reshape(-1)
        if self.sums is None:
            self.sums = torch.zeros(self.BUCKETS, dtype=torch.float32, device=flat.device)
        bucket, sign = self.pattern(flat.device)
        salt = zlib.crc32(segment.encode())
        for c, start in enumerate(range(0, flat.numel(), self.CHUNK)):
            part = flat[start:start + self.CHUNK]
            n = part.numel()
            h = int(_mix32(torch.tensor(salt ^ (c * 0x9E3779B9))))
            shift = ((h & 0xFFFF) + c * self._STRIDE) & (self.BUCKETS - 1)
            rotated = (bucket[:n] + shift) & (self.BUCKETS - 1)
            self.sums.index_add_(0, rotated, part.float() * sign[:n],
                                 alpha=1.0 if h >> 31 else -1.0)

    def mean_norm(self, comm: Comm) -> torch.Tensor:
        """The estimated norm of the ranks' mean gradient (collective: every rank calls it once
        per step, after its last `add`); the sketch starts empty again."""
        sums = self.sums if self.sums is not None else torch.zeros(self.BUCKETS)
        self.sums = None
        comm.all_reduce_sum(sums)
        return torch.linalg.vector_norm(sums) / comm.size


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding 32-bit values: every output bit
    depends on every input bit (a plain multiplicative hash of consecutive indices is a Weyl
    sequence whose signs cancel along constant runs, e.g. a row of a weight gradient, and
    underestimate its norm by 10%)."""
    m = 0xFFFFFFFF
    x = x & m
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & m
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & m
    return x ^ (x >> 16)
