"""The engine's schedule (part of tierlm.runtime.engine.Engine): tierlm.runtime.schedule's
pure rules, which the planner's replay calls too, applied to this engine's segments: the
actions of a step, the streamed segments each reads, the read-ahead, the pinned bytes and the
landing ring a step holds, and the walk's rules."""

from __future__ import annotations

from tierlm.memory.arena import PinnedBytes
from tierlm.memory.tiers import Tier
from tierlm.runtime.readahead import readahead_starts
from tierlm.runtime.schedule import (
    Action,
    boundary_activation_bytes,
    landing_ring_numel,
    step_schedule,
    streamed_reads,
    transient_grad,
)
from tierlm.runtime.walk import StepRules


class EngineSchedule:
    """The Engine's answers to what its step's schedule and walk ask."""

    boundary_activation_bytes = staticmethod(boundary_activation_bytes)

    def schedule(self, m: int) -> list[Action]:
        """The actions of an m-micro-batch step, in order."""
        return step_schedule(len(self.states), m, self.opts.microbatch_order,
                             first_trained=self.trained[0] is not None)

    def stream_plan(self, m: int) -> list[list[int]]:
        """Streamed segments each action of an m-micro-batch step reads, in order: the access
        sequence the stream cache is given (monitoring replays it to know the planned fetches)."""
        return [self._needs(a) for a in self.schedule(m)]

    def _needs(self, a: Action) -> list[int]:
        """Streamed segments whose device copy action `a` reads (the head also reads tied
        weights)."""
        return streamed_reads(a, [st.placement.resident for st in self.states],
                              [owner for owner, _, _ in self.borrowed.values()])

    def readahead_plan(self, actions: list[Action]) -> dict[int, list[int]]:
        """Action index -> disk-tier segments whose update state is read after that action
        (tierlm.runtime.readahead; empty when the read-ahead is off)."""
        ra = self.opts.readahead
        if ra is None:
            return {}
        sizes = [(st.index, sum(st.slot(c).nbytes(st.layout) for c in st.state_copies))
                 for st in self.trainable if st.tier == Tier.DISK]
        return readahead_starts(
            actions, sizes, ra.extra_bytes,
            parked_input_bytes=self.hidden_bytes if self.host_boundaries else 0,
            speculative=self.opts.speculative_updates)

    def pinned_bytes(self, m: int, batch_size: int, seq_len: int) -> PinnedBytes:
        """Pinned host bytes (arena footprints) a step of `m` micro-batches of `batch_size` x
        `seq_len` tokens holds: the persistent ones and the step's peak
        (tierlm.runtime.pinned, the planner's replay on this engine's parts)."""
        key = (m, batch_size, seq_len)
        if key not in self._pinned_need:
            self._pinned_need[key] = self._pinned_rule(
                micro_batches=m, batch_size=batch_size, seq_len=seq_len,
                parked=self.parked_inputs, offloaded=self.offloaded_sizes(batch_size, seq_len))
        return self._pinned_need[key]

    def offloaded_sizes(self, batch_size: int, seq_len: int) -> list[tuple[int, ...]]:
        """Per segment but the head, the host buffers (bytes, in order) its `offload` run takes
        from the pinned arena per micro-batch of `batch_size` x `seq_len` tokens, as far as
        known (the plan's probe, or a step of that shape); () for the others."""
        known = self._offload_sizes.get((batch_size, seq_len), {})
        return [known.get(s, ()) if name == "offload" else ()
                for s, name in enumerate(self.activation_policies)]

    def _learn_offload_sizes(self, batch_size: int, seq_len: int) -> None:
        """Between steps: what the last step's offloaded segments took becomes the sizes their
        arena ranges are counted with (a segment the probe did not run, a row shape it did not
        see: their buffers were pageable in that step), so the step region grows before this
        step where they need more (`reserve_transient`); then the pool expects this step's."""
        pool = self._make_policy.pool
        if self._offload_shape is not None and pool.observed:
            known = self._offload_sizes.setdefault(self._offload_shape, {})
            learned = {self.index[name]: sizes for name, sizes in pool.observed.items()
                       if sizes}
            if any(known.get(s, ()) != sizes for s, sizes in learned.items()):
                known.update(learned)
                self._pinned_need = {k: v for k, v in self._pinned_need.items()
                                     if k[1:] != self._offload_shape}
        pool.observed.clear()
        self._offload_shape = (batch_size, seq_len)
        names = [st.seg.name for st in self.states]
        pool.expected = {names[s]: sizes for s, sizes in
                         enumerate(self.offloaded_sizes(batch_size, seq_len)) if sizes}

    def landing_ring_numel(self, actions: list[Action], m: int) -> int:
        """Elements of the landing ring a step of `actions` over `m` micro-batches holds
        (tierlm.runtime.schedule.landing_ring_numel, the rule the planner's replay counts)."""
        landings = [None if st is None or not transient_grad(st.tier, st.frozen)
                    else (st.tier, st.placement.gradient_tier, st.numel) for st in self.trained]
        return landing_ring_numel(actions, m, landings, self.chunk_numel)

    def step_rules(self, m: int) -> StepRules:
        """This engine's answers to what an m-micro-batch step's walk asks
        (tierlm.runtime.walk)."""
        return StepRules(
            micro_batches=m, parked=self.parked_inputs,
            tied_owners=[owner for owner, _, _ in self.borrowed.values()],
            tied_trained=self.tied_trained, state_tiers=[st.tier for st in self.states],
            first_trained=self.trained[0] is not None,
        )
