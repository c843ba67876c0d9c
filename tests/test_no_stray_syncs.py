"""The step never waits for the device except at its one global-norm read (issue R, item 1).

A host read of a device tensor (`.item()`, `float()`, `.cpu()`, a blocking copy) waits for
every kernel queued before it, so each one inside the step serialises the GPU with the training
thread. On this CPU machine every read is free, so the tests make device data unreadable or
watch the reads:
- the optimizers update state on the `meta` device, where any host read of it raises;
- the chunked loss runs on `meta` tensors and returns its sum as a tensor;
- a torch function mode records the host reads made during an engine step, with the function
  that made them."""

from __future__ import annotations

import sys

import pytest
import torch
from runtime_helpers import batches, tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from tierlm.activations.chunked_loss import chunked_cross_entropy
from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.optim import build_flat_optimizer
from tierlm.optim.adafactor import _adafactor_step
from tierlm.optim.flat import advance, new_step_counter, step_count
from tierlm.runtime import EngineOptions, build_engine

META = torch.device("meta")
OPTIMIZERS = {
    "AdamW": OptimConfig(name="AdamW", lr=1e-2, weight_decay=0.1),
    "AdamW8bit": OptimConfig(name="AdamW8bit", lr=1e-2, weight_decay=0.1),
    "Adafactor": OptimConfig(name="Adafactor", lr=1e-2, weight_decay=0.1),
    "GaLoreAdamW": OptimConfig(name="GaLoreAdamW", lr=1e-2, weight_decay=0.1, galore_rank=2,
                               galore_update_every=2),
    "Lion": OptimConfig(name="Lion", lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.99),
}


# -- the optimizers' device-tier update ----

@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_device_tier_update_reads_nothing_back(name):
    """Every flat optimizer updates a segment whose master, gradient and state are on the
    `meta` device (where a host read raises) for two steps, its step counters created for that
    device as the runtime creates them: the counts come from host memory, the scalars the
    update derives from the data stay on the device."""
    opt = build_flat_optimizer(OPTIMIZERS[name])
    layout = FlatLayout([("w", (8, 6), True), ("v", (6, 8), True), ("b", (6,), False)])
    master = torch.empty(layout.numel, device=META)
    grad = torch.empty(layout.numel, device=META)
    state = {s.name: torch.empty(s.numel(layout), dtype=s.dtype, device=META)
             for s in opt.slots}
    steps = [new_step_counter(META) for _ in layout.groups()]
    for _ in range(2):
        opt.update_range(layout, 0, master, grad, state, steps, 1e-2)
        advance(steps)
    assert [step_count(s) for s in steps] == [2.0] * len(steps)


def test_step_count_refuses_a_device_counter():
    with pytest.raises(ValueError, match="host memory"):
        step_count(torch.zeros((), device=META))


def test_adafactor_device_scale_is_torch_adafactor_within_an_ulp():
    """Adafactor's device branch (the step's scale stays a tensor; the product and the add
    round separately) against torch.optim.Adafactor, which reads the scale as a number: the
    same steps to float32 rounding."""
    torch.manual_seed(0)
    p0, grads = torch.randn(12, 7), [torch.randn(12, 7) for _ in range(3)]
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.Adafactor([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    mine = p0.clone()
    row, col, var = torch.zeros(12, 1), torch.zeros(1, 7), torch.zeros(0)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        torch_opt.step()
        _adafactor_step(mine, g.clone(), row, col, var, float(t), lr=1e-2, weight_decay=0.1,
                        eps1=torch.finfo(torch.float32).eps, eps2=1e-3, host_scale=False)
    assert not torch.equal(mine, p0)
    torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-7)


# -- the loss ----

def test_chunked_loss_stays_on_the_device():
    """The chunked loss sums its chunks on the device: on `meta` tensors (where a host read
    raises) it runs all its chunks and returns a 0-dim fp64 tensor there."""
    h = torch.empty(10, 4, device=META, requires_grad=True)
    w = torch.empty(7, 4, device=META, requires_grad=True)
    targets = torch.zeros(10, dtype=torch.long, device=META)
    loss = chunked_cross_entropy(lambda x: torch.nn.functional.linear(x, w), h, targets,
                                 chunk_tokens=3, divisor=10.0)
    assert isinstance(loss, torch.Tensor)
    assert loss.device == META and loss.dtype == torch.float64 and loss.dim() == 0
    assert h.grad is not None and w.grad is not None


# -- the engine's step ----

_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy"}


class _StepWatch(TorchFunctionMode):
    """Records the host reads of tensors (`.item()`, `float()`, `int()`, `.tolist()`,
    `.cpu()`, ...) and the `.to()` copies made while active, each with the function that made
    it. A read is `device` when its tensor derives from the step's data on the device: the
    outputs of every `.to(...)` (the batch's move) and, transitively, of every torch function
    given such a tensor (this CPU machine cannot tell host from device memory otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_data = WeakIdKeyDictionary()
        self.reads: list[tuple[str, str, bool]] = []  # (function, read, of device data)
        self.copies: list[str] = []  # the functions that called `.to(...)`

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        where = sys._getframe(1).f_code.co_qualname
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        tainted = any(t in self.device_data for t in tensors)
        if name in _READS:
            self.reads.append((where, name, tainted))
        out = func(*args, **kwargs)
        if name == "to":
            self.copies.append(where)
        if tainted or name == "to":
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.device_data[t] = True
        return out


@pytest.mark.parametrize("policy", ["none", "host"])
@pytest.mark.parametrize("opt", ["AdamW", "AdamW8bit"])
def test_step_reads_the_device_once(tmp_path, policy, opt):
    """An engine step (device or host state, two micro-batches, clipping active) reads device
    data on the host once: the global norm, the clipping coefficient and the loss in one
    vector at the step's end. The only other host reads are of host memory: the step counters
    and the batch's trained-token count, taken before the batch moves; and no norm is copied
    to the device per parameter."""
    eng = build_engine(
        tiny_model("llama_untied"), OPTIMIZERS[opt],
        EngineOptions(offload_dir=str(tmp_path), batch_size=2, seq_len=16, micro_batches=2,
                      grad_clip=0.05, policy=policy),
        device=torch.device("cpu"))
    steps = batches(2, 2)
    eng.step(steps[0], 1e-2)  # the first step sizes the cache: watch a steady one
    with _StepWatch() as watch:
        out = eng.step(steps[1], 1e-2)
    eng.close()
    assert isinstance(out["loss"], float) and isinstance(out["grad_norm"], float)
    device_reads = [(where, read) for where, read, tainted in watch.reads if tainted]
    assert device_reads == [("Engine._finish_step", "tolist")]
    host_readers = {where for where, _, tainted in watch.reads if not tainted}
    assert host_readers <= {"Engine.step", "step_count"}, host_readers
    assert "Engine._record_norms" not in watch.copies
