"""The step never waits for the device except at its one global-norm read (issue R, item 1).

A host read of a device tensor (`.item()`, `float()`, `.cpu()`, a blocking copy) waits for
every kernel queued before it, so each one inside the step serialises the GPU with the training
thread. On this CPU machine every read is free, so the tests make device data unreadable or
watch the reads:
- an AST scan of the source finds no stream, event or host-blocking call outside the device
  interface and a reviewed allowlist;
- the optimizers update state on the `meta` device, where any host read of it raises;
- the chunked loss runs on `meta` tensors and returns its sum as a tensor;
- a torch function mode records the host reads made during an engine step, with the function
  that made them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from tests.runtime_helpers import batches, tiny_model
from tierlm.activations.chunked_loss import chunked_cross_entropy
from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.optim import build_flat_optimizer
from tierlm.optim.adafactor import _adafactor_step
from tierlm.optim.flat import advance, new_step_counter, step_count
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.engine import _stack_on

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
    (device-tier updates run on this thread; host-state ones on the update thread, unwatched,
    in host memory) and the batch's trained-token count, taken before the batch moves; and no
    norm is copied to the device per parameter."""
    eng = build_engine(
        tiny_model("llama_untied"), OPTIMIZERS[opt],
        EngineOptions(offload_dir=str(tmp_path), batch_size=2, seq_len=16, micro_batches=2,
                      grad_clip=0.05, policy=policy),
        device=torch.device("cpu"))
    steps = batches(2, 2)
    eng.step(steps[0], 1e-2)  # the first step does one-time work: watch the second
    with _StepWatch() as watch:
        out = eng.step(steps[1], 1e-2)
    eng.close()
    assert isinstance(out["loss"], float) and isinstance(out["grad_norm"], float)
    device_reads = [(where, read) for where, read, tainted in watch.reads if tainted]
    assert device_reads == [("Device.read", "tolist")]  # called once, by _finish_step
    host_readers = {where for where, _, tainted in watch.reads if not tainted}
    assert host_readers <= {"Engine.step", "step_count"}, host_readers
    assert "Engine._record_norms" not in watch.copies


def test_norms_cross_to_the_device_as_one_vector():
    """The global norm's inputs: norms in host memory (host-state segments) join those on the
    device in one copy, in their order (on the CPU the stack is torch.stack's, bit for bit)."""
    host = [torch.tensor(float(i)) for i in range(4)]
    on_device = [torch.empty((), device=META) for _ in range(3)]
    with _StepWatch() as watch:
        out = _stack_on(META, [host[0], on_device[0], host[1], host[2], on_device[1], host[3],
                               on_device[2]])
    assert out.device == META and out.shape == (7,)
    assert len(watch.copies) == 1
    assert torch.equal(_stack_on(torch.device("cpu"), host), torch.stack(host))


# -- the source (AST) ----

SRC = Path(__file__).resolve().parents[2] / "src" / "tierlm"
SCANNED = ("runtime", "memory", "precision", "activations", "optim", "plan")
# the one place that talks to streams and events and makes the step's waits (issue R, item 1)
DEVICE_INTERFACE = {"memory/device.py"}
STREAM_AND_SYNC_FUNCTIONS = {
    "torch.cuda.Stream", "torch.cuda.ExternalStream", "torch.cuda.Event", "torch.cuda.stream",
    "torch.cuda.current_stream", "torch.cuda.default_stream", "torch.cuda.set_stream",
    "torch.cuda.synchronize", "torch.Stream", "torch.Event", "torch.accelerator.synchronize",
    "torch.accelerator.current_stream", "torch.accelerator.set_stream",
    # answers on the host about device data
    "torch.equal", "torch.allclose", "torch.nonzero",
}
# methods that wait for the device (a host read of a tensor waits for the queue before it;
# nonzero's shape depends on the data) or order streams
BLOCKING_METHODS = {"item", "cpu", "tolist", "numpy", "nonzero", "synchronize", "wait_stream",
                    "wait_event", "record_stream"}
# float(x), int(x), bool(x) read a tensor on the host; told apart only where x is a subscript
# or a method's result (not a shape's or a size's): a plain name (float(step)) is not
# flagged, since most such names are numbers
NUMBER_CASTS = {"float", "int", "bool"}
_NOT_TENSORS = {"math", "os", "np", "numpy", "struct"}
_SIZES = {"size", "numel", "dim", "element_size", "nbytes"}

