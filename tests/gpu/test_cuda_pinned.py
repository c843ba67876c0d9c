"""The pinned arena on CUDA (skipped without a GPU): the buffers PCIe copies use are page-locked
(registered with the driver, so copies from them are asynchronous), the rest stays pageable, the
arena is the ledger's pinned peak, and the step's math is the CPU engine's."""

import copy

import pytest
import torch

from tests.runtime_helpers import OPTIM, batches, tiny_model
from tierlm.memory import Tier
from tierlm.runtime import EngineOptions, build_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(model, tmp_path, device, policy):
    return build_engine(model, OPTIM, EngineOptions(
        policy=policy, micro_batches=2, batch_size=2, seq_len=16, offload_dir=str(tmp_path),
        keep_resident_activations=False, boundary_tier=Tier.HOST), device=device)


@pytest.mark.parametrize("policy", ["host", "disk"])
def test_the_arena_is_registered_counted_and_exact(policy, tmp_path):
    base = tiny_model("llama_untied", layers=2)
    steps = batches(2, 2)
    losses = {}
    for name in ("cpu", "cuda"):
        eng = _engine(copy.deepcopy(base), tmp_path / name, torch.device(name), policy)
        losses[name] = [eng.step(b, OPTIM.lr)["loss"] for b in steps]
        eng.synchronize()
        if name == "cuda":
            arena, led = eng.store.arena, eng.ledger
            assert arena.pin
            for st in eng.states:
                if policy == "host":
                    assert st.master.is_pinned()  # the H2D copies read it
                    assert not any(t.is_pinned() for t in st.state.values())
                    assert not st.grad.is_pinned()
            assert 0 <= arena.capacity_bytes - led.pinned_peak_bytes <= 64 * 4096
            assert arena.peak_bytes == led.pinned_peak_bytes > 0
        eng.close()
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-5)
