"""`--compile segments`: one compiled block forward for every block of the model, and a compiled
chunk loss at the head.

Every block of a family is the same code on the same shapes; only the weights differ. Each block
module gets `nn.Module.compile()`: with `torch._dynamo.config.inline_inbuilt_nn_modules` (on by
default since torch 2.5) its parameters are graph inputs, not constants guarded by identity, so
the graph compiled for block 0 serves block 1..L-1 too. The tiered runtime calls a block through
`torch.func.functional_call` with views of its flat buffers as the parameters; those are inputs
to the same graph, so streaming a block's weights in never recompiles it. A recompute under
`full` or `offload` runs the same compiled call (under grad mode: one more graph, compiled once).
The reference trainer calls the same modules through the model's own forward.

The head compiles the per-chunk cross-entropy (log-softmax and the loss over a chunk of logits,
the bulk of its elementwise work); the projection stays an eager matmul.

Under `--precision bf16` the blocks' linear layers (tierlm.precision.linear) take a streamed
weight's stored bf16 copy as a buffer that `functional_call` swaps in beside the weight's fp32
stand-in (which carries the fp32 gradient to the flat master gradient): both are graph inputs, so
the same graph serves every block and every stream slot. Inductor computes a fused kernel's bf16
values in fp32; the block compiles with `emulate_precision_casts`, so it rounds to bf16 where an
explicit cast does in eager, and the bf16 layer's backward leaves autocast (which a compiled
graph would otherwise apply to its fp32 GEMMs). Llama-family blocks then give eager bf16's
numbers to fp32 rounding (tests/runtime/test_compile.py); elementwise chains eager rounds after
every op (GPT-2's tanh GELU) keep their fp32 intermediates, a bf16-sized difference.

`--finetune lora` and `qlora` compile the same way: peft's LoRA layers are part of the block the
graph traces, the frozen base's weights are graph inputs like any others (its bf16 copy, or the
NF4 base decoded by the runtime's load action before the block runs, outside the graph), and
only the adapters take gradients. Data parallel (`--nproc N` on the tiered runtime) runs the
same compiled block on every rank: the gradient sync starts after a segment's backward, outside
the graph. tests/runtime/test_compile.py checks both against the eager run.

What it does not cover, refused in `check_compile` with a message naming --compile off:
- `--precision fp8`: the fp8 layers' scalers keep amax history and counters as Python state
  that the compiled graph would bake in as constants.
- `--grad-checkpointing selective` (or an override to it): its recompute caches matmul outputs
  through a TorchDispatchMode, under which torch.compile silently runs the block eagerly.
- `--grad-checkpointing dynamic`: its probe measures eager activations, not the compiled ones.
- `--backend fsdp`: FSDP2's parameter all-gathers run in hooks around the block, not verified
  compiled.
- `--context-parallel N`: the ring attention's collectives run inside the block, not verified
  compiled.

Compilation is lazy: the first step compiles (the trainer logs a line before it), later runs
read the kernels from the inductor cache (`TORCHINDUCTOR_CACHE_DIR`, under tierlm's cache dir
in a folder keyed by the torch version and this code, unless the environment sets it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tierlm.activations import chunked_loss
from tierlm.activations.chunked_loss import sum_cross_entropy
from tierlm.cache_keys import producer_key
from tierlm.config import NotSupportedYet

if TYPE_CHECKING:
    from tierlm.config import Config

ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits (N, V), targets (N,)) -> the summed token cross-entropy, a 0-dim fp32 tensor."""


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a supported family, in order (tierlm.models.adapters)."""
    if model.config.model_type == "gpt2":
        return list(model.transformer.h)
    return list(model.model.layers)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class NoCompile:
    """--compile off: eager blocks, the eager chunk loss."""

    chunk_loss: ChunkLoss = staticmethod(sum_cross_entropy)

    def apply(self, model: nn.Module, log: Callable[[str], None]) -> None:
        pass

    def end_step(self, rec: dict) -> dict:
        return {}


def kernels_key() -> str:
    """The key of the kernels compiled here: the library versions and the source of the code
    that builds the graphs (this module and the chunk loss it compiles); tierlm.cache_keys."""
    return producer_key(sys.modules[__name__], chunked_loss)


def inductor_cache_dir(cache_dir: Path) -> Path:
    """Point inductor's kernel cache at a folder of `cache_dir` named by `kernels_key()` (the
    cache is shared by runs and clones: another torch, or other code, gets its own), unless the
    user chose one: importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR to torch's own
    default (a temporary directory, lost on reboot), so only a different value is an explicit
    choice, and it wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env is None or os.path.abspath(env) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = env = str(cache_dir / f"kernels-{kernels_key()}")
    return Path(env)


