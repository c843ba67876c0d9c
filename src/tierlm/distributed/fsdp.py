"""The FSDP2 backend (`--backend fsdp`): model state sharded over ranks by PyTorch itself.

For models whose state outgrows one node, each decoder block and then the root module are
wrapped with `torch.distributed.fsdp.fully_shard`: every rank keeps 1/W of the weights,
gradients and AdamW state; a block's weights are all-gathered just before it runs and its
gradients reduce-scattered (averaged over ranks) after its backward. `MixedPrecisionPolicy`
computes in bf16 under `--precision bf16` (fp32 master weights; gradients reduced in fp32, or
in bf16 with `--distributed.grad_sync_dtype bf16`); `CPUOffloadPolicy`
(`--distributed.fsdp_cpu_offload`) keeps the shards in host RAM and runs the optimizer there
(pinned only where CUDA exists).

Only rank 0 needs the model's weights: the others may build it on the meta device (the trainer
does), and after sharding every rank takes its shards of rank 0's full state dict, tensor by
tensor (`set_model_state_dict` with `broadcast_from_rank0`), then rank 0's buffers.

The step itself is the reference trainer's (`ReferenceStep`) on the sharded module, so the
math is plain PyTorch. Checkpoints never gather the state: `save_sharded` hands the sharded
state dicts (`get_model_state_dict` / `get_optimizer_state_dict` without `full_state_dict`) to
`torch.distributed.checkpoint`, so each rank writes only its own shards into the directory
`tierlm.checkpoint.save_sharded_checkpoint` publishes, and `load` reads them back through
dcp the same way (same world size). Those checkpoints resume FSDP runs only; they export to
Hugging Face like any other (`DCPTensors` assembles full tensors one group at a time). Full
weights are gathered only for the run's end-of-training sample (`weights`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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

from tierlm.checkpoint import CheckpointError, DCPTensors
from tierlm.config import ConfigError, OptimConfig
from tierlm.data.batch import trained_targets
from tierlm.distributed.comm import Comm
from tierlm.distributed.world import World
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.stepper import Stepper

_FULL = StateDictOptions(full_state_dict=True)
_SHARDED = StateDictOptions()
# Loading: tied weights arrive once (under the name `named_parameters` keeps), not twice.
_SHARDED_LOAD = StateDictOptions(strict=False)


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


class FSDPStep(Stepper):
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
        # Ranks other than 0 may hand in the model built on the meta device (the trainer does):
        # every rank then takes rank 0's weights, each keeping only its shards, so a node holds
        # one full copy of the model at start, not one per rank.
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and (world.is_main or not world.distributed):
            raise ValueError("FSDPStep: rank 0 needs the model's weights; only the other ranks "
                             "may build it on the meta device")
        full = model.state_dict() if world.distributed and world.is_main else {}
        # The trainer keeps its module for export; ours is a copy of its structure that FSDP
        # rewrites in place. The copy shares the trainer's parameter and buffer tensors (no
        # second copy of the weights), and once each rank holds its shards the trainer's
        # parameters are emptied (export refills them from `weights`): the peak is the model
        # plus this rank's shards, not two models.
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        self.model = copy.deepcopy(model, shared)
        originals = [p for p in model.parameters() if not p.is_meta]
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if precision == "bf16" else None,
            reduce_dtype=reduce_dtype,
        )
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload
            else OffloadPolicy()
        )
        if not cpu_offload and not on_meta:
            self.model.to(device)
        # Blocks first, then the root (embeddings, final norm, head): each block's weights are
        # gathered only while it runs; the root's unit holds the tied embedding once.
        for block in decoder_blocks(self.model):
            fully_shard(block, mp_policy=mp, offload_policy=offload)
        fully_shard(self.model, mp_policy=mp, offload_policy=offload)
        if on_meta:  # storage for this rank's shards and the buffers, filled just below
            self.model.to_empty(device="cpu" if cpu_offload else device)
        if world.distributed:
            self._take_rank0_weights(full)
        del full
        for p in originals:
            p.data = torch.empty(0, dtype=p.dtype)
        # the reduce-scatter averages gradients over the ranks: each divides its summed token
        # loss by the world's trained tokens over the world size
        self.ref = ReferenceStep(self.model, optim, grad_clip=grad_clip, device=device,
                                 loss_divisor=comm.token_divisor)

    def _take_rank0_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Every rank's shards from rank 0's full state dict, tensor by tensor (collective), and
        rank 0's buffers (rotary tables are not in the state dict)."""
        set_model_state_dict(self.model, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))
        for buf in self.model.buffers():
            dist.broadcast(buf, src=0)

    @property
    def skipped_steps(self) -> int:
        return self.ref.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.ref.skipped_steps = value

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        return self.comm.step_loss(self.ref.step(batches, lr))

    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean token loss of `batch`, its rows split over the ranks (each forward is
        collective: every rank runs one, on at least one row)."""
        w = self.world.size
        if batch.shape[0] < w:
            (loss,) = self.comm.mean_of([self.ref.eval_loss(batch)])
            return loss
        mine = batch.tensor_split(w)[self.world.rank]
        tokens = trained_targets(mine)
        nll, total = self.comm.mean_of([self.ref.eval_loss(mine) * tokens, tokens])
        return nll / total

    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Collective: every rank runs the forward (on the same ids, so all sample alike)."""
        return self.ref.next_token_logits(ids)

    # -- state (collective: every rank calls) ----

    def weights(self) -> dict[str, torch.Tensor]:
        """Full weights on every rank (CPU copies), tied tensors once, as the other runtimes
        key them: a whole model per rank, so only for the end-of-run sample."""
        full = get_model_state_dict(self.model, options=_FULL)
        return {n: full[n].detach().cpu() for n in self._param_names()}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Full AdamW state on every rank (CPU copies), keyed `<name>.<slot>` as the other
        runtimes key it: a whole model's state per rank, like `weights`."""
        full = get_optimizer_state_dict(self.model, self.ref.optimizer, options=_FULL)["state"]
        return {f"{n}.{slot}": v.detach().cpu() for n in self._param_names() if n in full
                for slot, v in full[n].items()}

    def state_shards(self) -> Iterator[tuple[str, dict[str, torch.Tensor], dict]]:
        """This rank's part of the weights (no gather), for the non-finite check."""
        local = {n: p.to_local() if hasattr(p, "to_local") else p
                 for n, p in self.model.named_parameters()}
        yield f"rank{self.world.rank}", local, {}

    def _sharded_state(self, with_optimizer: bool = True) -> dict[str, dict]:
        """{"model": weights by name, "optim": AdamW state by name}, as this rank's shards
        (DTensors): what dcp writes and reads. Tensors only, so loading unpickles nothing."""
        names = self._param_names()
        model = get_model_state_dict(self.model, options=_SHARDED)
        out: dict[str, dict] = {"model": {n: model[n] for n in names}}
        if with_optimizer:
            optim = get_optimizer_state_dict(self.model, self.ref.optimizer, options=_SHARDED)
            out["optim"] = {n: optim["state"][n] for n in names if n in optim["state"]}
        return out

    def save_sharded(self, path: Path) -> None:
        """Write this rank's shards into `path` (rank 0 also dcp's `.metadata` index)."""
        dcp.save(self._sharded_state(), checkpoint_id=str(path))

    def load(self, weights: Mapping[str, torch.Tensor], optim: Mapping[str, torch.Tensor]) -> None:
        """Resume from a checkpoint `save_sharded` wrote: each rank reads its own shards."""
        if not isinstance(weights, DCPTensors):
            raise CheckpointError(
                "--backend fsdp resumes only its own torch.distributed.checkpoint shards, and "
                "this checkpoint holds name-keyed safetensors: resume with the backend that "
                "wrote it"
            )
        if weights.world_size != self.world.size:
            raise CheckpointError(
                f"checkpoint {weights.path} holds FSDP shards of {weights.world_size} "
                f"processes, this run has {self.world.size}: resume with --nproc "
                f"{weights.world_size}"
            )
        # A checkpoint from before the first step has no AdamW state to load.
        with_optimizer = len(optim) > 0
        state = self._sharded_state(with_optimizer)
        dcp.load(state, checkpoint_id=str(weights.path))
        set_model_state_dict(self.model, state["model"], options=_SHARDED_LOAD)
        if with_optimizer:
            groups = get_optimizer_state_dict(self.model, self.ref.optimizer,
                                              options=_SHARDED)["param_groups"]
            set_optimizer_state_dict(
                self.model, self.ref.optimizer,
                {"state": state["optim"], "param_groups": groups}, options=_SHARDED,
            )

    def _param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass
