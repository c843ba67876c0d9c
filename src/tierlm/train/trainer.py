"""The reference trainer: plain PyTorch, the whole model on one device.

This loop is the numerical reference the tiered runtime must reproduce, so it stays simple and
exact: features are resolved once in `Trainer.__init__` (autocast context, clipping bound,
checkpointing) and the step calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from tierlm.checkpoint import (
    TrainState,
    check_tensor_format,
    check_weight_names,
    last_good_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    save_sharded_checkpoint,
)
from tierlm.config import (
    Config,
    ConfigError,
    NotSupportedYet,
    base_format_of,
    lora_of,
    parse_bytes,
    to_dict,
    uses_tiered_runtime,
)
from tierlm.data import (
    BatchSampler,
    PackedSequences,
    encode_documents_cached,
    eval_batches,
    load_corpus,
    load_model_tokenizer,
    load_or_train_tokenizer,
)
from tierlm.data.batch import inputs_and_targets, trained_targets
from tierlm.data.examples import example_texts, resolve_schema
from tierlm.data.finetune import load_finetune_data
from tierlm.distributed.setup import (
    NullMetrics,
    NullMonitor,
    build_parallel_stepper,
    drain,
    join_world,
    quiet,
    shard_batches,
)
from tierlm.memory.cuda_allocator import configure_cuda_allocator
from tierlm.memory.device import SIM_PREFIX, SimDevice, sim_profile
from tierlm.memory.tiers import Tier
from tierlm.models import (
    build_model,
    count_params,
    hf_model_skeleton,
    load_hf_model,
    preset_config,
)
from tierlm.models.export import source_dtype
from tierlm.models.init import preset_skeleton
from tierlm.models.load import CheckpointWeights
from tierlm.models.lora import prepare_finetune, store_frozen_as_computed
from tierlm.monitor.metrics import MetricsLog, build_monitor, check_monitor_deps
from tierlm.monitor.progress import NO_PROGRESS, open_progress
from tierlm.monitor.step_trace import build_step_trace, build_tracer
from tierlm.monitor.trace import NO_TRACER, NoTracer, TraceEvent, Tracer
from tierlm.optim import model_state_nbytes
from tierlm.paths import cache_dir
from tierlm.plan.checks import check
from tierlm.plan.inputs import (
    cap_gpu_memory,
    finetune_precision,
    hardware_for,
    plan_auto,
    predict_for_engine,
    resolve_precision,
    train_shape,
)
from tierlm.plan.predictions import (
    SIM_KEYS,
    plan_start_lines,
    predicted_rates,
    prediction_lines,
    prediction_record,
    simulated_step_line,
)
from tierlm.plan.result import Plan
from tierlm.plan.timeline import predicted_timeline
from tierlm.precision import prepare_precision, set_tf32
from tierlm.runtime import build_engine
from tierlm.runtime.compile import ChunkLoss, build_compile, check_compile, sum_cross_entropy
from tierlm.runtime.shapes import ModelShape
from tierlm.runtime.state import InitialWeights, module_weights
from tierlm.runtime.stepper import Stepper
from tierlm.train.preflight import Preflight, resolve_offload_dir
from tierlm.train.reference import ReferenceStep
from tierlm.train.rundir import OffloadDir, open_run_dir
from tierlm.train.safety import (
    DeferredInterrupt,
    MemoryWatch,
    NonFiniteGuard,
    all_finite,
    check_token_stream,
    is_storage_failure,
    map_large_buffers,
    storage_failure,
)
from tierlm.train.schedule import lr_at


def resolve_device(name: str) -> torch.device:
    """Where tensors live: a simulated GPU (`sim:PROFILE`) computes on the CPU."""
    if name.startswith(SIM_PREFIX):
        return torch.device("cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device; use --device cpu")
    return torch.device(name)


def default_run_dir(cfg: Config) -> Path:
    name = Path(cfg.model.path).name if cfg.model.path else cfg.model.size
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


RATE_KEYS = ("step_time_s", "tokens_per_s", "trained_tokens_per_s")


def trained_share(seqs: object, rows_at_a_time: int = 4096, max_rows: int = 65536) -> float:
    """The share of the tokens a step processes that carry a loss, over the training sequences:
    1 for plain text; below it where masks (prompts, padding) leave tokens untrained. Over at
    most `max_rows` rows spread evenly across the set (every row of a smaller one): the share
    is for the plan's display, and a pre-training corpus holds millions of rows."""
    if isinstance(seqs, PackedSequences):
        return 1.0
    n = len(seqs)
    rows = torch.arange(n) if n <= max_rows else torch.linspace(0, n - 1, max_rows).long()
    trained = sum(trained_targets(seqs.get(rows[i:i + rows_at_a_time]))
                  for i in range(0, len(rows), rows_at_a_time))
    return trained / max(1, len(rows) * seqs.seq_len)


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    eval_ppl: dict[int, float] = field(default_factory=dict)
    skipped_steps: int = 0
    final_checkpoint: Path | None = None