class SegmentCompile:
    """--compile segments: `apply` compiles the blocks of a model in place; `chunk_loss` is the
    compiled head loss the tiered runtime's chunked cross-entropy calls."""

    def __init__(self, cache_dir: Path, *, precision: str = "fp32") -> None:
        self.cache_dir = inductor_cache_dir(cache_dir)
        # per compiled block, not process-wide: fp32 graphs keep their cache keys
        self.block_options = {"emulate_precision_casts": True} if precision == "bf16" else {}
        self.chunk_loss: ChunkLoss = torch.compile(sum_cross_entropy)
        self.log: Callable[[str], None] = print
        self.first_step = True

    def apply(self, model: nn.Module, log: Callable[[str], None]) -> None:
        blocks = block_modules(model)
        # Training never reads the KV cache; with it on, each block would guard on the cache's
        # per-layer state and recompile once per block.
        model.config.use_cache = False
        self.log = log
        for block in blocks:
            block.compile(options=self.block_options or None)
        log(f"compiling the block: {type(blocks[0]).__name__} x {len(blocks)} and the head's "
            f"chunk loss compile at the first step (torch.compile, inductor cache "
            f"{self.cache_dir}); every block reuses block 0's graphs")

    def end_step(self, rec: dict) -> dict:
        """`compiled_graphs` for the step's record (a count that grows after the first steps
        means recompiles); after the first step, a log line with its time, compile included."""
        graphs = compiled_graphs()
        if self.first_step:
            self.first_step = False
            self.log(f"compiled {graphs} graphs; the first step took {rec['step_time_s']:.1f} s "
                     "with compilation")
        return {"compiled_graphs": graphs}


def build_compile(mode: str, cache_dir: Path, precision: str) -> NoCompile | SegmentCompile:
    """The compile choice of --compile: `off` or `segments`; `precision`: the resolved one."""
    return SegmentCompile(cache_dir, precision=precision) if mode == "segments" else NoCompile()


def check_compile(cfg: Config, precision: str) -> None:
    """Refuse what --compile segments does not cover (see the module docstring); `precision`:
    the resolved --precision."""
    if cfg.run.compile == "off":
        return
    acts = cfg.activations
    overrides = acts.overrides or ""
    refused = [
        (precision == "fp8", f"--precision {precision}",
         "fp8 layers keep their scales' amax history as Python state; use --precision bf16 "
         "or fp32"),
        (acts.policy == "selective" or "=selective" in overrides, "--grad-checkpointing selective",
         "its recompute runs under a dispatch mode, where torch.compile runs eagerly; use full "
         "or offload"),
        (acts.policy == "dynamic", "--grad-checkpointing dynamic",
         "its probe measures eager activations; name a policy"),
        (cfg.distributed.backend == "fsdp", "--backend fsdp",
         "FSDP2's all-gather hooks around the block are not verified compiled; use the tiered "
         "runtime's data parallel (--backend engine)"),
        (cfg.distributed.context_parallel > 1,
         f"--context-parallel {cfg.distributed.context_parallel}",
         "the ring attention's collectives inside the block are not verified compiled"),
    ]
    for bad, flag, why in refused:
        if bad:
            raise NotSupportedYet(f"--compile segments with {flag}", f"{why}; or --compile off")
