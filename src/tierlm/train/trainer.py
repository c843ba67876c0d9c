"""The reference trainer: plain PyTorch, the whole model on one device.

This loop is the numerical reference the tiered runtime must reproduce, so it stays simple and
exact: features are resolved once in `Trainer.__init__` (autocast context, clipping bound,
checkpointing) and the step calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from tierlm.config import Config, ConfigError, check_supported, to_dict
from tierlm.data import (
    BatchSampler,
    PackedSequences,
    check_token_ids,
    encode_documents,
    eval_batches,
    load_corpus,
    load_model_tokenizer,
    load_or_train_tokenizer,
)
from tierlm.models import build_model, count_params, load_hf_model, preset_config
from tierlm.optim import build_optimizer
from tierlm.train.checkpoint import (
    TrainState,
    latest_valid_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tierlm.train.monitor import MetricsLog, Progress
from tierlm.train.schedule import lr_at


def cache_dir() -> Path:
    """Where trained tokenizers are cached between runs ($TIERLM_CACHE overrides)."""
    env = os.environ.get("TIERLM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tierlm"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device; use --device cpu")
    return torch.device(name)


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.model.path).name if cfg.model.path else cfg.model.size
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    eval_ppl: dict[int, float] = field(default_factory=dict)
    skipped_steps: int = 0
    final_checkpoint: Path | None = None


class Trainer:
    def __init__(self, cfg: Config, *, log: Callable[[str], None] = print) -> None:
        check_supported(cfg)
        self.cfg = cfg
        self.log = log
        self.device = resolve_device(cfg.run.device)
        resume_ckpt = None
        if cfg.run.resume:
            self.run_dir = Path(cfg.run.resume)
            resume_ckpt = latest_valid_checkpoint(self.run_dir, warn=log)
        else:
            self.run_dir = Path(cfg.run.out) if cfg.run.out else default_run_dir(cfg)
            self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8"
        )

        corpus = load_corpus(
            cfg.data.train,
            cfg.data.eval,
            text_field=cfg.data.text_field,
            eval_fraction=cfg.data.eval_fraction,
        )
        log(f"data: {corpus.source}")
        if cfg.model.path:
            self.tokenizer = load_model_tokenizer(cfg.model.path)
        elif resume_ckpt is not None:
            self.tokenizer = load_model_tokenizer(resume_ckpt)
        else:
            self.tokenizer = load_or_train_tokenizer(
                [d.text for d in corpus.train], cfg.data.vocab_size, cache_dir() / "tokenizers"
            )
        train_ids = encode_documents(self.tokenizer, corpus.train)
        eval_ids = encode_documents(self.tokenizer, corpus.eval)

        if cfg.model.path:
            self.model = load_hf_model(cfg.model.path, device=self.device)
        else:
            model_cfg = preset_config(
                cfg.model.size, vocab_size=len(self.tokenizer), max_seq_len=cfg.data.seq_len
            )
            self.model = build_model(model_cfg, device=self.device, seed=cfg.run.seed)
        vocab = self.model.config.vocab_size
        check_token_ids(train_ids, vocab, "training data")
        check_token_ids(eval_ids, vocab, "held-out data")
        if cfg.activations.policy == "full":
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.train()
        self.n_params = count_params(self.model)

        train_seqs = PackedSequences(train_ids, cfg.data.seq_len, "training data")
        eval_seqs = PackedSequences(eval_ids, cfg.data.seq_len, "held-out data")
        self.sampler = BatchSampler(train_seqs, cfg.train.batch_size, cfg.run.seed)
        self.eval_set = eval_batches(eval_seqs, cfg.train.batch_size, cfg.train.eval_batches)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16))
            if cfg.precision.mode == "bf16"
            else contextlib.nullcontext
        )
        self.clip_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf

        self.step = 0
        self.skipped_steps = 0
        if resume_ckpt is not None:
            state = load_checkpoint(resume_ckpt, model=self.model, optimizer=self.optimizer)
            self.step = state["step"]
            self.skipped_steps = state["skipped_steps"]
            self.sampler.load_state_dict(state["sampler"])
            log(f"resumed from {resume_ckpt} at step {self.step}")
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            resume_from_step=self.step if resume_ckpt is not None else None,
        )
        self.tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
        log(
            f"model: {self.model.config.model_type}, {self.n_params / 1e6:.1f}M params, "
            f"vocab {vocab}; {len(train_seqs)} train / {len(eval_seqs)} held-out sequences of "
            f"{cfg.data.seq_len} tokens; device {self.device}; run dir {self.run_dir}"
        )

    # -- pieces of the step -------------------------------------------------------------------

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T)
        with self.autocast():
            logits = self.model(input_ids=inputs).logits  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        accum = self.cfg.train.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(accum):
            batch = self.sampler.next_batch().to(self.device, non_blocking=True)
            loss = self._loss(batch)
            (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm).item()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.skipped_steps += 1  # weights and optimizer state stay untouched
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        step_time_s = time.perf_counter() - t0
        return {
            "step": self.step,
            "loss": loss_sum.item() / accum,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens_per_step / step_time_s,
            "step_time_s": step_time_s,
            "skipped": skipped,
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        total_nll, total_tokens = 0.0, 0
        for batch in self.eval_set:
            batch = batch.to(self.device)
            n = batch[:, 1:].numel()
            total_nll += self._loss(batch).item() * n
            total_tokens += n
        self.model.train()
        eval_loss = total_nll / total_tokens
        return {"step": self.step, "eval_loss": eval_loss, "eval_ppl": math.exp(eval_loss)}

    @torch.no_grad()
    def sample(self, max_new_tokens: int) -> str:
        self.model.eval()
        prompt = self.eval_set[0][:1, :16].to(self.device)
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.run.seed)
        ids = prompt
        for _ in range(max_new_tokens):  # top-k sampling; our own RNG keeps training RNG intact
            logits = self.model(input_ids=ids[:, -self.cfg.data.seq_len :]).logits[0, -1].float()
            top = torch.topk(logits / 0.8, k=min(40, logits.numel()))
            probs = torch.softmax(top.values, dim=-1).cpu()
            choice = top.indices[torch.multinomial(probs, 1, generator=gen).to(self.device)]
            ids = torch.cat([ids, choice.view(1, 1)], dim=1)
        self.model.train()
        return self.tokenizer.decode(ids[0].tolist())

    def save(self) -> Path:
        state = TrainState(
            step=self.step,
            sampler=self.sampler.state_dict(),
            run_config=to_dict(self.cfg),
            skipped_steps=self.skipped_steps,
        )
        return save_checkpoint(
            self.run_dir,
            model=self.model,
            optimizer=self.optimizer,
            tokenizer=self.tokenizer,
            state=state,
        )

    # -- the loop -----------------------------------------------------------------------------

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to `max_steps` (or stop early at `until_step`, leaving a checkpoint there)."""
        cfg = self.cfg.train
        end = cfg.max_steps if until_step is None else min(until_step, cfg.max_steps)
        result = TrainResult(run_dir=self.run_dir)

        def run_eval() -> None:
            rec = self.evaluate()
            self.metrics.write(rec)
            result.eval_ppl[self.step] = rec["eval_ppl"]
            progress.log(f"step {self.step}: held-out loss {rec['eval_loss']:.4f}, "
                         f"perplexity {rec['eval_ppl']:.2f}")

        progress = Progress(cfg.max_steps, self.step)
        try:
            if self.step == 0:
                run_eval()
            while self.step < end:
                rec = self.train_step()
                self.metrics.write(rec)
                result.losses.append(rec["loss"])
                if rec["skipped"]:
                    progress.log(f"step {self.step}: non-finite gradient, step skipped "
                                 f"({self.skipped_steps} so far)")
                progress.update(self.step, rec["loss"], rec["tokens_per_s"])
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != end:
                    run_eval()
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step != end:
                    self.save()
        except KeyboardInterrupt:
            progress.close()
            path = self.save()
            self.log(f"interrupted at step {self.step}; checkpoint {path}; "
                     f"continue with --resume {self.run_dir}")
            raise
        if self.step == cfg.max_steps or cfg.eval_every and self.step % cfg.eval_every == 0:
            run_eval()
        progress.close()
        result.final_checkpoint = self.save()
        result.skipped_steps = self.skipped_steps
        self.metrics.close()
        return result
