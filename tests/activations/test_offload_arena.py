"""The offload policy's host buffers are pinned memory as counted (issue R, item 4): cut from the
run's pinned arena (tierlm.memory.arena), counted by the ledger as pinned host activations, and
in the arena's size as the plan's replay counts them (tierlm.runtime.pinned, with the sizes the
plan measured: tierlm.runtime.pinned.offload_sizes)."""

import copy

import pytest
import torch

from tests.runtime_helpers import (
    OPTIM,
    batches,
    bf16_autocast,
    bf16_model,
    new_engine,
    tiny_model,
)
from tierlm.activations.offload import Copier
from tierlm.config import ActivationConfig
from tierlm.memory.arena import footprint_bytes
from tierlm.memory.disk import ALIGN_BYTES
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import TensorClass, Tier
from tierlm.runtime.shapes import ModelShape

B, T = 2, 16
CHUNK = 1024  # elements: every segment of the tiny model is several staging chunks
ACT = TensorClass.ACTIVATION
PLACEMENTS = {
    "device": SegmentPlacement(True, Tier.DEVICE),
    "host": SegmentPlacement(False, Tier.HOST),
    "disk": SegmentPlacement(False, Tier.DISK),
    "tiered": SegmentPlacement(False, Tier.DISK, Tier.HOST),  # disk state, host gradients
}


def _engine(model, tmp_path, spec, order, m, acts, **kw):
    n = len(ModelShape.from_config(copy.deepcopy(model.config)).names)
    return new_engine(model, tmp_path, policy="auto", placements=[PLACEMENTS[spec]] * n,
                      microbatch_order=order, micro_batches=m, staging_chunk_numel=CHUNK,
                      keep_resident_activations=False, activations=acts, **kw)


class _Spy:
    """What the offload copied out to and the store's pinned buffers, held and at their most."""

    def __init__(self, eng, monkeypatch) -> None:
        self.arena = eng.store.arena
        self.hosts: list[tuple[int, bool]] = []  # (bytes, cut from the arena) per offload copy
        self.live = self.most = 0  # pinned buffers held now, at once at most
        self.off_live = self.off_most = 0  # pinned footprints of offloaded activations
        to_host = Copier.to_host

        def spy_to_host(copier, dst, src):
            self.hosts.append((dst.numel(), self.arena.owns(dst)))
            return to_host(copier, dst, src)

        monkeypatch.setattr(Copier, "to_host", spy_to_host)
        store = eng.store
        alloc, free = store.alloc, store.free

        def spy_alloc(tier, cls, numel, dtype=torch.float32, *, pinned=False):
            t = alloc(tier, cls, numel, dtype, pinned=pinned)
            if pinned:
                self.live += 1
                self.most = max(self.most, self.live)
                if cls == ACT and dtype == torch.uint8:  # an offload buffer (parked: fp32)
                    self.off_live += footprint_bytes(t.numel())
                    self.off_most = max(self.off_most, self.off_live)
            return t

        def spy_free(tier, cls, t):
            if self.arena.owns(t):
                self.live -= 1
                if cls == ACT and t.dtype == torch.uint8:
                    self.off_live -= footprint_bytes(t.numel())
            free(tier, cls, t)

        store.alloc, store.free = spy_alloc, spy_free


@pytest.mark.parametrize("order", ["microbatch-outer", "layer-outer"])
@pytest.mark.parametrize("spec", ["device", "host", "disk", "tiered"])
@pytest.mark.parametrize("acts", [
    ActivationConfig(policy="offload"),
    # one block offloads, the other recomputes (a per-segment override)
    ActivationConfig(policy="full", overrides="block.1=offload"),
], ids=["offload", "override"])
def test_offloaded_activations_are_cut_from_the_arena_the_plan_sized(spec, order, acts,
                                                                     tmp_path, monkeypatch):
    """Every host buffer the offload copies into is the arena's; the ledger counts them as
    pinned activations; the arena the plan sized before the step holds the ledger's pinned
    peak within one 4 KiB unit per buffer held at that peak, and a second step fits it."""
    _check_offload_arena(tiny_model("llama_untied", layers=2), spec, order, acts, tmp_path,
                         monkeypatch)


