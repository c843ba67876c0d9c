#!/usr/bin/env python3
"""The same full fine-tune through the Hugging Face Trainer and through tierlm, side by side.

A random-weight Llama checkpoint of SmolLM-135M's shape (30 blocks, hidden 576, 9 heads, 3 KV
heads, intermediate 1536, tied 49,152-token vocabulary) is saved with `save_pretrained` (fp32
safetensors) beside a tokenizer, and trained for `--steps` optimizer steps of `--grad-accum`
micro-batches of `--batch-size` x `--seq-len` tokens (fp32, AdamW, gradient clipping 1.0, a
constant learning rate) by

  hf         transformers' `Trainer` (`use_cpu=True`, fused torch AdamW, no eval, no saving)
  reference  `tierlm train --model DIR --offload-policy none` (the reference trainer)
  host       `tierlm train --model DIR --offload-policy host` (tiered runtime, state in RAM)
  disk       `tierlm train --model DIR --offload-policy disk` (tiered runtime, state in files)
  reference-mallopt  the reference trainer with the process-wide 128 KiB mmap threshold that
             every run paid before issue U (`tierlm.train.safety.map_large_buffers`, which
             now only a CPU tiered run under --device-budget calls; diagnostic row)

Both load the same checkpoint and see the same rows in the same order: tierlm's own data
pipeline (the built-in corpus, or `--data`, through the checkpoint's tokenizer, packed and
drawn by its seeded sampler) picks the rows once here, and the HF Trainer reads them from a
file in that order (sequential sampler); tierlm draws them itself. Each variant runs in its own
subprocess (a fresh RSS) with the same OMP_NUM_THREADS, in rounds (hf reference host disk, hf
reference host disk, ...) so load drift hits every variant alike. A step's time is the wall
time between the ends of consecutive optimizer steps (everything the loop does; the first step
is warm-up and left out); peak RSS is the subprocess's VmHWM at its end.

    python bench/vs_hf_trainer.py                        # the full comparison (minutes)
    python bench/vs_hf_trainer.py --layers 2 --hidden 64 --heads 4 --kv-heads 2 \\
        --intermediate 128 --vocab 1024 --steps 2 --rounds 1   # a smoke run

Weight decay defaults to 0: the HF Trainer decays every parameter but biases and norms (the
tied embedding too), tierlm every matrix but embeddings, so with decay the two would not train
the same model; `--weight-decay` sets it for both anyway.

Results: docs/results/vs-hf-trainer.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GiB = 2**30
VARIANTS = ("hf", "reference", "host", "disk", "reference-mallopt")
POLICY = {"reference": "none", "reference-mallopt": "none", "host": "host", "disk": "disk"}
LABEL = {
    "hf": "Hugging Face Trainer",
    "reference": "tierlm reference (`--offload-policy none`)",
    "reference-mallopt": "tierlm reference, old 128 KiB mmap threshold",
    "host": "tierlm tiered, state in host RAM (`--offload-policy host`)",
    "disk": "tierlm tiered, state on disk (`--offload-policy disk`)",
}
RESULT_PREFIX = "VS_HF_RESULT "
# per-step fields of a worker's result, reported as medians past the first step
SPLIT_KEYS = ("cpu_step_s", "own_step_time_s", "fwd_bwd_s", "optimizer_s", "compute_s",
              "transfer_wait_s", "update_wait_s")


def vm_field_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


# -- setup (parent) ----

def make_checkpoint(args: argparse.Namespace, ckpt: Path) -> dict[str, Any]:
    """Random weights of the requested shape and a tokenizer, as `save_pretrained` writes them;
    returns what the tokenizer is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierlm.data.corpus import load_corpus
    from tierlm.data.tokenizer import load_or_train_tokenizer
    from tierlm.paths import cache_dir

    corpus = load_corpus(args.data, None)
    tok_vocab = min(args.tokenizer_vocab, args.vocab)
    tok = load_or_train_tokenizer([d.text for d in corpus.train], tok_vocab,
                                  cache_dir() / "tokenizers")
    tok.save_pretrained(ckpt)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=2048, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(ckpt)  # safetensors (model.safetensors), the tied head stored once
    n_params = sum(p.numel() for p in model.parameters())
    return {"corpus": corpus.source, "tokenizer_vocab": len(tok), "n_params": n_params}


