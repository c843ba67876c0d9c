"""A whole `tierlm train` run: train, then export, sample and summarise."""

from __future__ import annotations

from collections.abc import Callable

from tierlm.config import Config
from tierlm.models import export_hf
from tierlm.train.trainer import Trainer, TrainResult


def run_training(cfg: Config, *, log: Callable[[str], None] = print) -> TrainResult:
    trainer = Trainer(cfg, log=log)
    result = trainer.train()
    hf_dir = export_hf(trainer.export_model(), trainer.tokenizer, trainer.run_dir / "hf")
    if cfg.train.sample_tokens:
        log("sample: " + trainer.sample(cfg.train.sample_tokens).replace("\n", "\n        "))
    trainer.stepper.close()
    log(f"run directory: {result.run_dir}")
    log(f"checkpoint:    {result.final_checkpoint}")
    log(f"HF export:     {hf_dir}")
    if result.skipped_steps:
        log(f"skipped steps (non-finite gradients): {result.skipped_steps}")
    if result.eval_ppl:
        first, last = min(result.eval_ppl), max(result.eval_ppl)
        log(
            f"held-out perplexity: {result.eval_ppl[first]:.2f} at step {first} -> "
            f"{result.eval_ppl[last]:.2f} at step {last}"
        )
    return result