# (file under src/tierlm, function, call) -> why it is no stray sync
# THE global-norm read (with the clip coefficient and the loss) goes through the device
# (`Device.read` in Engine._finish_step, its invariant written beside it), which the scan does
# not flag; `test_the_step_reads_through_the_device_once` holds that it stays one
GLOBAL_NORM_READ: dict = {}
ALLOWED = {
    ("runtime/frozen.py", "FrozenBase.init_state", ".synchronize"):
        "a LoRA base's device copy put in place at setup, before the first step",
    ("runtime/frozen.py", "FrozenBase.init_state", "torch.cuda.current_stream"):
        "the same setup copy's stream",
    # the reference trainer is the plain PyTorch loop the tiered engine is compared with (a
    # user's loop reads its loss and norm each step): not the tiered step this test guards
    ("runtime/reference.py", "ReferenceStep.step", "non_blocking"):
        "the reference loop's batch copy",
    ("runtime/reference.py", "ReferenceStep.step", ".item"):
        "the reference loop's loss and clipped norm",
    ("runtime/reference.py", "ReferenceStep.eval_loss", ".item"):
        "evaluation in the reference loop, outside a step",
    ("memory/arena.py", "_Block.reclaim", ".synchronize"):
        "the pinned arena out of free ranges waits for the oldest freed one's copies: a stall "
        "the plan's arena size avoids, not a sync of every step",
    ("memory/arena.py", "_register", "int"): "cudaHostRegister's error code, at setup",
    ("memory/arena.py", "_unregister", "int"): "cudaHostUnregister's error code, at close",
    ("runtime/engine.py", "Engine.step", "int"):
        "the batch's trained tokens, counted in host memory before the batch moves",
    ("runtime/evaluation.py", "Evaluation._streamed_head", ".synchronize"):
        "Engine.synchronize (the update threads) before evaluation, outside a step",
    ("runtime/evaluation.py", "Evaluation.eval_loss.loss_sum", ".item"):
        "evaluation, outside a step",
    ("runtime/state_io.py", "StateIO._named", ".synchronize"):
        "Engine.synchronize before reading the state out (checkpoint, export)",
    ("runtime/state_io.py", "StateIO.load", ".synchronize"): "Engine.synchronize before a restore",
    ("runtime/state_io.py", "StateIO.state_shards", ".synchronize"):
        "Engine.synchronize before a checkpoint's shards",
    ("runtime/engine.py", "Engine.close", ".synchronize"): "Engine.synchronize at close",
    ("runtime/compile.py", "compiled_graphs", "int"): "torch._dynamo's counters: a dict",
    ("memory/disk.py", "supports_direct_io", "torch.equal"):
        "the O_DIRECT probe at setup, on host buffers",
    ("plan/probe.py", "decode_memory_Bps.decode", "torch.cuda.synchronize"):
        "tierlm probe's measurements, before training",
    ("plan/probe.py", "measure.mm", "torch.cuda.synchronize"): "tierlm probe's measurements",
    ("plan/probe.py", "measure.copy", "non_blocking"): "tierlm probe's measurements",
    ("plan/probe.py", "measure.copy", "torch.cuda.synchronize"): "tierlm probe's measurements",
    ("plan/probe.py", "measure_compiled_block.timer.run", "torch.cuda.synchronize"):
        "tierlm probe's measurements",
    ("precision/matmul.py", "scaled_mm_works", ".item"): "the fp8 capability check at setup",
    ("precision/watch.py", "Fp8Watch.state_dict", ".tolist"): "checkpoint state, outside a step",
    ("precision/watch.py", "Fp8Watch.end_step", ".tolist"):
        "the fp8 watch's report, after the step: one read of all its statistics",
    ("activations/chunked_loss.py", "chunked_cross_entropy", "int"):
        "only without `divisor` (tests, benches); the engine passes the step's",
    ("optim/flat.py", "step_count", ".item"): "step counters live in host memory (checked)",
    ("optim/adafactor.py", "_add_scaled", ".item"):
        "the host branch only (host memory); the device branch keeps the scale on the device",
    ("optim/adamw8bit.py", "AdamW8bit.step", "float"):
        "the reference trainer's per-parameter twin, not the engine's step",
    ("optim/galore.py", "GaLoreAdamW.step", "float"):
        "the reference trainer's per-parameter twin, not the engine's step",
}
# The step's CUDA calls that the device interface (memory/device.py) takes over: the lead
# empties this list when merging issue R's device work (an entry that matches nothing fails).
MOVING_TO_DEVICE: dict = {}  # emptied: the device interface (memory/device.py) has them


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _reads_a_tensor(arg: ast.AST) -> bool:
    if isinstance(arg, ast.Subscript):
        return not (isinstance(arg.value, ast.Attribute) and arg.value.attr == "shape")
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute):
        return _dotted(arg.func.value) not in _NOT_TENSORS and arg.func.attr not in _SIZES
    return False