def make_rows(args: argparse.Namespace, ckpt: Path, out: Path) -> None:
    """The rows tierlm's trainer draws for this run (its corpus, the checkpoint's tokenizer,
    its packing and seeded sampler), in order, saved for the HF Trainer."""
    import torch
    from safetensors.torch import save_file

    from tierlm.data.corpus import load_corpus
    from tierlm.data.packing import BatchSampler, PackedSequences
    from tierlm.data.tokenizer import encode_documents_cached, load_model_tokenizer
    from tierlm.paths import cache_dir

    corpus = load_corpus(args.data, None)
    tok = load_model_tokenizer(str(ckpt))
    ids = encode_documents_cached(tok, corpus.train, cache_dir() / "tokens")
    sampler = BatchSampler(PackedSequences(ids, args.seq_len, "training data"),
                           args.batch_size, args.seed)
    rows = torch.cat([sampler.next_batch() for _ in range(args.steps * args.grad_accum)])
    save_file({"rows": rows.contiguous()}, str(out))


# -- workers (one subprocess each) ----

def hf_worker(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import (
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    rows = load_file(str(work / "rows.safetensors"))["rows"]

    class Rows(torch.utils.data.Dataset):
        # inputs [:-1], targets [1:] as tierlm's rows: seq_len tokens in, seq_len targets.
        # `shift_labels` hands the loss its targets unshifted (labels is what the Trainer and
        # the model look for to compute a loss at all).
        def __len__(self) -> int:
            return rows.shape[0]

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": rows[i, :-1], "labels": rows[i, 1:],
                    "shift_labels": rows[i, 1:]}

    stamps: list[float] = []
    cpu: list[float] = []  # the process's CPU time (all threads) at the same moments
    losses: list[float] = []
    phases: dict[str, list[float]] = {"fwd_bwd_s": [], "optimizer_s": []}
    marks: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_train_begin(self, *_a: Any, **_k: Any) -> None:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_begin(self, *_a: Any, **_k: Any) -> None:
            marks["begin"] = time.perf_counter()

        def on_pre_optimizer_step(self, *_a: Any, **_k: Any) -> None:
            # the micro-batches' forward and backward, and the clipping
            marks["pre"] = time.perf_counter()
            phases["fwd_bwd_s"].append(marks["pre"] - marks["begin"])

        def on_optimizer_step(self, *_a: Any, **_k: Any) -> None:
            phases["optimizer_s"].append(time.perf_counter() - marks["pre"])

        def on_step_end(self, *_a: Any, **_k: Any) -> None:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None,
                   **_k: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    model = AutoModelForCausalLM.from_pretrained(str(work / "ckpt"), dtype=torch.float32)
    targs = TrainingArguments(
        output_dir=str(work / "hf-out"), use_cpu=True, seed=args.seed,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch_fused",
        logging_strategy="steps", logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to=[], disable_tqdm=True, train_sampling_strategy="sequential",
        remove_unused_columns=False, dataloader_num_workers=0, dataloader_pin_memory=False,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(),
                      data_collator=default_data_collator, callbacks=[StepClock()])
    trainer.train()
    return {"step_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
            "cpu_step_s": [b - a for a, b in zip(cpu, cpu[1:], strict=False)],
            "losses": losses, "optimizer": type(trainer.optimizer).__name__, **phases}


def tierlm_worker(args: argparse.Namespace, work: Path, variant: str) -> dict[str, Any]:
    from tierlm import cli
    from tierlm.monitor import metrics as tmonitor
    from tierlm.train import safety
    from tierlm.train.trainer import Trainer


    # measurement only: when each step ended, the trainer (for its plan) and the setup's disk
    # probe (for the disk time the run's own rates predict)
    stamps: list[float] = []
    cpu: list[float] = []  # the process's CPU time (all threads) at the same moments
    seen: dict[str, Any] = {}
    train_step = Trainer.train_step

    def timed_step(self: Trainer) -> dict[str, Any]:
        if not stamps:
            stamps.append(seen.pop("start", time.perf_counter()))
            cpu.append(seen.pop("start_cpu", time.process_time()))
        rec = train_step(self)
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        seen["trainer"] = self
        return rec

    probe = tmonitor.probe_disk_Bps

    def recorded_probe(*a: Any, **k: Any) -> dict[str, float]:
        seen["probe"] = out = probe(*a, **k)
        return out

    # the step-0 evaluation runs between setup and the first step; time step 1 from its end
    evaluate = Trainer.evaluate

    def evaluate_then_start(self: Trainer) -> dict[str, float]:
        out = evaluate(self)
        seen["start"] = time.perf_counter()
        seen["start_cpu"] = time.process_time()
        return out

    run_dir = work / f"run-{variant}"
    argv = [
        "train", "--model", str(work / "ckpt"), "--offload-policy", POLICY[variant],
        "--precision", "fp32", "--opt", "AdamW", "--device", "cpu",
        "--batch-size", str(args.batch_size), "--grad-accum-steps", str(args.grad_accum),
        "--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--lr", str(args.lr),
        "--optim.warmup_steps", "0", "--optim.min_lr_ratio", "1.0",
        "--optim.weight_decay", str(args.weight_decay), "--optim.beta1", "0.9",
        "--optim.beta2", "0.95", "--optim.eps", "1e-8", "--optim.grad_clip", "1.0",
        "--grad-checkpointing", "none", "--eval-every", "0", "--train.eval_batches", "1",
        "--train.sample_tokens", "0", "--train.save_final", "false", "--seed", str(args.seed),
        "--out", str(run_dir), "--overwrite", "--monitor.log_every", "1",
    ]
    if args.data:
        argv += ["--data", args.data]
    if variant == "disk":
        argv += ["--offload-dir", str(work / "offload")]
    # patched for this run only (the smoke test calls this in the test process)
    saved = (Trainer.train_step, Trainer.evaluate, tmonitor.probe_disk_Bps)
    Trainer.train_step = timed_step  # type: ignore[method-assign]
    Trainer.evaluate = evaluate_then_start  # type: ignore[method-assign]
    tmonitor.probe_disk_Bps = recorded_probe
    if variant == "reference-mallopt":  # process-wide: this variant runs in its own process
        safety.map_large_buffers()
    try:
        rc = cli.main(argv)
    finally:
        Trainer.train_step, Trainer.evaluate, tmonitor.probe_disk_Bps = saved
    if rc:
        raise SystemExit(f"tierlm train exited {rc}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step_time_s" in r]
    out: dict[str, Any] = {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "cpu_step_s": [b - a for a, b in zip(cpu, cpu[1:], strict=False)],
        "losses": [r["loss"] for r in steps],
        "own_step_time_s": [r["step_time_s"] for r in steps],
        **{key: [r.get(key) or 0.0 for r in steps]
           for key in ("compute_s", "transfer_wait_s", "update_wait_s")},
        "disk_read_bytes": [r.get("disk_read_bytes") for r in steps],
        "disk_write_bytes": [r.get("disk_write_bytes") for r in steps],
    }
    plan = getattr(seen.get("trainer"), "plan", None)
    if plan is not None:
        out["plan_times_s"] = {k: v for k, v in plan.times_s.items() if isinstance(v, (int, float))}
        out["plan_placement"] = plan.tier_counts()
    if "probe" in seen:
        out["probe_Bps"] = {k: float(v) for k, v in seen["probe"].items()}
    return out


def worker(args: argparse.Namespace) -> None:
    work = Path(args.work)
    t0 = time.perf_counter()
    result = (hf_worker(args, work) if args.worker == "hf"
              else tierlm_worker(args, work, args.worker))
    result.update(variant=args.worker, total_s=time.perf_counter() - t0,
                  peak_rss_bytes=vm_field_bytes("VmHWM"),
                  threads=__import__("torch").get_num_threads())
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# -- the comparison (parent) ----

def run_variant(args: argparse.Namespace, work: Path, variant: str, threads: int,
                log_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--work", str(work)]
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "lr", "weight_decay", "seed"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.data:
        cmd += ["--data", args.data]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = log_dir / f"{variant}.log"
    with log.open("a", encoding="utf-8") as f:
        f.write(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        return {"variant": variant, "error": f"exit {proc.returncode}:\n{tail}"}
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(variant: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"variant": variant, "error": runs[-1]["error"] if runs else "not run"}
    steady = [s for r in ok for s in r["step_s"][1:]]  # the first step is warm-up
    s: dict[str, Any] = {
        "variant": variant, "runs": len(ok),
        "step_s": median(steady),
        # other processes only ever add time: on a shared machine the fastest step is the
        # closest to what the step costs alone
        "min_step_s": min(steady) if steady else float("nan"),
        "round_medians": [median(r["step_s"][1:]) for r in ok],
        "first_step_s": median([r["step_s"][0] for r in ok if r["step_s"]]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
        "loss_first": ok[0]["losses"][0] if ok[0]["losses"] else float("nan"),
        "loss_last": ok[0]["losses"][-1] if ok[0]["losses"] else float("nan"),
        "losses": ok[0]["losses"],
        "threads": ok[0]["threads"],
    }
    # where the time went (medians past the first step): the HF Trainer's forward + backward
    # + clipping and its optimizer step; tierlm's compute, transfer wait and update wait
    for key in SPLIT_KEYS:  # a field some runs lack (an older worker's) comes from the rest
        if any(key in r for r in ok):
            s[key] = median([t for r in ok if key in r for t in r[key][1:]])
    if variant == "disk":
        plan = ok[0].get("plan_times_s") or {}
        s["plan_disk_s"] = plan.get("disk")
        s["plan_step_s"] = plan.get("step")
        s["plan_placement"] = ok[0].get("plan_placement")
        reads = [b for r in ok for b in r["disk_read_bytes"][1:] if b is not None]
        writes = [b for r in ok for b in r["disk_write_bytes"][1:] if b is not None]
        s["disk_read_bytes"] = median(reads) if reads else None
        s["disk_write_bytes"] = median(writes) if writes else None
        probe = ok[0].get("probe_Bps") or {}
        if reads and writes and probe.get("disk_read") and probe.get("disk_write"):
            # the step's disk bytes at the rates the run's own setup probe measured
            s["probe_disk_s"] = (s["disk_read_bytes"] / probe["disk_read"]
                                 + s["disk_write_bytes"] / probe["disk_write"])
            s["probe_Bps"] = probe
    return s


def report(args: argparse.Namespace, summary: dict[str, dict[str, Any]], setup: dict,
           threads: int) -> str:
    out: list[str] = []
    hf = summary.get("hf", {})
    hf_s = hf.get("step_s")
    out.append(f"model: {setup['n_params'] / 1e6:.1f}M parameters ({args.layers} blocks, hidden "
               f"{args.hidden}, {args.heads} heads / {args.kv_heads} KV, intermediate "
               f"{args.intermediate}, tied vocab {args.vocab}); data: {setup['corpus']}, "
               f"tokenizer of {setup['tokenizer_vocab']} tokens; {args.steps} steps of "
               f"{args.grad_accum} x {args.batch_size} x {args.seq_len} tokens; lr {args.lr} "
               f"constant, weight decay {args.weight_decay}, clip 1.0, fp32; "
               f"OMP_NUM_THREADS={threads}; {args.rounds} round(s)")
    out.append("")
    hf_cpu = hf.get("cpu_step_s")
    hf_min = hf.get("min_step_s")
    out.append("| trainer | median step s | vs HF Trainer | fastest step s | vs HF "
               "| CPU s per step | CPU vs HF | first step s | peak RSS GiB | loss step 1 "
               "| loss last step | runs |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in args.variants:
        s = summary[v]
        if "error" in s:
            out.append(f"| {LABEL[v]} | failed: {s['error'].splitlines()[0]} "
                       "| | | | | | | | | | |")
            continue
        ratio = f"{s['step_s'] / hf_s:.2f}x" if hf_s else "n/a"
        cpu_s = s.get("cpu_step_s")
        cpu_ratio = f"{cpu_s / hf_cpu:.2f}x" if cpu_s and hf_cpu else "n/a"
        min_ratio = f"{s['min_step_s'] / hf_min:.2f}x" if hf_min else "n/a"
        out.append(f"| {LABEL[v]} | {s['step_s']:.2f} | {ratio} | {s['min_step_s']:.2f} "
                   f"| {min_ratio} | {_f(cpu_s)} | {cpu_ratio} "
                   f"| {s['first_step_s']:.2f} "
                   f"| {s['peak_rss_bytes'] / GiB:.2f} | {s['loss_first']:.6f} "
                   f"| {s['loss_last']:.6f} | {s['runs']} |")
    out.append("")
    for v in args.variants:
        s = summary[v]
        if "error" in s:
            out.append(f"{v}: FAILED\n{s['error']}")
            continue
        split = ", ".join(f"{k} {s[k]:.2f}" for k in SPLIT_KEYS if k in s)
        extra = f"; split (median s): {split}" if split else ""
        out.append(f"{v}: per-round medians {', '.join(f'{x:.2f}' for x in s['round_medians'])}"
                   f" s{extra}; losses {', '.join(f'{x:.5f}' for x in s['losses'])}")
    disk = summary.get("disk", {})
    if "error" not in disk and "disk" in args.variants:
        rb, wb = disk.get("disk_read_bytes"), disk.get("disk_write_bytes")
        line = (f"disk: placement {disk.get('plan_placement')}; plan predicts step "
                f"{_f(disk.get('plan_step_s'))} s, disk {_f(disk.get('plan_disk_s'))} s "
                "(times_s['disk']: sweep and update on one disk, at the profile's rates)")
        if rb is not None:
            line += f"; moved per step: read {rb / 1e9:.2f} GB, write {wb / 1e9:.2f} GB"
        if disk.get("probe_disk_s") is not None:
            p = disk["probe_Bps"]
            line += (f"; at the run's setup probe (read {p['disk_read'] / 1e9:.2f} GB/s, write "
                     f"{p['disk_write'] / 1e9:.2f} GB/s) that is {disk['probe_disk_s']:.2f} s")
        out.append(line)

    # losses: every trainer starts from the same weights and rows
    firsts = {v: summary[v]["loss_first"] for v in args.variants if "error" not in summary[v]}
    if "hf" in firsts:
        rel = {v: abs(x - firsts["hf"]) / abs(firsts["hf"]) for v, x in firsts.items()
               if v != "hf"}
        out.append("step-1 loss vs HF (relative): " + ", ".join(
            f"{v} {r:.1e}" for v, r in rel.items()) + (
            " (all within 1e-4)" if all(r <= 1e-4 for r in rel.values()) else
            " (NOT all within 1e-4)"))
    out.append("")
    out.append("acceptance (checked, not asserted):")
    out.extend(acceptance(summary))
    return "\n".join(out)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def acceptance(summary: dict[str, dict[str, Any]]) -> list[str]:
    def get(v: str, key: str) -> float | None:
        s = summary.get(v)
        return None if s is None or "error" in s else s.get(key)

    lines = []
    for key, what in (("step_s", "median steps"), ("min_step_s", "fastest steps")):
        lines.append(f"  on the {what}:")
        lines.extend(_time_checks(summary, key, get))
    hf_rss = get("hf", "peak_rss_bytes")
    for v in ("host", "disk"):
        rss = get(v, "peak_rss_bytes")
        verdict = "n/a " if None in (hf_rss, rss) else ("PASS" if rss < hf_rss else "FAIL")
        lines.append(f"  {verdict} {v} peak RSS < HF's: " + (
            "n/a" if None in (hf_rss, rss) else f"{rss / GiB:.2f} GiB vs {hf_rss / GiB:.2f} GiB"))
    return lines


def _time_checks(summary: dict[str, dict[str, Any]], key: str, get: Any) -> list[str]:
    hf, ref, host, disk = (get(v, key) for v in ("hf", "reference", "host", "disk"))
    disk_s = get("disk", "plan_disk_s")
    lines = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        verdict = "n/a " if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"    {verdict} {name}: {detail}")

    check("reference <= 1.05x HF", None if None in (hf, ref) else ref <= 1.05 * hf,
          "n/a" if None in (hf, ref) else f"{ref:.2f} s vs {1.05 * hf:.2f} s ({ref / hf:.2f}x)")
    check("host <= 1.15x HF", None if None in (hf, host) else host <= 1.15 * hf,
          "n/a" if None in (hf, host) else f"{host:.2f} s vs {1.15 * hf:.2f} s "
          f"({host / hf:.2f}x)")
    check("disk <= reference + predicted disk time",
          None if None in (ref, disk, disk_s) else disk <= ref + disk_s,
          "n/a" if None in (ref, disk, disk_s) else
          f"{disk:.2f} s vs {ref:.2f} + {disk_s:.2f} = {ref + disk_s:.2f} s")
    probe_s = get("disk", "probe_disk_s")
    if None not in (ref, disk, probe_s):
        check("  (same, disk time at the run's probe rates)", disk <= ref + probe_s,
              f"{disk:.2f} s vs {ref:.2f} + {probe_s:.2f} = {ref + probe_s:.2f} s")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--tokenizer-vocab", type=int, default=8192,
                   help="BPE trained on the corpus (capped at --vocab); ids stay below --vocab")
    p.add_argument("--data", default=None, help="tierlm --data (default: the built-in corpus)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="hf,reference,host,disk,reference-mallopt",
                   help=f"comma-separated, run in this order each round; of {', '.join(VARIANTS)}")
    p.add_argument("--mallopt-rounds", type=int, default=1,
                   help="rounds that include reference-mallopt (a diagnostic row)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")),
                   help="OMP_NUM_THREADS of every subprocess")
    p.add_argument("--dir", default=None, help="where the temporary directory goes (the disk "
                   "tier's files too; default: the system's temp dir)")
    p.add_argument("--json", default=None, help="also write the summary here")
    p.add_argument("--replay", default=None, help="print the report of a saved --json file "
                   "(its runs) instead of running; pass the shape flags the runs used")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.replay:
        saved = json.loads(Path(args.replay).read_text())
        args.variants = [v for v in args.variants if saved["runs"].get(v)]
        summary = {v: summarise(v, saved["runs"][v]) for v in args.variants}
        print(report(args, summary, saved["setup"], args.threads))
        return

    with tempfile.TemporaryDirectory(prefix="tierlm-vs-hf-", dir=args.dir) as tmp:
        work = Path(tmp)
        (work / "ckpt").mkdir()
        t0 = time.perf_counter()
        setup = make_checkpoint(args, work / "ckpt")
        make_rows(args, work / "ckpt", work / "rows.safetensors")
        print(f"checkpoint and rows ready in {time.perf_counter() - t0:.1f} s "
              f"({setup['n_params'] / 1e6:.1f}M parameters)", flush=True)
        log_dir = work / "logs"
        log_dir.mkdir()
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        for r in range(args.rounds):
            for v in args.variants:
                if v == "reference-mallopt" and r >= args.mallopt_rounds:
                    continue
                t = time.perf_counter()
                res = run_variant(args, work, v, args.threads, log_dir)
                runs[v].append(res)
                what = (f"failed ({res['error'].splitlines()[0]})" if "error" in res else
                        f"median step {median(res['step_s'][1:]):.2f} s, peak RSS "
                        f"{res['peak_rss_bytes'] / GiB:.2f} GiB")
                print(f"round {r + 1}/{args.rounds} {v}: {what} "
                      f"({time.perf_counter() - t:.0f} s)", flush=True)
                if "error" in res:
                    print(res["error"], flush=True)
                if args.json:  # after every run: a run cut short keeps what it measured
                    save_json(Path(args.json), setup, args.variants, runs)
        summary = {v: summarise(v, runs[v]) for v in args.variants}
        print()
        print(report(args, summary, setup, args.threads))
        if args.json:
            save_json(Path(args.json), setup, args.variants, runs)


def save_json(path: Path, setup: dict[str, Any], variants: list[str],
              runs: dict[str, list[dict[str, Any]]]) -> None:
    summary = {v: summarise(v, runs[v]) for v in variants if runs[v]}
    path.write_text(json.dumps({"setup": setup, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