def compute_autocast(
    precision: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward of the run computes in (training, evaluation, sampling): bf16
    autocast under bf16 and fp8 (fp8: bf16 activations around the fp8 matmuls), else none. The
    precision policy's layers assume it: outside it a bf16 layer's output meets fp32 ones."""
    if precision in ("bf16", "fp8"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def build_stepper(
    cfg: Config,
    model: torch.nn.Module,
    device: torch.device,
    run_dir: Path,
    preflight: Preflight | None = None,
    grad_sync: object | None = None,
    offload_subdir: str = "",
    precision: str = "fp32",
    plan: Plan | None = None,
    initial_weights: InitialWeights = module_weights,
    tracer: Tracer | NoTracer = NO_TRACER,
    sequence_share: object | None = None,
    chunk_loss: ChunkLoss = sum_cross_entropy,
) -> Stepper:
    """The object that runs one optimizer step: the plain reference trainer, or the tiered
    runtime when `--offload-policy` is not `none` or the activation policy needs it (selective,
    offload, dynamic, per-segment overrides: the runtime with everything resident), or always
    when data parallel (`grad_sync`, see tierlm.distributed; each rank's disk tier under
    `offload_subdir`). Both answer the same calls. The engine takes its initial weights from
    `initial_weights` (default: the model's parameters) and computes the head's chunk losses
    with `chunk_loss` (--compile segments: the compiled one)."""
    autocast = compute_autocast(precision, device)
    if not uses_tiered_runtime(cfg) and grad_sync is None:
        if preflight is not None:
            preflight(None)  # disk space for checkpoints; RAM when the device is the CPU
        model.to(device)
        if cfg.activations.policy == "full":
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return ReferenceStep(
            model, cfg.optim, grad_clip=cfg.optim.grad_clip, device=device, autocast=autocast
        )
    from tierlm.runtime import EngineOptions

    mem = cfg.memory
    options = EngineOptions(
        policy=mem.offload_policy,
        microbatch_order=mem.microbatch_order,
        boundary_tier=Tier(mem.boundary_activations),
        resident=mem.resident,
        device_budget_bytes=parse_bytes(mem.device_budget) if mem.device_budget else None,
        # the budget caps the process: the runtime gets what the rest of the run leaves
        host_budget_bytes=preflight.host_budget_bytes() if preflight is not None else (
            parse_bytes(mem.host_budget) if mem.host_budget else None
        ),
        disk_budget_bytes=(parse_bytes(mem.disk_budget, "--disk-budget") if mem.disk_budget
                           else None),
        offload_dir=str(resolve_offload_dir(mem.offload_dir, run_dir) / offload_subdir),
        grad_clip=cfg.optim.grad_clip,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len // cfg.distributed.context_parallel,  # this rank's tokens
        micro_batches=cfg.train.grad_accum_steps,
        activations=cfg.activations,
        autocast=autocast,
        check_placement=preflight or (lambda report: None),
        base_format=base_format_of(cfg, precision),
        chunk_loss=chunk_loss,
    )
    if grad_sync is not None:
        options.grad_sync = grad_sync
    if sequence_share is not None:  # context parallel: this rank's share of each row
        options.sequence_share = sequence_share
    options.tracer = tracer  # the step timeline; armed for --monitor.trace_step
    if plan is not None:  # the planner checked the budgets with its own, finer model
        options.placements = plan.placements
        options.microbatch_order = plan.order
        options.keep_resident_activations = plan.keep_resident_activations
        options.boundary_tier = Tier.HOST if plan.boundary_on_host else Tier.DEVICE
        options.readahead = plan.readahead
        options.writeback = plan.writeback
        if cfg.activations.policy == "none" and not cfg.activations.overrides:
            options.activations = None  # keep or recompute resident segments as planned
        options.device_budget_bytes = options.host_budget_bytes = None
        options.disk_budget_bytes = None
        if cfg.activations.policy == "dynamic":  # without a budget it would keep every graph
            options.activation_budget_bytes = plan.budgets["device"] - plan.device_peak_bytes
    profile = sim_profile(cfg.run.device)
    engine_device = device if profile is None else SimDevice(
        profile, precision, tf32=cfg.precision.tf32, tracer=tracer)
    return build_engine(model, cfg.optim, options, device=engine_device,
                        initial_weights=initial_weights)


def runs_engine(cfg: Config, distributed: bool) -> bool:
    """Whether the stepper will be the tiered engine (the choice `build_parallel_stepper` and
    `build_stepper` make): not under FSDP, and either asked for or data parallel (context
    parallel with the resident reference step: only when asked for)."""
    if cfg.distributed.context_parallel > 1:
        return uses_tiered_runtime(cfg)
    return cfg.distributed.backend != "fsdp" and (uses_tiered_runtime(cfg) or distributed)



def _predicted_step(cfg: Config, model_config: Any, precision: str,
                    plan: Plan | None) -> list[TraceEvent]:
    """The planner's timeline of one step, drawn beside the measured one in trace.json."""
    if plan is None:
        return []
    shape = ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                   base_format=base_format_of(cfg, precision),
                                   precision=precision)
    return predicted_timeline(shape, train_shape(cfg, precision), hardware_for(cfg), plan)

class Trainer:
    def __init__(self, cfg: Config, *, log: Callable[[str], None] = print) -> None:
        check(cfg)  # every check of the config, the features' included: no way in skips one
        self.memory_watch = MemoryWatch(log)  # first: it measures what the run adds
        check_monitor_deps(cfg)  # a missing optional dependency fails before any work
        self.world = join_world(cfg)  # torchrun's processes, or this one alone
        if not self.world.is_main:
            log = quiet  # rank 0 logs, writes metrics and checkpoints for the whole run
        self.log = log
        # loading, evaluation, checkpoints, export, sampling: one progress display, chosen here
        self.progress = open_progress(log) if self.world.is_main else NO_PROGRESS
        if cfg.train.finetune != "full" and self.world.distributed:
            raise NotSupportedYet(f"--finetune {cfg.train.finetune} under torchrun",
                                  "LoRA runs in one process")
        self.device = resolve_device(cfg.run.device)
        configure_cuda_allocator(self.device, log)  # before anything allocates on the device
        cap_gpu_memory(cfg, self.device)  # --gpu-memory: a large card models a smaller one
        choice = finetune_precision(cfg, resolve_precision(
            cfg.precision, self.device, None, backend=cfg.distributed.backend,
            compiled=cfg.run.compile != "off",
            context_parallel=cfg.distributed.context_parallel))
        if choice.why:  # a named precision is logged with the layer table
            log(choice.describe())
        # from here on the run is configured with what auto chose: config.yaml and the
        # checkpoints record it, so a resume elsewhere continues in the same precision
        cfg = replace(cfg, precision=replace(cfg.precision, mode=choice.mode))
        # --compile segments covers fp32 and bf16, LoRA/QLoRA and the runtime's data parallel
        check_compile(cfg, choice.mode)
        self.precision = choice.mode
        # rank 0 names the directory (a default one by the clock), then creates, locks and
        # claims it before anything in it is read or written (--overwrite clears it here); the
        # other ranks write into the directory rank 0 holds
        resume_dir = cfg.run.resume not in (None, "auto")
        self.run_dir = self.world.from_main(
            Path(cfg.run.resume if resume_dir else cfg.run.out) if resume_dir or cfg.run.out
            else default_run_dir(cfg)
        )
        offload_dir = resolve_offload_dir(cfg.memory.offload_dir, self.run_dir)
        self.run_lock = (open_run_dir(self.run_dir, cfg, offload_dir, log)
                         if self.world.is_main else None)
        self.offload = OffloadDir.note(offload_dir, self.run_dir)  # deleted at a normal end
        # the directory is claimed: config.yaml and the checkpoints record no --overwrite, so
        # that a resume of this run never clears it
        cfg = replace(cfg, run=replace(cfg.run, overwrite=False))
        self.cfg = cfg
        _, resume_ckpt = self.world.main_first(
            lambda: resume_point(cfg.run.resume, cfg.run.out, log)
        )
        if self.world.is_main:
            (self.run_dir / "config.yaml").write_text(
                (f"# {choice.describe()}\n" if choice.why else "")
                + yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8"
            )

        schema = resolve_schema(cfg.data)
        # Plain text packs into one stream as it always has; examples (chat, prompt/completion,
        # or any records packed by documents or not at all) carry a loss mask beside their tokens.
        examples = schema.format != "text" or cfg.data.packing != "stream"
        corpus = None if examples else load_corpus(
            cfg.data.train,
            cfg.data.eval,
            text_field=cfg.data.text_field,
            eval_fraction=cfg.data.eval_fraction,
        )
        if corpus is not None:
            log(f"data: {corpus.source}")
        trust = cfg.model.trust_remote_code
        if trust:
            log("WARNING: --trust-remote-code: code shipped with the model will run")
        if cfg.model.path:
            self.tokenizer = load_model_tokenizer(cfg.model.path, trust_remote_code=trust)
        elif resume_ckpt is not None:
            self.tokenizer = load_model_tokenizer(resume_ckpt)
        else:
            texts = ([d.text for d in corpus.train] if corpus is not None else
                     list(example_texts(cfg.data.train, schema, "--data (data.train)")))
            self.tokenizer = self.world.main_first(lambda: load_or_train_tokenizer(
                texts, cfg.data.vocab_size, cache_dir() / "tokenizers"
            ))
        if corpus is None:
            finetune = load_finetune_data(cfg.data, schema, self.tokenizer)
            for line in finetune.summary:
                log(line)
            if finetune.chat_template is not None:  # checkpoints and the export carry it
                self.tokenizer.chat_template = finetune.chat_template
        else:
            tokens = cache_dir() / "tokens"
            train_ids = self.world.main_first(
                lambda: encode_documents_cached(self.tokenizer, corpus.train, tokens))
            eval_ids = encode_documents_cached(self.tokenizer, corpus.eval, tokens)

        # Built on the CPU: the reference step moves it to the device, the tiered runtime
        # moves its segments where the placement says. FSDP ranks other than 0 build it on the
        # meta device (no memory): they take their shards of rank 0's weights. The tiered
        # runtime reads a checkpoint's weights (or initialises a preset's) itself, segment by
        # segment, into a skeleton (parameters on meta): the whole model is never in RAM at once.
        on_meta = (cfg.distributed.backend == "fsdp" and self.world.distributed
                   and not self.world.is_main)
        streamed = runs_engine(cfg, self.world.distributed)
        initial_weights: InitialWeights = module_weights
        if cfg.model.path:
            self.model = (
                hf_model_skeleton(cfg.model.path, trust_remote_code=trust)
                if on_meta or streamed
                else load_hf_model(cfg.model.path, device="cpu", trust_remote_code=trust)
            )
            if streamed:  # names and shapes checked against the files' headers here
                initial_weights = source = CheckpointWeights(cfg.model.path, self.model,
                                                             progress=self.progress)
                if source.unexpected:
                    log(f"checkpoint tensors the model does not use (skipped): "
                        f"{', '.join(source.unexpected)}")
        else:
            model_cfg = preset_config(
                cfg.model.size, vocab_size=len(self.tokenizer), max_seq_len=cfg.data.seq_len
            )
            if streamed:  # initialised segment by segment as the runtime asks (models.init)
                self.model, initial_weights = preset_skeleton(model_cfg, seed=cfg.run.seed)
            else:
                self.model = build_model(model_cfg, device="meta" if on_meta else "cpu",
                                         seed=cfg.run.seed)
        # --finetune lora: peft's adapters on the frozen base (tierlm.models.lora); before the
        # precision policy and the stepper, which both see the wrapped modules
        self.finetune, initial_weights = prepare_finetune(
            cfg.train.finetune, self.model, cfg.lora, initial_weights, seed=cfg.run.seed,
            base_path=cfg.model.path)
        # the model is trained in fp32 whatever its checkpoint stored; the export goes back to
        # the stored dtype unless --export-dtype says otherwise
        self.source_dtype = source_dtype(cfg.model.path) if cfg.model.path else "float32"
        vocab = self.model.config.vocab_size
        eos = self.tokenizer.eos_token_id
        if corpus is None:
            finetune.check_vocab(vocab)
        else:
            check_token_stream(train_ids, vocab, corpus.train, eos, "training data")
            check_token_stream(eval_ids, vocab, corpus.eval, eos, "held-out data")
        self.model.train()
        self.n_params = count_params(self.model)
        self.n_trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        # names and shapes of what checkpoints hold (a LoRA run's adapters only): a checkpoint
        # of another model size has the same names
        self.param_names = {n: tuple(p.shape) for n, p in self.model.named_parameters()
                            if p.requires_grad}

        if corpus is None:
            train_seqs, eval_seqs = finetune.train, finetune.eval
        else:
            train_seqs = PackedSequences(train_ids, cfg.data.seq_len, "training data")
            eval_seqs = PackedSequences(eval_ids, cfg.data.seq_len, "held-out data")
        # every rank draws the global batch of all ranks' rows and keeps its own slice (context
        # parallel: the ranks of a CP group share one slice, each takes its share of the tokens)
        self.row_groups = self.world.size // cfg.distributed.context_parallel
        self.sampler = shard_batches(
            BatchSampler(train_seqs, cfg.train.batch_size * self.row_groups, cfg.run.seed),
            self.world, cfg.distributed.context_parallel,
        )
        self.eval_set = eval_batches(eval_seqs, cfg.train.batch_size, cfg.train.eval_batches)
        optim_state_bytes = model_state_nbytes(self.model, cfg.optim)
        self.checkpoint_bytes = 4 * self.n_trained + optim_state_bytes  # fp32 masters + state
        preflight = Preflight(cfg, self.run_dir, n_params=self.n_params,
                              device_is_cpu=self.device.type == "cpu",
                              optim_state_bytes=optim_state_bytes,
                              start_rss_bytes=self.memory_watch.start_rss_bytes, log=log)
        set_tf32(cfg.precision.tf32, self.device, log=log)  # what the plan assumed
        # before the runtime is built: the tiered runtime runs the swapped modules too
        self.fp8 = prepare_precision(self.model, cfg.precision, self.precision, self.device,
                                     log=log)
        if cfg.train.finetune != "full":  # a base in RAM held as its bf16 layers read it
            store_frozen_as_computed(self.model)
        # after the precision policy (its layers are what the blocks run), before the stepper
        self.compiled = build_compile(cfg.run.compile, cache_dir() / "inductor", self.precision)
        self.compiled.apply(self.model, log)
        auto = (
            plan_auto(cfg, self.model.config, self.precision)
            if cfg.memory.offload_policy == "auto"
            else None
        )
        tracer = build_tracer(cfg, self.device, self.world.is_main)
        self.stepper = build_parallel_stepper(
            cfg, self.world, self.model, self.device, self.precision,
            functools.partial(build_stepper, cfg, self.model, self.device, self.run_dir, preflight,
                              precision=self.precision, plan=auto,
                              initial_weights=initial_weights, tracer=tracer,
                              chunk_loss=self.compiled.chunk_loss),
        )
        self.plan = auto
        if self.plan is None and self.stepper.engine is not None:
            self.plan = predict_for_engine(cfg, self.model.config, self.stepper.engine,
                                           self.precision)
        self.step_trace = build_step_trace(
            cfg, tracer, self.stepper, self.plan,
            functools.partial(_predicted_step, cfg, self.model.config, self.precision, self.plan),
            self.run_dir, log)
        self.fp8.attach(self.stepper)  # the monitor's fp8 probe reads it
        self.memory_watch.trim()  # the model as built went to the runtime
        # a tiered run on a CPU: the device tier is host RAM, its compute buffers torch's heap
        self.memory_watch.trim_each_step = (self.stepper.engine is not None
                                            and self.device.type == "cpu")
        if self.memory_watch.trim_each_step and cfg.memory.device_budget:
            # --device-budget on a CPU: the budget is RAM, held by torch's compute buffers too
            map_large_buffers()
        self.nonfinite = NonFiniteGuard(
            cfg.train.max_skipped_in_a_row, precision=self.precision,
            grad_clip=cfg.optim.grad_clip, save=self.save,
            # each FSDP rank checks its own shard; the save that follows is collective
            weights_finite=lambda: self.world.all_agree(all_finite(self.stepper.state_shards())),
        )

        # the training random stream (dropout; peft's lora_dropout) starts from --seed, whatever
        # the build above drew (a --model checkpoint draws nothing, a preset's segments draw as
        # the runtime asks); a resume replaces it with the checkpoint's state below
        torch.manual_seed(cfg.run.seed)
        self.step = 0
        if resume_ckpt is not None:
            weights, optim, state = load_checkpoint(resume_ckpt)
            check_tensor_format(resume_ckpt, state, self.world.size
                                if cfg.distributed.backend == "fsdp" else None)
            check_weight_names(self.param_names, weights, resume_ckpt)
            self.stepper.load(weights, optim)
            self.step = state["step"]
            self.stepper.skipped_steps = state["skipped_steps"]
            self.sampler.load_state_dict(state["sampler"])
            fp8 = state.get("fp8") or [{}]
            self.fp8.load_state_dict(fp8[self.world.rank] if len(fp8) == self.world.size
                                     else fp8[0])
            log(f"resumed from {resume_ckpt} at step {self.step}")
        self.metrics = MetricsLog(
            self.run_dir / "metrics.jsonl",
            resume_from_step=self.step if resume_ckpt is not None else None,
        ) if self.world.is_main else NullMetrics()
        self.monitor = build_monitor(cfg, self.stepper, self.device, self.run_dir, self.metrics,
                                     log=log, phases=self.progress
                                     ) if self.world.is_main else NullMonitor()
        self.tokens_per_step = (  # all ranks together
            cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len * self.row_groups
        )
        # the planner times every token; the data decides how many of them have a loss
        share = trained_share(train_seqs)
        self.predicted = predicted_rates(self.plan, self.tokens_per_step, share)
        self._step_rates: list[dict[str, float]] = []  # this process's steps, for the end
        self._sim_steps: list[dict[str, float]] = []  # --device sim:PROFILE's virtual steps
        trained = ("" if self.n_trained == self.n_params else
                   f" ({self.n_trained / 1e6:.2f}M trained by --finetune {cfg.train.finetune}, "
                   f"{self.n_trained / self.n_params:.2%})")
        log(
            f"model: {self.model.config.model_type}, {self.n_params / 1e6:.1f}M params{trained}, "
            f"vocab {vocab}; {len(train_seqs)} train / {len(eval_seqs)} held-out sequences of "
            f"{cfg.data.seq_len} tokens; device {self.device}; "
            f"offload policy {cfg.memory.offload_policy}; run dir {self.run_dir}"
        )
        if self.plan is not None:
            for line in plan_start_lines(self.plan, self.predicted, share):
                log(line)

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
        for line in prediction_lines(rec):
            self.log(line)
        sim = self._sim_steps[1:] or self._sim_steps
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