@pytest.mark.parametrize("spec", ["host", "tiered"])
def test_bf16_streamed_segments_offload_what_their_compute_copy_saves(spec, tmp_path,
                                                                     monkeypatch):
    """bf16: a streamed segment computes from its bf16 compute copy, whose weights the graph
    saves as views (no autocast casts): the plan's probe runs the same format, so the arena
    is exact from the first step."""
    _check_offload_arena(bf16_model(tiny_model("llama_untied", layers=2)), spec,
                         "microbatch-outer", ActivationConfig(policy="offload"), tmp_path,
                         monkeypatch, autocast=bf16_autocast)


def _check_offload_arena(model, spec, order, acts, tmp_path, monkeypatch, **kw):
    m = 2
    eng = _engine(model, tmp_path, spec, order, m, acts, **kw)
    spy = _Spy(eng, monkeypatch)
    spy.live = len(eng.states) if spec == "host" else 0  # the masters, pinned at init
    arena, led = eng.store.arena, eng.ledger
    planned = arena.capacity_bytes
    assert planned == eng.report.pinned.total_bytes  # the plan's count, which preflight saw
    eng.step(batches(1, m)[0], OPTIM.lr)
    eng.synchronize()
    offloaded_blocks = 2 if acts.policy == "offload" else 1
    assert spy.hosts and all(owned for _, owned in spy.hosts)  # no buffer of its own
    assert len(spy.hosts) % (offloaded_blocks * m) == 0
    # the ledger's pinned activations are the offload buffers (boundaries stay on the device)
    assert led.pinned_class_peak_bytes[ACT] == spy.off_most > 0
    in_flight = m if order == "layer-outer" else 1
    one_mb = sum(footprint_bytes(n) for n, _ in spy.hosts) // m
    assert spy.off_most == in_flight * one_mb
    peak = led.pinned_peak_bytes
    assert arena.peak_bytes == peak
    assert 0 <= arena.capacity_bytes - peak <= ALIGN_BYTES * spy.most
    assert arena.capacity_bytes == planned  # sized before the step, not grown by it
    eng.step(batches(2, m)[1], OPTIM.lr)  # the ranges come back and are cut again
    eng.synchronize()
    assert arena.capacity_bytes == planned and led.step_pinned_peak_bytes == peak
    assert led.pinned_class_bytes[ACT] == 0  # all given back after the backward
    eng.close()


def test_a_segment_switched_to_offload_is_learned_and_the_arena_grows_between_steps(
        tmp_path, monkeypatch):
    """A segment the plan did not probe (switched to offload later) takes pageable buffers in
    its first step, counted on the host but not pinned; the next step's arena is grown to the
    sizes that step took, and its buffers are the arena's, within the same bound."""
    model = tiny_model("llama_untied", layers=2)
    m = 2
    eng = _engine(model, tmp_path, "disk", "microbatch-outer", m,
                  ActivationConfig(policy="full"))
    eng.set_activation_policies(["full", "full", "offload"])
    spy = _Spy(eng, monkeypatch)
    arena, led = eng.store.arena, eng.ledger
    planned = arena.capacity_bytes
    eng.step(batches(1, m)[0], OPTIM.lr)
    eng.synchronize()
    assert spy.hosts and not any(owned for _, owned in spy.hosts)
    assert led.pinned_class_peak_bytes.get(ACT, 0) == 0
    assert led.peak_class_bytes[(Tier.HOST, ACT)] > 0  # counted on the host all the same
    assert arena.capacity_bytes == planned
    spy.hosts.clear()
    eng.step(batches(2, m)[1], OPTIM.lr)
    eng.synchronize()
    assert spy.hosts and all(owned for _, owned in spy.hosts)
    assert arena.capacity_bytes > planned
    assert arena.capacity_bytes == eng.pinned_bytes(m, B, T).total_bytes
    assert led.pinned_class_peak_bytes[ACT] == sum(footprint_bytes(n) for n, _ in
                                                         spy.hosts) // m
    assert 0 <= arena.capacity_bytes - led.step_pinned_peak_bytes <= ALIGN_BYTES * spy.most
    eng.close()
