"""Delayed sync (local SGD): ranks step on their own gradients and average weights every k steps.

No gradient crosses the network; every `every` steps (and at the run's last step, so the model
that is exported is the average) each segment's master weights are all-reduced and divided by
the world size. Traffic per step is the model size / k instead of a gradient per step.

What happens to the optimizer's state at a sync is `moments`:

- "local" (the default): each rank's moments keep tracking its own gradients, as in PyTorch's
  post-local-SGD optimizer, and no extra byte is sent.
- "average": every state slot the optimizer marks averageable (tierlm.optim.flat.StateSlot:
  AdamW's two moments, Lion's one, Adafactor's statistics) is averaged along with the weights,
  sent in bf16, so with AdamW a sync costs twice the bytes of the weights alone. An optimizer
  with a slot that cannot be averaged as a float tensor is refused at setup.

Averaging is what brings delayed sync near dense on real text (bench/sync_parity.py, `small`,
300 steps, seeds 0 and 1): +0.7% and -4.9% against dense at k=2, +3.1% and -1.7% at k=4,
against +11.3% for local moments at k=2 (seed 0). Local still stays the default, for two
reasons: at k=2 averaging sends as many bytes as a dense all-reduce (4 bytes per parameter per
step), which defeats the point of delaying; and the gain did not hold everywhere (at 150 steps
it went from +12.8% to +4.1% on seed 0 but from +3.9% to +8.0% on seed 1; on the `tiny` preset
it was worse than local, +11.5% against +6.7%). Averaging the first moment alone was far worse
(+36.5% on seed 0), so it is not offered: the averaged first moment has lost the ranks'
separate noise while each rank's second moment still holds the noise of its 1/W-size batches,
so every step shrinks.

Because weights (between syncs) and, with local moments, moments differ between ranks, the
data-parallel stepper writes every rank's state into rank 0's checkpoint, so a resume with the
same world size continues exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from tierlm.config import NotSupportedYet
from tierlm.distributed.comm import Comm, all_reduce_send_bytes
from tierlm.distributed.sync import NoSync, Segments, segment_numel
from tierlm.runtime.state import read_copies, write_back_copies


@dataclass(frozen=True, kw_only=True)
class DelayedSync:
    """Local SGD: no gradient exchange; every `every` steps (and at `final_step`) the ranks'
    weights are averaged, and with `moments="average"` both AdamW moments too, in bf16 on the
    wire; "local" keeps them per rank (see the module docstring)."""

    every: int
    final_step: int | None = None
    moments: Literal["local", "average"] = "local"
    overlaps_backward: ClassVar[bool] = False  # the averaging waits for the step's updates

    def build(self, comm: Comm) -> Delayed:
        return Delayed(comm, self)

    def summary(self) -> str:
        return f"delayed, every {self.every} steps" + (
            ", moments averaged" if self.moments == "average" else "")

    def send_bytes(self, segments: Segments, world: int, slot_numels: Sequence[int] = ()) -> float:
        """Once every `every` steps: each segment's fp32 master all-reduced, and with
        moments="average" each optimizer state slot in bf16 (the extra average at
        `final_step` left out of the mean)."""
        sync = sum(all_reduce_send_bytes(4 * segment_numel(seg), world) for seg in segments)
        if self.moments == "average":
            sync += sum(all_reduce_send_bytes(2 * n, world) for n in slot_numels)
        return sync / self.every


class Delayed(NoSync):
    engine_state_per_rank = True

    def __init__(self, comm: Comm, cfg: DelayedSync) -> None:
        self.comm = comm
        self.cfg = cfg
        self.steps = 0

    def check_optimizer(self, optimizer) -> None:
        if self.cfg.moments != "average":
            return
        odd = [s.name for s in optimizer.slots if not s.average]
        if odd:
            raise NotSupportedYet(
                f"--opt {optimizer.name} with --sync-moments average",
                f"its state slot(s) {', '.join(odd)} cannot be averaged yet; use "
                "--sync-moments local",
            )

    def after_step(self, engine, skipped: bool) -> None:
        self.steps += 1
        # Every rank counts every step (skipped or not), so all of them average at once.
        if self.steps % self.cfg.every == 0 or self.steps == self.cfg.final_step:
            moments = () if self.cfg.moments == "local" else tuple(
                s.name for s in engine.optimizer.slots)
            average_weights(engine, self.comm, moments=moments)

    def local_state(self) -> dict[str, torch.Tensor]:
        return {"steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_local_state(self, state: Mapping[str, torch.Tensor]) -> None:
        if "steps" in state:
            self.steps = int(state["steps"])


def average_weights(engine, comm: Comm, moments: tuple[str, ...] = ()) -> None:
    """Replace every segment's master weights by their mean over ranks (in fp32), and each of
    the optimizer state slots `moments` (float slots) by its mean sent in bf16, wherever they
    live; re-encode
    the compute copies and mark device copies stale (the same write-back `Engine.load` does)."""
    engine.synchronize()  # the last step's updates must be in the masters
    for st in engine.states:
        bufs = read_copies(engine.store, st, ("master", *moments))
        master = bufs["master"]
        comm.all_reduce_sum(master)
        master.div_(comm.size)
        for name in moments:
            # bf16 keeps 8 significant bits, plenty for a moment (it scales or signs the step);
            # every rank reads the same sum, so the moments stay identical across ranks
            wire = bufs[name].to(torch.bfloat16)
            comm.all_reduce_sum(wire)
            bufs[name].copy_(wire).div_(comm.size)
        engine.compute_copies.refresh(engine.store, st, master)  # what streams is re-encoded
        write_back_copies(engine.store, st, bufs)
        if st.device_weights is not None and st.device_weights is not st.master:
            st.device_stale = True
    engine.cache.drop_all()
