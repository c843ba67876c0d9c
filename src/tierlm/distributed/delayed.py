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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tierlm.distributed.comm import Comm
from tierlm.distributed.sync import DelayedSync, NoSync
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.state import free_copies, read_copies


class Delayed(NoSync):
    engine_state_per_rank = True

    def __init__(self, comm: Comm, cfg: DelayedSync) -> None:
        self.comm = comm
        self.cfg = cfg
        self.steps = 0

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
