"""What a model's step is built from (`StepParts`): the segments, their flat layouts, the compute
copies and the flat optimizer, and the byte sizes the plan (tierlm.runtime.plan), the pinned-bytes
rule (tierlm.runtime.pinned) and the engine all take from it."""

from __future__ import annotations

import torch

from tierlm.activations import default_chunk_tokens, head_workspace_bytes
from tierlm.config import OptimConfig
from tierlm.memory.layout import FlatLayout
from tierlm.memory.tiers import Tier
from tierlm.models.adapters import ModelAdapter
from tierlm.optim import build_flat_optimizer
from tierlm.precision.streaming import ComputeCopies
from tierlm.runtime.frozen import FrozenBase
from tierlm.runtime.options import EngineOptions
from tierlm.runtime.schedule import boundary_activation_bytes, micro_batches_in_flight


class StepParts:
    """What a model's step is built from, and the sizes the plan and the engine both take from
    it: the segments, their flat layouts, the compute copies and the flat optimizer, and the
    device bytes the step holds besides model state (boundary activations, tied gradients, a
    frozen base's adapters and decode buffer, the head's workspace)."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig,
                 options: EngineOptions) -> None:
        chunk = options.staging_chunk_numel
        if chunk <= 0 or chunk % 1024:
            raise ValueError(f"staging_chunk_numel must be a positive multiple of 1024 (4 KiB "
                             f"of fp32, O_DIRECT's alignment), got {chunk}")
        self.adapter = ModelAdapter(model)
        segs = self.adapter.segments
        # weights whose state is off the device are held, moved and computed from in the
        # precision they compute in (tierlm.precision.streaming); a LoRA base in its bf16
        # compute copy or NF4 bytes alone, on every tier (tierlm.runtime.frozen)
        self.frozen_copy = options.base_format != "fp32"
        self.compute_copies = (FrozenBase(model, options.base_format) if self.frozen_copy
                               else ComputeCopies(model))
        self.optimizer = build_flat_optimizer(optim)
        # Frozen parameters (requires_grad False: a LoRA run's base) are streamed weights with
        # no gradient and no optimizer state; the trained ones (its adapters) then live on the
        # device, a small flat layout per segment. Without frozen parameters the segment's
        # streamed weights are what is trained.
        self.frozen_base = any(not p.requires_grad for s in segs for _, p, _ in s.params)
        self.layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params
                                    if not (self.frozen_base and p.requires_grad)])
                        for s in segs]
        self.trained_layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params
                                            if p.requires_grad]) for s in segs]
        trained_bytes = sum(
            (4 + 4) * lay.numel + self.optimizer.state_nbytes(lay)
            for lay in self.trained_layouts if lay.numel) if self.frozen_base else 0
        config = model.config
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.hidden_bytes = options.batch_size * options.seq_len * config.hidden_size * 4
        self.in_flight = micro_batches_in_flight(options.micro_batches,
                                                 options.microbatch_order)
        # the owner's gradient holding the head's contribution to tied weights, one per
        # micro-batch in flight (tierlm.runtime.walk)
        tied = any(n in segs[-1].borrowed for n, _, _ in segs[0].params)
        self.tied_trained = tied and not self.frozen_base  # frozen ties take no gradient
        tied_bytes = self.layouts[0].numel * 4 if self.tied_trained else 0
        # a QLoRA matmul decodes its NF4 weight into a buffer of its own, one weight at a time
        # (outside the ledger): room for the largest
        decoded_bytes = max((self.compute_copies.decoded_nbytes(lay) for lay in self.layouts),
                            default=0) if self.frozen_copy else 0
        self.host_boundaries = options.boundary_tier == Tier.HOST
        self.activation_bytes = (
            boundary_activation_bytes(
                len(segs), self.hidden_bytes, options.micro_batches, options.microbatch_order,
                on_host=self.host_boundaries,
            )
            + self.in_flight * tied_bytes
        )
        # device bytes placed before any model state, besides the activation policy's reserve
        self.fixed_device_bytes = self.activation_bytes + trained_bytes + decoded_bytes
        vocab = config.vocab_size
        self.chunk_tokens = options.loss_chunk_tokens or default_chunk_tokens(vocab)
        self.head_bytes = head_workspace_bytes(
            self.chunk_tokens, vocab, options.batch_size * options.seq_len, config.hidden_size)
