"""Where the engine's gradients go (part of tierlm.runtime.engine.Engine): the buffer autograd
accumulates a segment's gradient into, and its landing on the optimizer's tier, host RAM through
the step's landing ring (tierlm.runtime.landing) on the landing worker, or the disk tier's file in
chunk passes (tierlm.runtime.schedule.grad_landing), and the sync each complete gradient starts
(tierlm.runtime.grad_sync). The planner's replay lands them the same way, over byte counts
(tierlm.plan.replay)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tierlm.memory.placement import chunk_ranges
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.landing import LandingRing, add_to_host
from tierlm.runtime.schedule import (
    grad_landing,
    held_before,
    keeps_landed_grad,
    transient_grad,
)
from tierlm.runtime.state import SegmentState, stream_chunks


class Gradients:
    """The Engine's gradient landing and the syncs it starts."""

    def _grad_target(self, s: int) -> torch.Tensor:
        """Where autograd accumulates segment `s`'s gradient: the persistent gradient buffer
        for device state, a transient device buffer otherwise (an empty one where nothing of
        the segment is trained)."""
        st = self.trained[s]
        if st is None:
            return self._no_params
        if not transient_grad(st.tier, st.frozen):
            return st.grad
        return self.store.zeros(Tier.DEVICE, TensorClass.GRAD, st.numel)

    def _land_grad(self, st: SegmentState, grad: torch.Tensor, ring: LandingRing, *,
                   final: bool) -> None:
        """Send this action's gradient towards the optimizer's tier, adding it into host RAM
        through the step's `ring`; on the step's last contribution, record the segment's norm."""
        path = grad_landing(st.tier, st.placement.gradient_tier, written=st.grad_written,
                            final=final)
        if not transient_grad(st.tier, st.frozen):  # accumulated in place on the device
            if final:
                self._grad_complete(st, grad)
            return
        what = f"grad {st.seg.name}"
        if path.to_host:  # host state, or disk state's held gradient
            # On the landing worker, so the training thread goes on issuing the backward: the
            # copies wait for the gradient (an event now), the adds for their copies; the sync
            # and the norm read the host sum once `_drain_landings` has seen it done. One
            # landing at a time is in flight: the one before is waited for here, after this
            # action's compute was issued, so it ran under it; its gradient leaves the device
            # ledger now (the planner's replay holds it as long: `_CountingStep.land`). The
            # ring is taken here, on this thread, in the order the replay takes it.
            self._drain_landings()
            ring.hold()
            done = self.dev.mark()
            self._landing = (self._lander.submit(self._add_landing, ring, st.grad, grad, done,
                                                 what), grad, st if final else None)
            if final and self._speculates(st):  # its update, behind this landing
                self._speculate(st, self._landing[0])
            return
        self._drain_landings()  # the file path below adds through the ring too
        # Disk: chunk by chunk through host staging. The gradient file holds the sum of this
        # step's earlier contributions (grad_written); the step's last contribution completes
        # the sum in the device buffer, where the sync and the norms read it whole, before the
        # pass that writes it out. The ring is taken before the passes' chunk sets, as the
        # replay takes it: the pinned arena then holds it below them, not in a hole they leave.
        if path.ring_numel(st.numel, self.chunk_numel):
            ring.hold()
        passes = list(path.passes)
        while passes and passes[0].back:  # the sum back on the device: compute reads it next
            p = passes.pop(0)
            self._grad_file_chunks(st, grad, ring, add=p.add, back=p.back)
        if final:
            self._grad_complete(st, grad)
            self._finish_syncs()  # the device buffer is written out and freed next
        st.grad_written = path.written
        # A speculated update takes the complete gradient from host RAM as its last pass
        # carries it to the file (read back, it took the disk during the backward); the
        # buffer is taken once the speculation `held_gradients` before has freed its own.
        keep = keeps_landed_grad(path, final=final, speculated=self._speculates(st))
        held = self.opts.held_gradients
        after = held_before(self._kept, held) if keep else None
        # the passes into the file, on the landing worker (the backward goes on meanwhile)
        self._landing = (self._lander.submit(self._file_passes, st, grad, ring, passes, keep,
                                             after), grad, None)
        if final and self._speculates(st):  # its update, behind the file's last pass
            self._speculate(st, self._landing[0])
            if keep:
                self._kept = [*self._kept, self._speculated[st.index][0]][-held:]

    def _file_passes(self, st: SegmentState, grad: torch.Tensor, ring: LandingRing,
                     passes: list, keep: bool = False, after: Future | None = None
                     ) -> torch.Tensor | None:
        """The passes into the gradient file, on the landing worker; `keep`: the pass that
        writes the file also copies the gradient into a whole host staging buffer, taken once
        `after` (an earlier speculation holding one) has finished, and returned (None
        otherwise) for the speculation behind this landing, which frees it."""
        kept = None
        if keep:
            if after is not None:
                after.result()
            slot = st.slot("grad")  # as `read_copies` would stage the file
            kept = self.store.alloc(Tier.HOST, TensorClass.STAGING, slot.numel(st.layout),
                                    slot.dtype)
        for p in passes:
            self._grad_file_chunks(st, grad, ring, add=p.add, back=p.back,
                                   keep=None if p.back else kept)
        return kept

    def _add_landing(self, ring: LandingRing, host: torch.Tensor, grad: torch.Tensor,
                     done: object, what: str) -> None:
        """`host += grad` through the ring, on the landing worker."""
        add_to_host(self.store, ring, host, grad, self.chunk_numel, what, after=[done])

    def _drain_landings(self) -> None:
        """The landing in flight has added its gradient into host RAM (a failed one raises
        here): its device gradient is freed, and its segment, if that was its step's last
        contribution, is complete."""
        if self._landing is None:
            return
        (fut, grad, st), self._landing = self._landing, None
        fut.result()
        self.store.free(Tier.DEVICE, TensorClass.GRAD, grad)
        if st is not None:
            self._grad_complete(st, st.grad)

    def _grad_file_chunks(
        self, st: SegmentState, grad: torch.Tensor, ring: LandingRing, *, add: bool, back: bool,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Between the device gradient and its file, chunk by chunk: `add`: file + device
        (the order the earlier contributions were summed in), else the device's alone; `back`:
        the sum returns to the device buffer instead of the file; `keep`: a whole host buffer
        each chunk written to the file is also copied into (on the CPU, from the pinned chunk
        the device's copy landed in)."""
        what = f"grad {st.seg.name}"

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            staging, dev = bufs["grad"], grad.narrow(0, lo, bufs["grad"].numel())
            if add:
                add_to_host(self.store, ring, staging, dev, self.chunk_numel, what)
            else:  # the file write reads the staging buffer next
                self.store.wait_host(self.store.to_host(staging, dev, what))
            if keep is not None:
                n = staging.numel()  # one memcpy of the chunk
                with self.store.dev.cpu_work(f"keep {what}",
                                             moved_bytes=n * staging.element_size()):
                    keep.narrow(0, lo, n).copy_(staging)
            if back:
                copied = self.store.to_device(dev, staging, what)
                self.store.wait(copied)  # compute reads the sum
                self.store.wait_host(copied)  # before the staging buffer takes a later chunk

        stream_chunks(self.store, st, chunk_ranges(st.numel, self.chunk_numel),
                      read=("grad",) if add else (), write=() if back else ("grad",), step=step,
                      pinned=True)

    def _grad_complete(self, st: SegmentState, grad: torch.Tensor) -> None:
        """The segment's gradient for this step is all in: start its sync across ranks (a no-op
        in one process); `_finish_syncs` waits for it and takes the norms."""
        self._syncing.append((st, grad, self.opts.grad_sync.start(st.seg.name, grad,
                                                                   st.layout.slots)))