class _Calls(ast.NodeVisitor):
    """(function's qualified name, call) of every stream, event or host-blocking call."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []  # (function, call, line)

    def _nested(self, node) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _nested

    def _add(self, call: str, node: ast.AST) -> None:
        self.found.append((".".join(self.scope) or "<module>", call, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if f"{node.module}.{alias.name}" in STREAM_AND_SYNC_FUNCTIONS:
                self._add(f"{node.module}.{alias.name}", node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        if name in STREAM_AND_SYNC_FUNCTIONS:
            self._add(name, node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in BLOCKING_METHODS:
            self._add("." + node.func.attr, node)
        elif (isinstance(node.func, ast.Name) and node.func.id in NUMBER_CASTS
              and len(node.args) == 1 and _reads_a_tensor(node.args[0])):
            self._add(node.func.id, node)
        if any(k.arg == "non_blocking" for k in node.keywords):
            self._add("non_blocking", node)
        self.generic_visit(node)


def _scan(source: str, path: str) -> list[tuple[str, str, str, int]]:
    calls = _Calls()
    calls.visit(ast.parse(source))
    return [(path, fn, call, line) for fn, call, line in calls.found]


def _source_findings() -> list[tuple[str, str, str, int]]:
    out = []
    for package in SCANNED:
        for f in sorted((SRC / package).rglob("*.py")):
            path = f.relative_to(SRC).as_posix()
            if path not in DEVICE_INTERFACE:
                out += _scan(f.read_text(), path)
    return out


def test_no_stray_syncs_in_the_step_code():
    """runtime/, memory/, precision/, activations/ and optim/ call no CUDA stream or event API
    and nothing that blocks the host on the device, outside the device interface, the
    reviewed allowlist (each with its reason), the one global-norm read, and the calls the
    device interface is taking over; and every allowlist entry still names a call."""
    reviewed = {**GLOBAL_NORM_READ, **ALLOWED, **MOVING_TO_DEVICE}
    found = _source_findings()
    stray = [f"{path}:{line} {fn}: {call}" for path, fn, call, line in found
             if (path, fn, call) not in reviewed]
    assert not stray, "host syncs or stream calls outside the device interface:\n" + "\n".join(
        stray)
    stale = set(reviewed) - {(path, fn, call) for path, fn, call, _ in found}
    assert not stale, f"allowlist entries that match no call any more: {sorted(stale)}"


def test_the_scan_finds_every_kind_of_call():
    """The scan itself: each kind of call is found, with the function it is in; sizes, shapes
    and math are not."""
    source = """
import torch
from torch.cuda import Event
class A:
    def f(self, t, d, steps, x):
        s = torch.cuda.Stream(d)
        e = torch.cuda.Event()
        with torch.cuda.stream(s):
            torch.cuda.current_stream(d).wait_stream(s)
        s.wait_event(e); e.synchronize(); torch.cuda.synchronize(); t.record_stream(s)
        y = t.item() + float(t.sum()) + int(steps[0]) + bool(t.any())
        z = t.cpu(); w = t.tolist(); v = t.to(d, non_blocking=True); n = t.numpy()
        same = torch.equal(t, z); nz = t.nonzero()
        ok = int(t.shape[0]) + int(t.numel()) + int(math.ceil(x)) + float(x)
"""
    calls = [(fn, call) for _, fn, call, _ in _scan(source, "x.py")]
    assert calls == [
        ("<module>", "torch.cuda.Event"),
        ("A.f", "torch.cuda.Stream"), ("A.f", "torch.cuda.Event"), ("A.f", "torch.cuda.stream"),
        ("A.f", ".wait_stream"), ("A.f", "torch.cuda.current_stream"), ("A.f", ".wait_event"),
        ("A.f", ".synchronize"), ("A.f", "torch.cuda.synchronize"), ("A.f", ".record_stream"),
        ("A.f", ".item"), ("A.f", "float"), ("A.f", "int"), ("A.f", "bool"), ("A.f", ".cpu"),
        ("A.f", ".tolist"), ("A.f", "non_blocking"), ("A.f", ".numpy"), ("A.f", "torch.equal"),
        ("A.f", ".nonzero"),
    ]


def test_the_step_reads_through_the_device_once():
    """The one host read of a step is the device's (`self.dev.read`), in `_finish_step`."""
    tree = ast.parse((SRC / "runtime" / "engine.py").read_text())
    reads = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "read"
             and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "dev"]
    assert len(reads) == 1, reads
