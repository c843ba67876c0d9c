"""The reference step: plain PyTorch, the whole model on one device.

This is the numerical reference the tiered runtime must reproduce (ARCHITECTURE.md invariant 1),
so it stays simple and exact. It and `tierlm.runtime.Engine` are `Stepper`s
(tierlm.runtime.stepper): the trainer never asks which one it has. It has none of the optional
capabilities (no ledger, no stream cache, no engine).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tierlm.config import OptimConfig
from tierlm.data.batch import inputs_and_targets, local_divisor, position_ids, trained_targets
from tierlm.optim import build_optimizer
from tierlm.runtime.clock import compute_clock
from tierlm.runtime.stepper import Stepper


class ReferenceStep(Stepper):
    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        grad_clip: float,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        loss_divisor: Callable[[int], float] = local_divisor,
    ) -> None:
        """`loss_divisor(trained targets of the step)`: what the step's summed token loss is
        divided by (tierlm.data.batch): its own count in one process; FSDP and context parallel
        ask every rank's (tierlm.distributed.comm.Comm.token_divisor)."""
        self.model = model
        self.device = device
        self.optimizer = build_optimizer(model, optim)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.clip_norm = grad_clip if grad_clip > 0 else math.inf
        self.autocast = autocast
        self.loss_divisor = loss_divisor
        self.skipped_steps = 0
        self.clock = compute_clock(device)  # the whole step is compute: nothing is streamed

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean token loss of `batch`."""
        return self._nll(batch) / local_divisor(trained_targets(batch))

    def _nll(self, batch: torch.Tensor) -> torch.Tensor:
        """Summed token loss of `batch`."""
        inputs, targets = inputs_and_targets(batch)  # (B, T); targets -100 where masked
        positions = position_ids(batch)
        # Packed examples: transformers builds the block-diagonal mask from the positions only
        # without a KV cache.
        packed = {} if positions is None else {"position_ids": positions, "use_cache": False}
        with self.autocast():
            logits = self.model(input_ids=inputs, **packed).logits  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def step(self, batches: list[torch.Tensor], lr: float) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.clock.measure():
            # the step's mean over all its trained tokens, not a mean of micro-batch means
            tokens = sum(trained_targets(b) for b in batches)
            divisor = self.loss_divisor(tokens)
            nll_sum = torch.zeros((), device=self.device)
            for batch in batches:
                nll = self._nll(batch.to(self.device, non_blocking=True))
                (nll / divisor).backward()
                nll_sum += nll.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm).item()
            skipped = not math.isfinite(grad_norm)
            if skipped:
                self.skipped_steps += 1  # weights and optimizer state stay untouched
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"loss": nll_sum.item() / divisor, "loss_tokens": tokens, "loss_divisor": divisor,
                "grad_norm": grad_norm, "skipped": skipped, "compute_s": self.clock.take()}

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        self.model.eval()
        try:
            return self._loss(batch.to(self.device)).item()
        finally:
            self.model.train()

    @torch.no_grad()
    def next_token_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(V,) fp32 logits after the last token of `ids` (1, T), as the step computes them."""
        self.model.eval()
        try:
            with self.autocast():
                return self.model(input_ids=ids.to(self.device)).logits[0, -1].float()
        finally:
            self.model.train()

    # -- state, keyed by parameter name so either runtime can resume the other's checkpoint --

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights by parameter name (CPU copies, as the other runtimes give them: a
        caller may hold them across a step and compare)."""
        return {n: _cpu_copy(t) for n, t in self._live_weights().items()}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """AdamW state by `<name>.<slot>` (CPU copies)."""
        return {k: _cpu_copy(t) for k, t in self._live_optimizer_state().items()}

    def _live_weights(self) -> dict[str, torch.Tensor]:
        """The trained parameters (all of them, or a LoRA run's adapters: its frozen base is
        rebuilt from --model or the preset's seed, never checkpointed)."""
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def _live_optimizer_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for p in self.params:
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{self.names[id(p)]}.{key}"] = value.detach()
        return out

    def load(self, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if p.requires_grad:
                    p.copy_(weights[n])
        for p in self.params:
            prefix = self.names[id(p)] + "."
            # keys first: `optim` may be a lazy mapping that reads a tensor per access
            state = {k[len(prefix):]: optim[k] for k in optim if k.startswith(prefix)}
            if state:
                self.optimizer.state[p] = {
                    k: v.to(device=p.device, dtype=torch.float32 if k == "step" else p.dtype)
                    for k, v in state.items()
                }

    def state_shards(self):
        """The state as one checkpoint shard (this runtime holds the whole model anyway). The
        live tensors, not copies: the writer copies one tensor at a time, so a save never holds
        a second model."""
        yield "", self._live_weights(), self._live_optimizer_state()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)
