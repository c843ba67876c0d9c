"""Sections `optim` and `train`: the optimizer and its schedule, the loop's length, batching,
evaluation and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["AdamW", "Lion", "Adafactor", "AdamW8bit", "GaLoreAdamW"] = "AdamW"
    """Optimizer (--opt), the same on the reference trainer and the tiered runtime. AdamW uses
    beta1, beta2 and eps; Lion uses beta1 (the update's interpolation) and beta2 (the moment's
    decay), whose usual values are 0.9 and 0.99 with an lr 3-10x smaller than AdamW's; Adafactor
    ignores betas and eps (torch.optim.Adafactor's beta2_decay -0.8, eps (None, 1e-3), d 1) and
    reads lr as a step relative to each weight's RMS: its usual lr is 1e-2, torch's default (at
    3e-3 it learns visibly slower than AdamW).
    AdamW8bit: AdamW with both moments in 8 bits per element plus an fp32 scale per block of 256
    (2 B/param of state instead of 8). GaLoreAdamW: AdamW whose moments for the linear weights
    live in a rank-`galore_rank` projection of their gradient."""
    lr: float = 1e-3
    """Peak learning rate after warm-up, the same default for every --opt (set it per optimizer:
    Lion's usual lr is 3-10x smaller than AdamW's, Adafactor's about 1e-2) (--lr)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay for matrices; norms, biases and embeddings get none."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-8
    """Denominator epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    galore_rank: int = 128
    """GaLoreAdamW: rank of the moments' projection (full rank where a weight has fewer rows
    or columns)."""
    galore_update_every: int = 200
    """GaLoreAdamW: optimizer steps between refreshes of the projection (an SVD of each
    linear weight's gradient; the first step computes it)."""
    galore_scale: float = 0.25
    """GaLoreAdamW: factor on the update projected back to the weight's shape."""



@dataclass(kw_only=True)
class TrainConfig:
    finetune: Literal["full", "lora", "qlora"] = "full"
    """What training updates: full (every parameter), lora (low-rank adapters on the layers
    --lora.targets names, the base frozen; the run writes RUN_DIR/adapter in peft's format and
    its checkpoints hold the adapters only), qlora (lora on a base whose adapted layers' weights
    are stored, streamed and read as NF4 with double-quantised scales: tierlm.precision.nf4)
    (--finetune)."""
    max_steps: int = 100
    """Optimizer steps to run (--max-steps)."""
    batch_size: int = 8
    """Sequences per micro-batch (--batch-size)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (--grad-accum-steps)."""
    eval_every: int = 50
    """Evaluate held-out perplexity every N steps (also at step 0 and at the end); 0: only
    at step 0 and at the end (--eval-every)."""
    eval_batches: int = 8
    """Held-out batches (of `batch_size` sequences) per evaluation."""
    save_every: int = 0
    """Write a checkpoint every N steps (and always at the end); 0: only at the end
    (--save-every)."""
    save_final: bool = True
    """Write the checkpoint and the Hugging Face export at the end of the run; false (a
    benchmark) writes neither, and with --save-every 0 the run saves nothing, so the preflight
    reserves no disk for checkpoints or the export (Ctrl-C still saves)."""
    sample_tokens: int = 48
    """Tokens generated for the sample printed at the end; 0 disables it."""
    max_skipped_in_a_row: int = 10
    """Stop with a diagnosis after this many non-finite (skipped) steps in a row; 0: never stop
    (--max-skipped-in-a-row)."""

