"""The FSDP2 backend (`--backend fsdp`): model state sharded over ranks by PyTorch itself.

For models whose state outgrows one node, each decoder block and then the root module are
wrapped with `torch.distributed.fsdp.fully_shard`: every rank keeps 1/W of the weights,
gradients and AdamW state; a block's weights are all-gathered just before it runs and its
gradients reduce-scattered (averaged over ranks) after its backward. `MixedPrecisionPolicy`
computes in bf16 under `--precision bf16` (fp32 master weights; gradients reduced in fp32, or
in bf16 with `--distributed.grad_sync_dtype bf16`); `CPUOffloadPolicy`
(`--distributed.fsdp_cpu_offload`) keeps the shards in host RAM and runs the optimizer there
(pinned only where CUDA exists).

The step itself is the reference trainer's (`ReferenceStep`) on the sharded module, so the
math is plain PyTorch. State goes in and out through `torch.distributed.checkpoint.state_dict`,
which converts between the sharded tensors and full tensors keyed by parameter name: the same
checkpoint format as the other runtimes, so an FSDP run resumes from, and exports to, the
usual files.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from tierlm.config import ConfigError, OptimConfig
from tierlm.distributed.comm import Comm
from tierlm.distributed.world import World
from tierlm.train.reference import ReferenceStep

_FULL = StateDictOptions(full_state_dict=True)
# Loading: tied weights arrive once (under the name `named_parameters` keeps), not twice.
_FULL_LOAD = StateDictOptions(full_state_dict=True, strict=False)


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (Llama family: model.layers; GPT-2: transformer.h)."""
    for path in ("model.layers", "transformer.h"):
        node = model
        for attr in path.split("."):
            node = getattr(node, attr, None)
        if isinstance(node, torch.nn.ModuleList):
            return node
    raise ConfigError(
        f"--backend fsdp: cannot find the decoder layers of {type(model).__name__} "
        "(Llama, Mistral, Qwen2/3 and GPT-2 are supported)"
    )


class FSDPStep:
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        grad_clip: float,
        device: torch.device,
        world: World,
        comm: Comm,
        precision: str,
        cpu_offload: bool,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.world = world
        self.comm = comm
        # The trainer keeps its module for export; ours is a copy that FSDP rewrites in place.
        # The trainer's parameters are emptied meanwhile (export refills them from `weights`).
        self.model = copy.deepcopy(model)
        for p in model.parameters():
            p.data = torch.empty(0, dtype=p.dtype)
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else None,
            reduce_dtype=reduce_dtype,
        )
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload
            else OffloadPolicy()
        )
        if not cpu_offload:
            self.model.to(device)
        # Blocks first, then the root (embeddings, final norm, head): each block's weights are
        # gathered only while it runs; the root's unit holds the tied embedding once.
        for block in decoder_blocks(self.model):
            fully_shard(block, mp_policy=mp, offload_policy=offload)
        fully_shard(self.model, mp_policy=mp, offload_policy=offload)
        self.ref = ReferenceStep(self.model, optim, grad_clip=grad_clip, device=device)

    @property
    def skipped_steps(self) -> int:
        return self.ref.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.ref.skipped_steps = value

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        out = self.ref.step(batches, lr)
        (out["loss"],) = self.comm.mean_of([out["loss"]])
        return out

    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of `batch`, its rows split over the ranks (each forward is
        collective: every rank runs one, on at least one row)."""
        w = self.world.size
        if batch.shape[0] < w:
            (loss,) = self.comm.mean_of([self.ref.eval_loss(batch)])
            return loss
        mine = batch.tensor_split(w)[self.world.rank]
        tokens = mine[:, 1:].numel()
        nll, total = self.comm.mean_of([self.ref.eval_loss(mine) * tokens, tokens])
        return nll / total

    # -- state, as full tensors keyed by parameter name (collective: every rank calls) ----

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights on every rank (CPU copies), tied tensors once, as the other runtimes
        key them."""
        full = get_model_state_dict(self.model, options=_FULL)
        return {n: full[n].detach().cpu() for n in self._param_names()}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        osd = get_optimizer_state_dict(self.model, self.ref.optimizer, options=_FULL)
        return {
            f"{name}.{key}": v.detach().cpu()
            for name, state in osd["state"].items() for key, v in state.items()
        }

    def state_shards(self):
        weights, optim = self.weights(), self.optimizer_state()
        if self.world.is_main:
            yield "", weights, optim

    def load(self, weights, optim) -> None:
        names = self._param_names()
        set_model_state_dict(self.model, {n: weights[n] for n in names}, options=_FULL_LOAD)
        if not optim:
            return
        current = get_optimizer_state_dict(self.model, self.ref.optimizer, options=_FULL)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key in optim:  # "<parameter>.<state>"; other entries (dp.*) are not ours
            name, _, what = key.rpartition(".")
            if name in names:
                state.setdefault(name, {})[what] = optim[key]
        set_optimizer_state_dict(
            self.model, self.ref.optimizer,
            {"state": state, "param_groups": current["param_groups"]}, options=_FULL,
        )

    def _param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass
