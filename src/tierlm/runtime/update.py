"""The engine's optimizer updates (part of tierlm.runtime.engine.Engine): a segment's update on
the tier that holds its state, a device one on the training thread, host and disk ones on the
update worker behind the next forward, a disk one chunk by chunk through host staging or in one
chunk with its write-back deferred (tierlm.runtime.writeback). Engine._finish_step decides,
once the global norm is read, whether and with what clipping coefficient they run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass

import torch

from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.optim.flat import advance, step_count
from tierlm.precision.streaming import ComputeFormat, slot_kinds
from tierlm.runtime.state import (
    CopiesRead,
    SegmentState,
    fetch_compute_copy,
    free_copies,
    read_copies,
    remote_copy_nbytes,
    stream_chunks,
    write_back_copies,
)
from tierlm.runtime.writeback import deferred_copies


@dataclass(kw_only=True)
class SpeculationCounts:
    """What became of one step's speculative disk-tier updates once its global norm was read
    (the step's record in metrics.jsonl: tierlm.monitor.probes.Speculation)."""

    speculated_segments: int = 0  # issued at their gradient's final landing
    speculation_kept: int = 0  # committed: the clipping coefficient was exactly 1
    speculation_redone: int = 0  # clipped (coefficient below 1): updated again, as without
    speculation_dropped: int = 0  # the step was skipped (a non-finite gradient)
    # disk bytes the redos move that a commit would not: each one's reads (master, slots, a
    # gradient file; less what a read-ahead holds) and writes (master, slots, compute copy)
    speculation_redo_disk_bytes: int = 0

    def fields(self) -> dict[str, int]:
        return asdict(self)


class Updates:
    """The Engine's updates, and the wait for one before its segment's weights are read."""

    def _wait_update(self, s: int) -> None:
        fut = self._updates.pop(s, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()  # re-raises a failed update here, in the training thread
            t1 = time.perf_counter()
            self.update_wait_s += t1 - t0
            self.tracer.record("wait", f"update {self.states[s].seg.name}", t0, t1,
                               cat="update wait")

    def _update(self, st: SegmentState, coef: torch.Tensor | None, lr: float, *,
                to: SegmentState | None = None, ahead: CopiesRead | None = None,
                grad: torch.Tensor | None = None) -> None:
        """Segment `st`'s update, its gradient scaled by `coef` (None: a speculative update,
        by nothing: the held gradient is left exactly as the redo needs it). `to`: a disk-tier
        segment's state whose files the update writes (a speculation's spare generation, which
        passes its read-ahead as `ahead`); default `st`'s, its read-ahead taken here. `grad`:
        a disk-tier segment's whole gradient in host staging, which the update takes instead
        of reading the file and frees (what its speculation's landing kept)."""
        if st.placement.remote:
            self._update_remote(st, coef, lr)
            return
        slots = [s.name for s in st.slots]

        # what the simulated device prices a CPU update at (a device one is a compute region)
        def cpu(params: float) -> contextlib.AbstractContextManager[None]:
            if st.tier == Tier.DEVICE:
                return contextlib.nullcontext()
            return self.dev.cpu_work(f"update {st.seg.name}", params=params)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            """The optimizer on elements [lo, lo + n) of the segment (all of it, off the disk
            tier)."""
            with cpu(bufs["grad"].numel() * self.optimizer.cpu_cost):
                if coef is not None:
                    bufs["grad"].mul_(coef)
                self.optimizer.update_range(st.layout, lo, bufs["master"], bufs["grad"],
                                            {c: bufs[c] for c in slots}, st.steps, lr)
            if st.tier == Tier.DISK and st.compute_format is not None:  # the whole master
                self.compute_copies.refresh(self.store, to or st, bufs["master"])

        lane = "device update" if st.tier == Tier.DEVICE else "cpu update"
        with self.tracer.span(lane, f"update {st.seg.name}", cat="update", tier=str(st.tier)):
            if st.tier == Tier.DISK:
                if to is None:
                    ahead = self._readahead.pop(st.index, None)
                self._update_disk(st, step, to or st, ahead, grad)
            else:
                step(0, {c: st.buffer(c) for c in (*st.state_copies, "grad")})
                self.compute_copies.refresh(self.store, st, st.master)  # quantised once a step
                st.grad.zero_()
            advance(st.steps)

    def _count_remote(self, st: SegmentState) -> None:
        """On the training thread, as the step submits a remote segment's update: its compute
        copy takes the kinds its layers compute in now (`_remote_format`), and the ledger
        counts the payloads the update will move, 4n on Link.NET_SEND and c on Link.NET_RECV,
        in the step whose gradient they carry (the update itself runs behind the next step's
        start, which resets the step's counters)."""
        self._remote_format(st)
        self.ledger.record_move(Link.NET_SEND, 4 * st.numel)
        self.ledger.record_move(Link.NET_RECV, remote_copy_nbytes(st))

    def _update_remote(self, st: SegmentState, coef: torch.Tensor, lr: float) -> None:
        """A remote segment's update (docs/architecture.md, the remote step): its landed
        gradient (`st.grad`, 4n bytes) goes to the memory node, the node runs the host tier's
        update on it scaled by `coef` (an fp32 value, as the host tier's), and the compute copy
        comes back into the host copy the stream uploads from (c bytes: its copy, or the fp32
        weights), in the kinds `_count_remote` gave it (the node re-encodes where they
        changed). A NodeError (the node died, stalled past --memory-node-timeout, refused) is
        raised here and re-raised by `_wait_update` in the training thread."""
        node, name, n = self.opts.node, st.seg.name, st.numel
        kinds = None if st.compute_format is None else st.compute_format.kinds
        with self.tracer.span("cpu update", f"update {name}", cat="update", tier="remote"):
            with self.dev.net(Link.NET_SEND, 4 * n, f"grad {name}"):
                node.push_grad(name, st.grad)
            with self.dev.node_work(f"update {name}", params=n * self.optimizer.cpu_cost):
                # the count this update brings the node's counters to, which the node checks
                node.step(name, lr=lr, coef=float(coef), step=int(step_count(st.steps[0])) + 1)
            with self.dev.net(Link.NET_RECV, remote_copy_nbytes(st), f"copy {name}"):
                fetch_compute_copy(node, st, kinds)
            st.grad.zero_()
            advance(st.steps)

    def _remote_format(self, st: SegmentState) -> None:
        """A remote segment's compute copy in the kinds its layers compute in now (the host
        tier's `ComputeCopies.refresh` rule: fp8 layers switched to bf16 change its format and
        its host copy's size). Nothing reads the host copy until the update has refilled it:
        the stream waits for the update (`_wait_update`)."""
        if st.compute_format is None:
            return
        kinds = slot_kinds(self.compute_copies.model, st.layout)
        if kinds == st.compute_format.kinds:
            return
        st.compute_format = ComputeFormat(st.layout, kinds)
        self.store.free(Tier.HOST, TensorClass.COMPUTE, st.wire)
        st.wire = self.store.alloc(Tier.HOST, TensorClass.COMPUTE, st.compute_format.nbytes,
                                   dtype=torch.uint8, pinned=True)

    def _update_disk(self, st: SegmentState, step: Callable[[int, dict], None],
                     to: SegmentState, ahead: CopiesRead | None,
                     grad: torch.Tensor | None = None) -> None:
        """A disk-tier update: the copies not already in host RAM (the read-ahead's master and
        slots, a gradient held on the host) are staged in chunks, the next chunk read while this
        one updates; the gradient is spent, only master and slots go back to their files
        (`to`'s: the current generation's, or a speculative update's spare one, which leaves
        the held gradient as it is for the redo). An update of one chunk (a compute copy's
        segment, or a small one) defers their write-back (`_update_whole`)."""
        self._writer.wait(st.index)  # the last step's write-back of its files has landed
        held = {} if ahead is None else dict(ahead.buffers())
        if st.grad is not None:
            held["grad"] = st.grad
        elif grad is not None:  # kept by the landing: spent here, as a staged file would be
            held["grad"] = grad
        ranges = self._update_ranges(st)
        if self.opts.writeback is not None and len(ranges) == 1:
            self._update_whole(st, step, held, to)
            return
        ends = {lo: lo + n for lo, n in ranges}

        def chunk(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            for c, buf in held.items():
                a, b = st.slot(c).range(st.layout, lo, ends[lo])
                bufs[c] = buf[a:b]
            step(lo, bufs)

        stream_chunks(self.store, st, ranges,
                      read=tuple(c for c in (*st.state_copies, "grad") if c not in held),
                      write=tuple(c for c in st.state_copies if c not in held), step=chunk,
                      written=to)
        if ahead is not None:
            write_back_copies(self.store, to, ahead.bufs)  # and frees the staging
        if grad is not None and st.grad is None:
            self.store.free(Tier.HOST, TensorClass.STAGING, grad)
        if st.grad is not None and to is st:  # a speculation's is zeroed at its commit
            st.grad.zero_()

    def _update_whole(self, st: SegmentState, step: Callable[[int, dict], None],
                      held: dict[str, torch.Tensor], to: SegmentState) -> None:
        """A disk-tier update in one chunk with its write-back deferred: the copies not in RAM
        are read whole, the optimizer runs (and writes the compute file), the fp32 master is
        written now where the forward reads it, and the rest goes to the writer, which frees
        the staging once written (tierlm.runtime.writeback)."""
        self._writer.make_room()
        missing = tuple(c for c in (*st.state_copies, "grad") if c not in held)
        bufs = {**read_copies(self.store, st, missing), **held}
        step(0, bufs)
        if st.grad is not None:  # held on the host: the next step accumulates into it
            if to is st:  # (a speculation's is zeroed at its commit)
                st.grad.zero_()
        elif "grad" in bufs:  # staged from its file (or kept by its landing): spent
            self.store.free(Tier.HOST, TensorClass.STAGING, bufs["grad"])
        later = deferred_copies(st.state_copies, st.compute_format is not None)
        write_back_copies(self.store, to, {c: bufs[c] for c in st.state_copies
                                           if c not in later})
        self._writer.submit(to, {c: bufs[c] for c in later})  # to the files it was given

    # -- speculative updates (EngineOptions.speculative_updates) ----

    def _speculates(self, st: SegmentState) -> bool:
        """Whether `st`'s update is issued at its gradient's final landing: disk-tier state
        that trains, with the option on."""
        return self.opts.speculative_updates and st.tier == Tier.DISK and not st.frozen

    @property
    def speculating(self) -> bool:
        """Whether any segment's update is speculative (the step records what became of it:
        `speculation`)."""
        return any(self._speculates(st) for st in self.trainable)

    def _speculate(self, st: SegmentState, landed: Future) -> None:
        """On the training thread, at `st`'s gradient's final landing of the step: its update,
        with the clipping coefficient taken as 1, goes to the update worker behind `landed`
        (the landing's future), writing the spare generation's files. The counters it advances
        are saved here (restored on a redo or skip), and its read-ahead, if issued by now, is
        handed to it here (one issued later stays for a redo, or is dropped at the commit)."""
        saved = [c.clone() for c in st.steps]
        to = st.spare()
        ahead = self._readahead.pop(st.index, None)
        fut = self._worker.submit(self._run_speculation, st, landed, to, ahead, self._lr)
        self._speculated[st.index] = (fut, to, saved)

    def _run_speculation(self, st: SegmentState, landed: Future, to: SegmentState,
                         ahead: CopiesRead | None, lr: float) -> None:
        # the gradient (held, or its file) is complete; the landing may have kept it whole
        self._update(st, None, lr, to=to, ahead=ahead, grad=landed.result())

    def _count_speculations(self, coef: float | None) -> None:
        """On the training thread, once the global norm is read and before any speculation is
        resolved: what becomes of this step's (`coef` None: the step is skipped)."""
        specs = [st for st in self.trainable if st.index in self._speculated]
        counts = SpeculationCounts(speculated_segments=len(specs))
        if coef is None:
            counts.speculation_dropped = len(specs)
        elif coef == 1.0:
            counts.speculation_kept = len(specs)
        else:
            counts.speculation_redone = len(specs)
            counts.speculation_redo_disk_bytes = sum(self._redo_disk_bytes(st) for st in specs)
        self.speculation = counts

    def _redo_disk_bytes(self, st: SegmentState) -> int:
        """Disk bytes `_update` moves for a redo of `st` (`_update_disk`): it reads the state
        copies and a gradient file the read-ahead does not hold, and writes the state copies
        and the compute copy."""
        ahead = self._readahead.get(st.index)
        held = () if ahead is None else ahead.bufs
        reads = (*st.state_copies, *(("grad",) if st.grad is None else ()))
        nbytes = sum(st.slot(c).nbytes(st.layout) for c in reads if c not in held)
        nbytes += sum(st.slot(c).nbytes(st.layout) for c in st.state_copies)
        if st.compute_format is not None:
            nbytes += st.compute_format.nbytes
        return nbytes

    def _resolve(self, s: int, coef: torch.Tensor | None, lr: float) -> None:
        """On the update worker, after segment `s`'s speculation, once the global norm is read:
        `coef` None: the step is skipped (the speculation is dropped, its counters restored,
        its held gradient zeroed); exactly 1: commit (its files become the spare generation's,
        its held gradient is spent); below 1: drop it and update from the current generation
        with `coef`, as without the option."""
        fut, to, saved = self._speculated.pop(s)
        fut.result()  # a failed speculation re-raises here, then in the training thread
        st = self.states[s]
        if coef is not None and float(coef) == 1.0:
            st.generation = to.generation
            st.compute_format = to.compute_format  # a layer's switch from fp8 to bf16
            if st.grad is not None:
                st.grad.zero_()
            stale = self._readahead.pop(s, None)  # read from the old generation: not needed
            if stale is not None:
                free_copies(self.store, st, stale.buffers())
            return
        for counter, value in zip(st.steps, saved, strict=True):
            counter.copy_(value)
        if coef is not None:
            self._update(st, coef, lr)
        elif st.grad is not None:
            st.grad.zero_()

    def _update_ranges(self, st: SegmentState) -> list[tuple[int, int]]:
        """Chunks in which a disk segment's state is rewritten: the whole segment where it has
        a compute copy (its fp8 scales come from whole tensors), else staging chunks cut where
        the optimizer's slots can be cut (whole segments for an optimizer with align 0)."""
        if st.compute_format is not None:
            return [(0, st.numel)]
        return self.optimizer.chunk_ranges(st.layout, self.chunk_numel)
