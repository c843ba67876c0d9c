"""The training loop over a prepared run (tierlm.train.prepare builds it, in order): the step,
evaluation, sampling, checkpoints and the end-of-run prediction report.

The loop is the numerical reference the tiered runtime must reproduce, so it stays simple and
exact: features are resolved once when the run is prepared (autocast context, clipping bound,
checkpointing) and the step calls them unconditionally.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from tierlm.checkpoint import (
    TrainState,
    last_good_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from tierlm.config import Config, to_dict
from tierlm.data.batch import inputs_and_targets, trained_targets
from tierlm.distributed.setup import drain
from tierlm.plan.predictions import (
    SIM_KEYS,
    prediction_lines,
    prediction_record,
    simulated_step_line,
)
from tierlm.train.prepare import Run, prepare
from tierlm.train.safety import (
    DeferredInterrupt,
    NonFiniteGuard,
    all_finite,
    is_storage_failure,
    storage_failure,
)
from tierlm.train.schedule import lr_at

RATE_KEYS = ("step_time_s", "tokens_per_s", "trained_tokens_per_s")


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    eval_ppl: dict[int, float] = field(default_factory=dict)
    skipped_steps: int = 0
    final_checkpoint: Path | None = None


class Trainer(Run):
    """The loop over a run `prepare` built: its attributes are the `Run`'s (the model, the
    stepper, the sampler, the plan, ...), and the loop's own below."""

    def __init__(self, cfg: Config, *, log: Callable[[str], None] = print) -> None:
        run = prepare(cfg, log=log)
        super().__init__(**{f.name: getattr(run, f.name) for f in fields(run)})
        self.nonfinite = NonFiniteGuard(
            self.cfg.train.max_skipped_in_a_row, precision=self.precision,
            grad_clip=self.cfg.optim.grad_clip, save=self.save,
            # each FSDP rank checks its own shard; the save that follows is collective
            weights_finite=lambda: self.world.all_agree(all_finite(self.stepper.state_shards())),
        )
        self._step_rates: list[dict[str, float]] = []  # this process's steps, for the end
        self._sim_steps: list[dict[str, float]] = []  # --device sim:PROFILE's virtual steps

    @property
    def skipped_steps(self) -> int:
        return self.stepper.skipped_steps

    # -- pieces of the step ----

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg.optim, self.cfg.train.max_steps)
        batches = [self.sampler.next_batch() for _ in range(self.cfg.train.grad_accum_steps)]
        out = self.stepper.step(batches, lr)
        self.step += 1
        step_time_s = time.perf_counter() - t0
        # targets the loss trained on, all ranks (rank 0's count times the ranks: masked rows
        # differ a little between ranks); plain text: every target, tokens_per_step
        loss_tokens = sum(trained_targets(b) for b in batches) * self.row_groups
        rec = {
            "step": self.step,
            "loss": out["loss"],
            "lr": lr,
            "grad_norm": out["grad_norm"],
            "tokens_per_s": self.tokens_per_step / step_time_s,  # every token processed
            "trained_tokens_per_s": loss_tokens / step_time_s,  # tokens with a loss
            "loss_tokens": loss_tokens,
            "step_time_s": step_time_s,
            "skipped": out["skipped"],
            **self.predicted,
        }
        self._step_rates.append({k: rec[k] for k in RATE_KEYS})
        for key in ("sweep_s", "compute_s", "update_wait_s", "transfer_wait_s",
                    "kv_send_bytes", "net_send_bytes", *SIM_KEYS):
            if key in out:
                rec[key] = out[key]
        if "sim_step_s" in out:  # --device sim:PROFILE: the step the simulated GPU took
            self._sim_steps.append({k: out[k] for k in SIM_KEYS})
        if self.stepper.ledger is not None:
            rec.update(self.stepper.ledger.snapshot())
        rec.update(self.fp8.end_step(self.step))  # may switch layers to bf16, or stop the run
        rec.update(self.memory_watch.sample())
        rec.update(self.compiled.end_step(rec))
        return rec

    def evaluate(self) -> dict[str, float]:
        total_nll, total_tokens = 0.0, 0
        with (self.fp8.paused(),  # held-out data must not move fp8 scales
              self.progress.phase(f"eval (step {self.step})", len(self.eval_set),
                                  "batches") as phase):
            for batch in self.eval_set:
                n = trained_targets(batch)
                total_nll += self.stepper.eval_loss(batch) * n
                total_tokens += n
                phase.advance()
        eval_loss = total_nll / total_tokens
        # exp overflows past ~709: a diverged run reports an infinite perplexity, not a crash
        ppl = math.exp(eval_loss) if eval_loss < 700 else math.inf
        return {"step": self.step, "eval_loss": eval_loss, "eval_ppl": ppl}

    @torch.no_grad()
    def sample(self, max_new_tokens: int) -> str:
        """Top-k sampling through the stepper's own forward (the tiered runtime streams its
        segments, FSDP gathers collectively on every rank), under the run's precision; our own
        RNG keeps the training RNG intact, and every rank draws the same tokens."""
        ids = inputs_and_targets(self.eval_set[0])[0][:1, :16].cpu()
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.run.seed)
        with self.progress.phase("sampling", max_new_tokens, "tokens") as phase:
            for _ in range(max_new_tokens):
                with self.fp8.paused():  # held-out text must not move fp8 scales
                    logits = self.stepper.next_token_logits(
                        ids[:, -self.cfg.data.seq_len :]).cpu()
                top = torch.topk(logits / 0.8, k=min(40, logits.numel()))
                probs = torch.softmax(top.values, dim=-1)
                choice = top.indices[torch.multinomial(probs, 1, generator=gen)]
                ids = torch.cat([ids, choice.view(1, 1)], dim=1)
                phase.advance()
        return self.tokenizer.decode(ids[0].tolist())

    def save(self) -> Path | None:
        fp8 = self.world.gather_to_main(self.fp8.state_dict())  # collective: before any return
        sharded = self.stepper.save_sharded is not None  # FSDP
        if not self.world.is_main and not sharded:  # the others only take part in the gathers
            drain(self.stepper.state_shards())
            return None
        state = TrainState(
            step=self.step,
            sampler=self.sampler.state_dict(),
            run_config=to_dict(self.cfg),
            skipped_steps=self.skipped_steps,
            fp8=fp8 if fp8 and any(fp8) else None,
            source_dtype=self.source_dtype,
        )
        if sharded:  # every rank writes its own shards (torch.distributed.checkpoint)
            return save_sharded_checkpoint(
                self.run_dir, self.stepper, self.world, model_config=self.model.config,
                tokenizer=self.tokenizer, state=state, keep=self.cfg.run.keep_checkpoints,
                generation_config=getattr(self.model, "generation_config", None),
            )
        # the total is the state's size as set up (the files add headers, RNG, tokenizer)
        with self.progress.phase(f"save checkpoint (step {self.step})",
                                 self.checkpoint_bytes, "bytes") as phase:
            path = save_checkpoint(
                self.run_dir,
                shards=self.stepper.state_shards(),  # one segment in RAM at a time
                model_config=self.model.config,
                tokenizer=self.tokenizer,
                state=state,
                keep=self.cfg.run.keep_checkpoints,
                generation_config=getattr(self.model, "generation_config", None),
                progress=phase,
            )
        self.memory_watch.trim()  # a phase boundary: the save's staging was freed
        return path

    def _report_prediction(self) -> None:
        """Predicted (planner) vs measured (ledger) peak bytes per tier, step time and tokens/s
        (medians of this process's steps, the first left out when there are others: it
        compiles, faults pages in and fills the stream cache), logged and recorded."""
        steps = self._step_rates[1:] or self._step_rates
        measured = {k: statistics.median(r[k] for r in steps) for k in RATE_KEYS} if steps else {}
        if self.plan is None and not measured:
            return  # a resumed run that had no step left to take
        rec = (prediction_record(self.plan, self.stepper.engine, self.step, measured,
                                 self.predicted) if self.plan is not None
               else {"step": self.step, **{f"measured_{k}": v for k, v in measured.items()}})
        self.metrics.write(rec)
        sim = self._sim_steps[1:] or self._sim_steps
        for line in prediction_lines(rec, simulated=bool(sim)):
            self.log(line)
        if sim:  # the first step fills the stream cache: left out where there are others
            self.log(simulated_step_line(self.cfg.run.device, sim, self.plan))

    # -- the loop ----

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to `max_steps` (or stop early at `until_step`, leaving a checkpoint there)."""
        cfg = self.cfg.train
        end = cfg.max_steps if until_step is None else min(until_step, cfg.max_steps)
        result = TrainResult(run_dir=self.run_dir)

        def run_eval() -> None:
            rec = self.evaluate()
            progress.eval(rec)  # metrics.jsonl, TensorBoard, the live view
            result.eval_ppl[self.step] = rec["eval_ppl"]

        progress = self.monitor.start(cfg.max_steps, self.step)
        interrupt = DeferredInterrupt(progress.log)  # Ctrl-C lands between steps
        try:
            if self.step == 0:
                run_eval()
            while self.step < end:
                interrupt.check()
                self.step_trace.before(self.step + 1)
                rec = self.train_step()
                progress.step(rec)  # derived fields, alerts, metrics.jsonl, the live view
                self.step_trace.after(rec)  # --monitor.trace_step: RUN_DIR/trace.json
                self.nonfinite.observe(rec)
                result.losses.append(rec["loss"])
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
        except Exception as exc:
            if not is_storage_failure(exc):
                raise
            progress.close()  # a full or failing disk: stop without touching the checkpoints
            last_good = lambda: last_good_checkpoint(self.run_dir, self.log)  # noqa: E731
            raise storage_failure(exc, self.step, self.run_dir, last_good) from exc
        finally:
            interrupt.restore()
        if self.step == cfg.max_steps or cfg.eval_every and self.step % cfg.eval_every == 0:
            run_eval()
        progress.close()
        self._report_prediction()  # without a plan (reference trainer): the measured rates
        if self.cfg.train.save_final:  # false: a benchmark, which reserved no disk
            result.final_checkpoint = self.save()
        if self.world.is_main:  # --finetune lora: RUN_DIR/adapter in peft's format
            self.finetune.save(self.run_dir, self.stepper.weights)
        result.skipped_steps = self.skipped_steps
        self.metrics.close()
        return result
