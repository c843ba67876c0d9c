"""The step's walk (tierlm.runtime.walk) is one: the engine and the planner's replay make the
same calls on their backends, in the same order."""

import copy

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.memory.placement import SegmentPlacement
from tierlm.memory.tiers import Tier
from tierlm.runtime import Action, EngineOptions, build_engine, walk
from tierlm.runtime.byte_replay import _simulate
from tierlm.runtime.shapes import ModelShape, TrainShape

CPU = torch.device("cpu")


class _Logged:
    """A backend that logs each call (its segment, micro-batch, action and flag arguments; not
    its tensors or byte counts) and passes it on."""

    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, verb: str):
        call = getattr(self.inner, verb)

        def logged(*args, **kwargs):
            if verb in ("hold", "drop"):  # the last argument: a boundary's segment, or None
                self.log.append((verb, args[-1]))
            else:
                self.log.append((verb, *(a for a in (*args, *kwargs.values())
                                         if type(a) in (int, bool) or isinstance(a, Action))))
            return call(*args, **kwargs)

        return logged


def _logging_walks(monkeypatch) -> list[list]:
    walks: list[list] = []
    init = walk._Walk.__init__

    def logging_init(self, backend, rules):
        walks.append([])
        init(self, _Logged(backend, walks[-1]), rules)

    monkeypatch.setattr(walk._Walk, "__init__", logging_init)
    return walks


# (micro-batch order, state tier of the embedding (the tied weights' owner), boundary tier)
CASES = [("layer-outer", Tier.DISK, Tier.HOST), ("microbatch-outer", Tier.DEVICE, Tier.DEVICE)]


@pytest.mark.parametrize("order,owner_tier,boundary", CASES)
def test_engine_and_replay_walk_alike(order, owner_tier, boundary, tmp_path, monkeypatch):
    """Tied weights (the head's buffer adopted by an off-device owner, or added into a device
    one), parked boundary inputs, streamed and resident segments: the walks' calls agree."""
    model = tiny_model("llama_tied_gqa", layers=2)
    shape = ModelShape.from_config(copy.deepcopy(model.config))
    n, m = len(shape.names), 2
    placements = ([SegmentPlacement(False, owner_tier)]
                  + [SegmentPlacement(False, Tier.HOST)] * (n - 2)
                  + [SegmentPlacement(True, Tier.HOST)])
    walks = _logging_walks(monkeypatch)
    eng = build_engine(model, OPTIM, EngineOptions(
        policy="auto", placements=placements, microbatch_order=order,
        keep_resident_activations=False, offload_dir=str(tmp_path), batch_size=2, seq_len=16,
        micro_batches=m, boundary_tier=boundary), device=CPU)
    try:
        eng.step(batches(1, m)[0], OPTIM.lr)
    finally:
        eng.close()
    _simulate(shape, TrainShape(2, 16, m, "fp32"), placements, order, False,
              boundary == Tier.HOST)
    # the first walk is plan_step's: the replay that sizes the engine's pinned arena
    # (tierlm.runtime.pinned); then the engine's step and this replay
    _, engine_calls, replay_calls = walks
    assert engine_calls == replay_calls
    verbs = {c[0] for c in engine_calls}
    assert {"tied_grad", "land", "prefetch"} <= verbs
    assert ("park" in verbs) == (boundary == Tier.HOST)
    # off the device the owner adopts its first micro-batch's buffer from the head and adds
    # the next ones' into it; on the device it adds every one into its persistent gradient
    adds = sum(c == ("add_grad",) for c in engine_calls)
    assert adds == (m - 1 if owner_tier == Tier.DISK else m)
