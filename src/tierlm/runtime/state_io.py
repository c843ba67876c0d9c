"""The engine's state out and in (part of tierlm.runtime.engine.Engine): weights and optimizer
state by parameter name, keyed as the reference trainer's, whole or one segment at a time for
checkpoints, and restored from either runtime's checkpoint (a disk-tier segment's files
rewritten chunk by chunk)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from tierlm.memory.tiers import TensorClass, Tier
from tierlm.optim.flat import step_count
from tierlm.runtime.state import (
    DiskTensor,
    LookupOnce,
    RemoteTensor,
    SegmentState,
    fetch_compute_copy,
    free_copies,
    read_copies,
    stream_chunks,
    write_back_copies,
)


class StateIO:
    """The Engine's weights and optimizer state, read out and restored."""

    def weights(self) -> dict[str, torch.Tensor]:
        """Current fp32 weights by the model's parameter names (CPU copies): the trained ones
        (a LoRA run's adapters; its frozen base: `frozen_weights`)."""
        return self._named(("master",))

    def frozen_weights(self) -> dict[str, torch.Tensor]:
        """The frozen base's weights by parameter name (CPU copies; empty when all is trained;
        an NF4 base's decoded)."""
        if not self.frozen_base:
            return {}
        out = self._named(("master",), [st for st in self.states if st.compute_format is None])
        for st in self.states:
            if st.compute_format is not None:
                out.update(self.compute_copies.weights(self.store, st))
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state by parameter name (`<name>.<slot>` in the slot's checkpoint shape,
        and `<name>.step`), the keys the reference trainer writes for the same optimizer, so
        either runtime resumes the other's checkpoint."""
        return self._named(tuple(s.name for s in self.optimizer.slots))

    def _named(self, copies: tuple[str, ...], states: list[SegmentState] | None = None
               ) -> dict[str, torch.Tensor]:
        self.synchronize()
        out = {}
        for st in self.trainable if states is None else states:
            bufs = self._read_state(st, copies)
            for copy in copies:
                for name, view in _parts(st, copy, bufs[copy]).items():
                    key = name if copy == "master" else f"{name}.{copy}"
                    out[key] = view.detach().to("cpu", copy=True)
            self._free_state(st, bufs)
            if copies != ("master",):
                out.update({k: v.detach().to("cpu", copy=True)
                            for k, v in self._step_counters(st).items()})
        return out

    def load(self, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> None:
        """Restore weights and optimizer state written by `weights`/`optimizer_state` (or by
        the reference trainer)."""
        self.synchronize()
        for st in self.trainable:
            if st.tier == Tier.DISK:
                self._load_disk(st, weights, optim)
                continue
            if st.placement.remote:
                self._load_remote(st, weights, optim)
                continue
            bufs = read_copies(self.store, st, st.state_copies)
            st.layout.pack(weights, bufs["master"])
            self.compute_copies.refresh(self.store, st, bufs["master"])
            if optim:
                for slot in st.slots:
                    slot.pack(st.layout, _Suffixed(optim, f".{slot.name}"), bufs[slot.name])
                self._restore_counters(st, optim)
            write_back_copies(self.store, st, bufs)
            if st.device_weights is not None and st.device_weights is not st.master:
                st.device_stale = True
        self.cache.drop_all()

    def _load_disk(
        self, st: SegmentState, weights: Mapping[str, torch.Tensor],
        optim: Mapping[str, torch.Tensor],
    ) -> None:
        """`load` for a disk-tier segment: its files are rewritten chunk by chunk from the
        (lazy) mappings, each tensor looked up once; a segment with a compute copy is one chunk
        (its fp8 scales need whole tensors). Without optimizer state the slots are kept."""
        sources = {"master": LookupOnce(weights)}
        if optim:
            for slot in st.slots:
                sources[slot.name] = LookupOnce(_Suffixed(optim, f".{slot.name}"))
        kept = () if optim else tuple(s.name for s in st.slots)

        def step(lo: int, bufs: dict[str, torch.Tensor]) -> None:
            st.layout.pack(sources["master"], bufs["master"], lo)
            for slot in st.slots if optim else ():
                a, _ = slot.range(st.layout, lo, lo + bufs["master"].numel())
                slot.pack(st.layout, sources[slot.name], bufs[slot.name], a)
            if st.compute_format is not None:
                self.compute_copies.refresh(self.store, st, bufs["master"])

        stream_chunks(self.store, st, self._update_ranges(st), read=kept,
                      write=st.state_copies, step=step)
        if optim:
            self._restore_counters(st, optim)
        if st.device_weights is not None:
            st.device_stale = True

    def _load_remote(self, st: SegmentState, weights: Mapping[str, torch.Tensor],
                     optim: Mapping[str, torch.Tensor]) -> None:
        """`load` for a remote segment: master (and, with optimizer state, the slots and step
        counts) packed in host staging and pushed to the memory node (`put_state`), then its
        compute copy fetched into the host copy. Without optimizer state the node's slots are
        kept. A fp32 segment's host copy is its master, packed in place and pushed from there."""
        node, name = self.opts.node, st.seg.name
        fp32 = st.compute_format is None
        master = st.master if fp32 else self.store.alloc(Tier.HOST, TensorClass.STAGING,
                                                         st.numel)
        bufs = {"master": master}
        bufs.update({s.name: self.store.alloc(Tier.HOST, TensorClass.STAGING,
                                              s.numel(st.layout), s.dtype)
                     for s in (st.slots if optim else ())})
        try:
            st.layout.pack(weights, master)
            steps = None
            if optim:
                for slot in st.slots:
                    slot.pack(st.layout, _Suffixed(optim, f".{slot.name}"), bufs[slot.name])
                self._restore_counters(st, optim)
                steps = [step_count(c) for c in st.steps]
            node.put_state(name, bufs, steps=steps)
        finally:
            self._free_state(st, {c: b for c, b in bufs.items() if b is not st.master})
        if not fp32:
            self._remote_format(st)
            fetch_compute_copy(node, st, st.compute_format.kinds)
        if st.device_weights is not None:
            st.device_stale = True

    def _read_state(self, st: SegmentState, copies: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """`read_copies` of any segment: a remote one's copies come from the memory node
        (`get_state`) into host staging, its step counts checked against the trainer's."""
        if not st.placement.remote:
            return read_copies(self.store, st, copies)
        bufs = {c: self.store.alloc(Tier.HOST, TensorClass.STAGING, st.slot(c).numel(st.layout),
                                    st.slot(c).dtype) for c in copies}
        try:
            _, counts = self.opts.node.get_state(st.seg.name, copies, out=bufs)
            self._check_remote_counts(st, counts)
        except BaseException:
            self._free_state(st, bufs)
            raise
        return bufs

    def _check_remote_counts(self, st: SegmentState, counts: list[float] | None = None) -> None:
        """The node has counted the trainer's optimizer steps for remote segment `st` (asked
        for with an empty range where `counts` is not given)."""
        if counts is None:
            _, counts = self.opts.node.get_state(st.seg.name, ["master"], lo=0, count=0)
        mine = [step_count(c) for c in st.steps]
        if counts != mine:
            raise RuntimeError(f"memory node {self.opts.node.address}: segment {st.seg.name} "
                               f"has counted {counts} optimizer steps, the trainer {mine}")

    def _free_state(self, st: SegmentState, bufs: dict[str, torch.Tensor]) -> None:
        if st.placement.remote:
            for b in bufs.values():
                self.store.free(Tier.HOST, TensorClass.STAGING, b)
        else:
            free_copies(self.store, st, bufs)

    def state_shards(
        self,
    ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
        """(segment name, weights, optimizer state) one segment at a time, keyed like `weights`
        and `optimizer_state`, so a checkpoint never holds the whole model in RAM. The tensors
        are views of the state or of staging buffers, valid until the next shard is asked for."""
        self.synchronize()
        for st in self.trainable:
            slots = tuple(s.name for s in st.slots)
            if st.tier == Tier.DISK:  # read parameter by parameter as the writer asks
                weights = DiskTensor.of(self.store, st, "master")
                optim = {f"{name}.{c}": t for c in slots
                         for name, t in DiskTensor.of(self.store, st, c).items()}
                yield st.seg.name, weights, {**optim, **self._step_counters(st)}
                continue
            if st.placement.remote:  # fetched from the node parameter by parameter, likewise
                self._check_remote_counts(st)
                node = self.opts.node
                weights = RemoteTensor.of(self.store, st, "master", node)
                optim = {f"{name}.{c}": t for c in slots
                         for name, t in RemoteTensor.of(self.store, st, c, node).items()}
                yield st.seg.name, weights, {**optim, **self._step_counters(st)}
                continue
            bufs = self._read_state(st, st.state_copies)
            try:
                optim = {f"{name}.{c}": view for c in slots
                         for name, view in _parts(st, c, bufs[c]).items()}
                optim.update(self._step_counters(st))
                yield st.seg.name, st.layout.views(bufs["master"]), optim
            finally:
                self._free_state(st, bufs)

    @staticmethod
    def _restore_counters(st: SegmentState, optim: Mapping[str, torch.Tensor]) -> None:
        """Each optimizer group's step counter from a checkpoint (keyed per parameter)."""
        for (_, _, decay), counter in zip(st.layout.groups(), st.steps, strict=True):
            first = next(s.name for s in st.layout.slots if s.decay == decay)
            counter.copy_(optim[f"{first}.step"])

    @staticmethod
    def _step_counters(st: SegmentState) -> dict[str, torch.Tensor]:
        """Each parameter's optimizer step counter (one per optimizer group)."""
        out = {}
        for (_, _, decay), step in zip(st.layout.groups(), st.steps, strict=True):
            for slot in st.layout.slots:
                if slot.decay == decay:
                    out[f"{slot.name}.step"] = step
        return out


def _parts(st: SegmentState, copy: str, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameter name -> its part of a flat copy in checkpoint shape (parameters owning none of
    a slot, e.g. a vector's factored statistics, left out, as the reference has no key)."""
    if copy == "master":
        return st.layout.views(buf)
    slot = st.slot(copy)
    return {p.name: v for p, v in zip(st.layout.slots, slot.views(st.layout, buf).values(),
                                      strict=True) if slot.param_numel(p)}


class _Suffixed(Mapping[str, torch.Tensor]):
    """`source[name + suffix]` as `view[name]`, looked up only when asked (a checkpoint's
    optimizer state is a lazy mapping keyed `<parameter>.<slot>`)."""

    def __init__(self, source: Mapping[str, torch.Tensor], suffix: str) -> None:
        self.source, self.suffix = source, suffix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.source[name + self.suffix]

    def __iter__(self) -> Iterator[str]:
        n = len(self.suffix)
        return (k[:-n] for k in self.source if k.endswith(self.suffix))

    def __len__(self) -> int:
        return sum(1 for _ in self)
