"""One ordered build of a training run: `prepare` makes the world, the run directory, the data,
the model, LoRA, the precision policy, compilation, the plan, the stepper (with its gradient
sync, or the FSDP wrapper), the observers and the resume, as one readable sequence of steps (the
shape of torchtitan's `parallelize_llama`), with a comment wherever the order matters.
`build_stepper` is the stepper's step: the single-process stepper (the reference step or the
tiered engine) and what several processes wrap it in. `Trainer` (tierlm.train.trainer) is the
loop over the `Run` it returns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from tierlm.checkpoint import check_tensor_format, check_weight_names, load_checkpoint, resume_point
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
from tierlm.data.batch import trained_targets
from tierlm.data.examples import example_texts, resolve_schema
from tierlm.data.finetune import load_finetune_data
from tierlm.distributed.comm import Comm
from tierlm.distributed.context import ZigzagShare, use_ring_attention
from tierlm.distributed.context_step import ContextParallelStep
from tierlm.distributed.data_parallel import DataParallelStep
from tierlm.distributed.setup import (
    NullMetrics,
    NullMonitor,
    context_ring,
    fsdp_step,
    join_world,
    quiet,
    shard_batches,
)
from tierlm.distributed.strategies import sync_config
from tierlm.distributed.world import World
from tierlm.finetune.lora import prepare_finetune, store_frozen_as_computed
from tierlm.memory.cuda_allocator import configure_cuda_allocator
from tierlm.memory.device import SIM_PREFIX, SimDevice, sim_profile
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import PlacementReport
from tierlm.memory.tiers import Tier
from tierlm.models import build_model, count_params, hf_model_skeleton, load_hf_model, preset_config
from tierlm.models.export import source_dtype as checkpoint_dtype
from tierlm.models.init import preset_skeleton
from tierlm.models.load import CheckpointWeights
from tierlm.monitor.metrics import MetricsLog, build_monitor, check_monitor_deps
from tierlm.monitor.step_trace import build_step_trace, build_tracer
from tierlm.node.client import NodeClient, NodeHello
from tierlm.node.protocol import NodeError
from tierlm.optim import model_state_nbytes
from tierlm.paths import cache_dir
from tierlm.plan.checks import check
from tierlm.plan.inputs import (
    cap_gpu_memory,
    hardware_for,
    memory_node_for,
    predict_for_engine,
    train_shape,
)
from tierlm.plan.policy import auto_plan, offload_policy
from tierlm.plan.predictions import plan_start_lines, predicted_rates
from tierlm.plan.result import Plan
from tierlm.plan.timeline import predicted_timeline
from tierlm.precision import prepare_precision, set_tf32
from tierlm.precision.choice import finetune_precision, resolve_precision
from tierlm.progress import NO_PROGRESS, open_progress
from tierlm.runtime import EngineOptions, build_engine
from tierlm.runtime.compile import ChunkLoss, build_compile, check_compile, sum_cross_entropy
from tierlm.runtime.placement import PlacementPolicy
from tierlm.runtime.reference import ReferenceStep
from tierlm.runtime.shapes import ModelShape
from tierlm.runtime.state import InitialWeights, module_weights
from tierlm.runtime.stepper import Stepper
from tierlm.trace import NO_TRACER, NoTracer, TraceEvent, Tracer
from tierlm.train.node import (
    MemoryNodeError,
    check_node_capacity,
    connect_node,
    node_use_line,
)
from tierlm.train.preflight import Preflight, resolve_offload_dir
from tierlm.train.rundir import OffloadDir, open_run_dir
from tierlm.train.safety import MemoryWatch, check_token_stream, map_large_buffers


@dataclass(kw_only=True, eq=False)  # by identity, as the Trainer over it always was
class Run:
    """What `prepare` builds: everything the loop, the saves and the end of the run read."""

    cfg: Config  # as run: --precision auto resolved, --overwrite cleared once the dir is claimed
    log: Callable[[str], None]  # rank 0's log; the others' is `quiet`
    memory_watch: MemoryWatch
    world: World
    progress: Any  # loading, evaluation, checkpoints, export, sampling: one phase display
    device: torch.device
    precision: str  # fp32 | bf16 | fp8, what --precision auto chose
    run_dir: Path
    run_lock: Any  # rank 0's lock on the run directory; None on the other ranks
    offload: OffloadDir
    tokenizer: Any
    model: torch.nn.Module
    finetune: Any  # --finetune: the adapters' handle (saves RUN_DIR/adapter at the end)
    source_dtype: str  # the checkpoint's dtype, which the export goes back to
    n_params: int
    n_trained: int
    param_names: dict[str, tuple[int, ...]]  # what checkpoints hold: names and shapes
    row_groups: int  # data-parallel row groups: world size over the context-parallel size
    sampler: Any
    eval_set: list[torch.Tensor]
    checkpoint_bytes: int
    fp8: Any  # the precision policy's fp8 state (scales, watch); inert under fp32 and bf16
    compiled: Any
    plan: Plan | None  # auto's plan, or the planner's prediction for the engine's placement
    stepper: Stepper
    step_trace: Any
    step: int  # 0, or the resumed checkpoint's
    metrics: MetricsLog | NullMetrics
    monitor: Any
    tokens_per_step: int  # all ranks together
    predicted: dict[str, float | None]  # the plan's step time and rates, beside each step's
    node: NodeClient | None = None  # the memory node's session (--memory-node), closed at the end


def prepare(cfg: Config, *, log: Callable[[str], None] = print) -> Run:
    """Build the run `cfg` asks for, in order; every check a user can fail comes before the
    work it would waste (a bad --out before the model is loaded, a plan that does not fit
    before the first step). A memory node's session (--memory-node) opened on the way is
    closed if the build fails after it (the node frees the session and takes the next
    trainer); a node that refuses or is lost during the build is one error line."""
    opened: list[NodeClient] = []
    try:
        return _build(cfg, log, opened)
    except BaseException as exc:
        for node in opened:
            node.close()
        if isinstance(exc, NodeError):  # refused (the state does not fit its --memory) or lost
            raise MemoryNodeError(f"{exc} (--remote chooses the segments placed on it)"
                                  ) from None
        raise


def _build(cfg: Config, log: Callable[[str], None], opened: list[NodeClient]) -> Run:
    """`prepare`'s build, in order; the memory node's session, once open, in `opened`."""
    check(cfg)  # every check of the config, the features' included: no way in skips one
    memory_watch = MemoryWatch(log)  # first: it measures what the run adds
    check_monitor_deps(cfg)  # a missing optional dependency fails before any work

    # the world: torchrun's processes, or this one alone
    world = join_world(cfg)
    if not world.is_main:
        log = quiet  # rank 0 logs, writes metrics and checkpoints for the whole run
    progress = open_progress(log) if world.is_main else NO_PROGRESS
    if cfg.train.finetune != "full" and world.distributed:
        raise NotSupportedYet(f"--finetune {cfg.train.finetune} under torchrun",
                              "LoRA runs in one process")

    # the device and the precision
    device = resolve_device(cfg.run.device)
    configure_cuda_allocator(device, log)  # before anything allocates on the device
    cap_gpu_memory(cfg, device)  # --gpu-memory: a large card models a smaller one
    choice = finetune_precision(cfg, resolve_precision(
        cfg.precision, device, None, backend=cfg.distributed.backend,
        compiled=cfg.run.compile != "off", context_parallel=cfg.distributed.context_parallel))
    if choice.why:  # a named precision is logged with the layer table
        log(choice.describe())
    # from here on the run is configured with what auto chose: config.yaml and the
    # checkpoints record it, so a resume elsewhere continues in the same precision
    cfg = replace(cfg, precision=replace(cfg.precision, mode=choice.mode))
    # --compile segments covers fp32 and bf16, LoRA/QLoRA and the runtime's data parallel
    check_compile(cfg, choice.mode)
    precision = choice.mode

    # the run directory: claimed before anything in it is read or written, and before the
    # model is built (an unusable --out is one error line, not a minute of loading)
    run_dir, run_lock, offload, resume_ckpt, cfg = _claim_run_dir(cfg, world, log)
    if world.is_main:
        (run_dir / "config.yaml").write_text(
            (f"# {choice.describe()}\n" if choice.why else "")
            + yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8"
        )
    # the memory node (--memory-node): the session opens once the run directory is claimed,
    # before the model is loaded (an unreachable node or a wrong token costs no loading),
    # and the stepper places state on it; closed at the run's end (run_training)
    node = connect_node(cfg, log)
    if node is not None:
        opened.append(node)

    # the data, then the model: a preset's vocabulary is the tokenizer's
    data = _Data.load(cfg, world, resume_ckpt, log)
    model, initial_weights = _build_model(cfg, world, len(data.tokenizer), progress, log)
    # --finetune lora: peft's adapters on the frozen base (tierlm.finetune.lora); before the
    # precision policy and the stepper, which both see the wrapped modules
    finetune, initial_weights = prepare_finetune(
        cfg.train.finetune, model, cfg.lora, initial_weights, seed=cfg.run.seed,
        base_path=cfg.model.path)
    # the model is trained in fp32 whatever its checkpoint stored; the export goes back to
    # the stored dtype unless --export-dtype says otherwise
    source_dtype = checkpoint_dtype(cfg.model.path) if cfg.model.path else "float32"
    vocab = model.config.vocab_size
    data.check_vocab(vocab)
    model.train()
    n_params = count_params(model)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # names and shapes of what checkpoints hold (a LoRA run's adapters only): a checkpoint
    # of another model size has the same names
    param_names = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}

    # the batches: every rank draws the global batch of all ranks' rows and keeps its own slice
    # (context parallel: the ranks of a CP group share one slice, each takes its share of the
    # tokens)
    train_seqs, eval_seqs = data.sequences(cfg.data.seq_len)
    row_groups = world.size // cfg.distributed.context_parallel
    sampler = shard_batches(
        BatchSampler(train_seqs, cfg.train.batch_size * row_groups, cfg.run.seed),
        world, cfg.distributed.context_parallel,
    )
    eval_set = eval_batches(eval_seqs, cfg.train.batch_size, cfg.train.eval_batches)
    optim_state_bytes = model_state_nbytes(model, cfg.optim)
    checkpoint_bytes = 4 * n_trained + optim_state_bytes  # fp32 masters + state
    preflight = Preflight(cfg, run_dir, n_params=n_params, device_is_cpu=device.type == "cpu",
                          optim_state_bytes=optim_state_bytes,
                          start_rss_bytes=memory_watch.start_rss_bytes, log=log)

    # the precision policy: before the runtime is built (the tiered runtime runs the swapped
    # modules too)
    set_tf32(cfg.precision.tf32, device, log=log)  # what the plan assumed
    fp8 = prepare_precision(model, cfg.precision, precision, device, log=log)
    if cfg.train.finetune != "full":  # a base in RAM held as its bf16 layers read it
        store_frozen_as_computed(model)
    # compilation: after the precision policy (its layers are what the blocks run), before the
    # stepper
    compiled = build_compile(cfg.run.compile, cache_dir() / "inductor", precision)
    compiled.apply(model, log)

    # the plan: --offload-policy as a typed policy (auto: the planner's plan for this model as
    # built, LoRA and precision included)
    hello = None if node is None else node.hello  # the node's memory and measured link
    policy = offload_policy(cfg, model.config, precision, node=hello)
    # the stepper, and what several processes wrap it in
    tracer = build_tracer(cfg, device, world.is_main)
    stepper = build_stepper(cfg, world, model, device, precision, run_dir=run_dir,
                            preflight=preflight, policy=policy,
                            initial_weights=initial_weights, tracer=tracer,
                            chunk_loss=compiled.chunk_loss, node=node)
    plan = auto_plan(policy)
    if plan is None and stepper.engine is not None:  # what the engine's own placement predicts
        plan = predict_for_engine(cfg, model.config, stepper.engine, precision, node=hello)
    if node is not None and stepper.engine is not None:
        log(node_use_line(node, stepper.engine.report))

    # the observers
    step_trace = build_step_trace(
        cfg, tracer, stepper, plan,
        functools.partial(_predicted_step, cfg, model.config, precision, plan, hello), run_dir, log)
    fp8.attach(stepper)  # the monitor's fp8 probe reads it
    memory_watch.trim()  # the model as built went to the runtime
    # a tiered run on a CPU: the device tier is host RAM, its compute buffers torch's heap
    memory_watch.trim_each_step = stepper.engine is not None and device.type == "cpu"
    if memory_watch.trim_each_step and cfg.memory.device_budget:
        # --device-budget on a CPU: the budget is RAM, held by torch's compute buffers too
        map_large_buffers()

    # the training random stream (dropout; peft's lora_dropout) starts from --seed, whatever
    # the build above drew (a --model checkpoint draws nothing, a preset's segments draw as
    # the runtime asks); a resume replaces it with the checkpoint's state
    torch.manual_seed(cfg.run.seed)
    step = 0
    if resume_ckpt is not None:
        step = _resume(resume_ckpt, cfg, world, stepper, sampler, fp8, param_names)
        log(f"resumed from {resume_ckpt} at step {step}")
    # after the resume: metrics.jsonl continues from the resumed step
    metrics = MetricsLog(
        run_dir / "metrics.jsonl", resume_from_step=step if resume_ckpt is not None else None,
    ) if world.is_main else NullMetrics()
    monitor = build_monitor(cfg, stepper, device, run_dir, metrics, log=log, phases=progress
                            ) if world.is_main else NullMonitor()
    tokens_per_step = (  # all ranks together
        cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len * row_groups)
    # the planner times every token; the data decides how many of them have a loss
    share = trained_share(train_seqs)
    predicted = predicted_rates(plan, tokens_per_step, share)
    trained = ("" if n_trained == n_params else
               f" ({n_trained / 1e6:.2f}M trained by --finetune {cfg.train.finetune}, "
               f"{n_trained / n_params:.2%})")
    log(
        f"model: {model.config.model_type}, {n_params / 1e6:.1f}M params{trained}, "
        f"vocab {vocab}; {len(train_seqs)} train / {len(eval_seqs)} held-out sequences of "
        f"{cfg.data.seq_len} tokens; device {device}; "
        f"offload policy {cfg.memory.offload_policy}; run dir {run_dir}"
    )
    if plan is not None:
        for line in plan_start_lines(plan, predicted, share):
            log(line)
    return Run(
        cfg=cfg, log=log, memory_watch=memory_watch, world=world, progress=progress,
        device=device, precision=precision, run_dir=run_dir, run_lock=run_lock, offload=offload,
        tokenizer=data.tokenizer, model=model, finetune=finetune, source_dtype=source_dtype,
        n_params=n_params, n_trained=n_trained, param_names=param_names, row_groups=row_groups,
        sampler=sampler, eval_set=eval_set, checkpoint_bytes=checkpoint_bytes, fp8=fp8,
        compiled=compiled, plan=plan, stepper=stepper, step_trace=step_trace, step=step,
        metrics=metrics, monitor=monitor, tokens_per_step=tokens_per_step, predicted=predicted,
        node=node,
    )


# -- the steps ----


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


def _claim_run_dir(cfg: Config, world: World, log: Callable[[str], None]
                   ) -> tuple[Path, Any, OffloadDir, Path | None, Config]:
    """Rank 0 names the directory (a default one by the clock), then creates, locks and claims
    it (--overwrite clears it here); the other ranks write into the directory rank 0 holds.
    Returns it, rank 0's lock, the offload directory, the checkpoint to resume from, and the
    config as run."""
    resume_dir = cfg.run.resume not in (None, "auto")
    run_dir = world.from_main(
        Path(cfg.run.resume if resume_dir else cfg.run.out) if resume_dir or cfg.run.out
        else default_run_dir(cfg)
    )
    offload_dir = resolve_offload_dir(cfg.memory.offload_dir, run_dir)
    run_lock = open_run_dir(run_dir, cfg, offload_dir, log) if world.is_main else None
    offload = OffloadDir.note(offload_dir, run_dir)  # deleted at a normal end
    # the directory is claimed: config.yaml and the checkpoints record no --overwrite, so
    # that a resume of this run never clears it
    cfg = replace(cfg, run=replace(cfg.run, overwrite=False))
    _, resume_ckpt = world.main_first(lambda: resume_point(cfg.run.resume, cfg.run.out, log))
    return run_dir, run_lock, offload, resume_ckpt, cfg


@dataclass(kw_only=True)
class _Data:
    """The tokenizer and the training text: plain text packed into one token stream (`ids`), or
    examples (chat, prompt/completion, records packed by documents or not at all) carrying a
    loss mask beside their tokens (`finetune`)."""

    tokenizer: Any
    corpus: Any = None
    ids: tuple[Any, Any] | None = None  # train, eval token streams of plain text
    finetune: Any = None

    @classmethod
    def load(cls, cfg: Config, world: World, resume_ckpt: Path | None,
             log: Callable[[str], None]) -> _Data:
        schema = resolve_schema(cfg.data)
        examples = schema.format != "text" or cfg.data.packing != "stream"
        corpus = None if examples else load_corpus(
            cfg.data.train, cfg.data.eval, text_field=cfg.data.text_field,
            eval_fraction=cfg.data.eval_fraction,
        )
        if corpus is not None:
            log(f"data: {corpus.source}")
        trust = cfg.model.trust_remote_code
        if trust:
            log("WARNING: --trust-remote-code: code shipped with the model will run")
        if cfg.model.path:
            tokenizer = load_model_tokenizer(cfg.model.path, trust_remote_code=trust)
        elif resume_ckpt is not None:
            tokenizer = load_model_tokenizer(resume_ckpt)
        else:
            texts = ([d.text for d in corpus.train] if corpus is not None else
                     list(example_texts(cfg.data.train, schema, "--data (data.train)")))
            tokenizer = world.main_first(lambda: load_or_train_tokenizer(
                texts, cfg.data.vocab_size, cache_dir() / "tokenizers"))
        if corpus is None:
            finetune = load_finetune_data(cfg.data, schema, tokenizer)
            for line in finetune.summary:
                log(line)
            if finetune.chat_template is not None:  # checkpoints and the export carry it
                tokenizer.chat_template = finetune.chat_template
            return cls(tokenizer=tokenizer, finetune=finetune)
        tokens = cache_dir() / "tokens"
        train_ids = world.main_first(
            lambda: encode_documents_cached(tokenizer, corpus.train, tokens))
        eval_ids = encode_documents_cached(tokenizer, corpus.eval, tokens)
        return cls(tokenizer=tokenizer, corpus=corpus, ids=(train_ids, eval_ids))

    def check_vocab(self, vocab: int) -> None:
        if self.ids is None:
            self.finetune.check_vocab(vocab)
            return
        eos = self.tokenizer.eos_token_id
        check_token_stream(self.ids[0], vocab, self.corpus.train, eos, "training data")
        check_token_stream(self.ids[1], vocab, self.corpus.eval, eos, "held-out data")

    def sequences(self, seq_len: int) -> tuple[Any, Any]:
        if self.ids is None:
            return self.finetune.train, self.finetune.eval
        return (PackedSequences(self.ids[0], seq_len, "training data"),
                PackedSequences(self.ids[1], seq_len, "held-out data"))


def _build_model(cfg: Config, world: World, vocab_size: int, progress: Any,
                 log: Callable[[str], None]) -> tuple[torch.nn.Module, InitialWeights]:
    """Built on the CPU: the reference step moves it to the device, the tiered runtime moves its
    segments where the placement says. FSDP ranks other than 0 build it on the meta device (no
    memory): they take their shards of rank 0's weights. The tiered runtime reads a
    checkpoint's weights (or initialises a preset's) itself, segment by segment, into a
    skeleton (parameters on meta): the whole model is never in RAM at once."""
    on_meta = cfg.distributed.backend == "fsdp" and world.distributed and not world.is_main
    streamed = runs_engine(cfg, world.distributed)
    trust = cfg.model.trust_remote_code
    if cfg.model.path:
        if not (on_meta or streamed):
            model = load_hf_model(cfg.model.path, device="cpu", trust_remote_code=trust)
            return model, module_weights
        model = hf_model_skeleton(cfg.model.path, trust_remote_code=trust)
        if not streamed:
            return model, module_weights
        # names and shapes checked against the files' headers here
        source = CheckpointWeights(cfg.model.path, model, progress=progress)
        if source.unexpected:
            log(f"checkpoint tensors the model does not use (skipped): "
                f"{', '.join(source.unexpected)}")
        return model, source
    model_cfg = preset_config(cfg.model.size, vocab_size=vocab_size, max_seq_len=cfg.data.seq_len)
    if streamed:  # initialised segment by segment as the runtime asks (models.init)
        return preset_skeleton(model_cfg, seed=cfg.run.seed)
    model = build_model(model_cfg, device="meta" if on_meta else "cpu", seed=cfg.run.seed)
    return model, module_weights


def runs_engine(cfg: Config, distributed: bool) -> bool:
    """Whether the stepper will be the tiered engine (the choice `build_stepper` makes): not
    under FSDP, and either asked for or data parallel (context parallel with the resident
    reference step: only when asked for)."""
    if cfg.distributed.context_parallel > 1:
        return uses_tiered_runtime(cfg)
    return cfg.distributed.backend != "fsdp" and (uses_tiered_runtime(cfg) or distributed)


def build_stepper(
    cfg: Config, world: World, model: torch.nn.Module, device: torch.device, precision: str,
    *, run_dir: Path, preflight: Preflight | None, policy: PlacementPolicy,
    initial_weights: InitialWeights = module_weights, tracer: Tracer | NoTracer = NO_TRACER,
    chunk_loss: ChunkLoss = sum_cross_entropy, node: NodeClient | None = None,
) -> Stepper:
    """The stepper for this world, the order written once: FSDP2 owns the whole model when
    asked for (its reduce-scatter is the gradient sync, dense); otherwise one process gets the
    single-process stepper (`single_stepper`); several processes each get the tiered engine
    (with `--offload-policy none` it keeps everything on the device and reproduces the
    reference trainer exactly), with the sync strategy as the engine's per-segment gradient
    hook, wrapped for what spans ranks. Context parallel (checked at config validation: dense
    sync, not under FSDP) gives every rank a zig-zag share of each row and routes attention
    through the ring: with the tiered runtime the engine takes its share and scales its loss to
    it (the data-parallel dense mean then sums the CP group), else the reference step runs
    under `ContextParallelStep`."""
    single = functools.partial(
        single_stepper, cfg, model, device, run_dir, preflight, precision=precision,
        policy=policy, initial_weights=initial_weights, tracer=tracer, chunk_loss=chunk_loss,
        node=node)
    share = None
    if cfg.distributed.context_parallel > 1:
        layout, ring = context_ring(cfg, world, model, precision)
        if not uses_tiered_runtime(cfg):
            return ContextParallelStep(single(), layout, ring)
        use_ring_attention(model)
        share = ZigzagShare(layout, ring)
    comm = Comm(world.size, Ledger())
    if cfg.distributed.backend == "fsdp":
        return fsdp_step(cfg, world, model, device, precision, comm)
    if not world.distributed:
        return single()
    strategy = sync_config(cfg.distributed, cfg.train.max_steps).build(comm)
    engine = single(grad_sync=strategy, sequence_share=share)
    comm.ledger = engine.ledger  # network bytes land in the engine's ledger, with the rest
    if share is not None:
        share.ring.ledger = engine.ledger
    return DataParallelStep(engine, strategy, world, comm)


def compute_autocast(
    precision: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context every forward of the run computes in (training, evaluation, sampling): bf16
    autocast under bf16 and fp8 (fp8: bf16 activations around the fp8 matmuls), else none. The
    precision policy's layers assume it: outside it a bf16 layer's output meets fp32 ones."""
    if precision in ("bf16", "fp8"):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def single_stepper(
    cfg: Config, model: torch.nn.Module, device: torch.device, run_dir: Path,
    preflight: Preflight | None, *, precision: str, policy: PlacementPolicy,
    grad_sync: object | None = None, initial_weights: InitialWeights = module_weights,
    tracer: Tracer | NoTracer = NO_TRACER, sequence_share: object | None = None,
    chunk_loss: ChunkLoss = sum_cross_entropy, node: NodeClient | None = None,
) -> Stepper:
    """The object that runs one optimizer step in one process: the plain reference step, or the
    tiered runtime when `--offload-policy` is not `none` or the activation policy needs it
    (selective, offload, dynamic, per-segment overrides: the runtime with everything resident),
    or always when data parallel (`grad_sync`, see tierlm.distributed). Both answer the same
    calls. The engine places by `policy` (the planner's `Auto` sets its other choices too),
    takes its initial weights from `initial_weights` (default: the model's parameters) and
    computes the head's chunk losses with `chunk_loss` (--compile segments: the compiled one).
    `node`: the memory node's session, which holds the --remote segments' state."""
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
    mem = cfg.memory
    options = EngineOptions(
        microbatch_order=mem.microbatch_order,
        boundary_tier=Tier(mem.boundary_activations),
        # under --offload-policy auto the plan's choice replaces this (Auto.engine_options)
        speculative_updates=mem.speculative_update == "on",
        resident=mem.resident,
        device_budget_bytes=parse_bytes(mem.device_budget) if mem.device_budget else None,
        # the budget caps the process: the runtime gets what the rest of the run leaves
        host_budget_bytes=preflight.host_budget_bytes() if preflight is not None else (
            parse_bytes(mem.host_budget) if mem.host_budget else None
        ),
        disk_budget_bytes=(parse_bytes(mem.disk_budget, "--disk-budget") if mem.disk_budget
                           else None),
        offload_dir=str(resolve_offload_dir(mem.offload_dir, run_dir)),
        grad_clip=cfg.optim.grad_clip,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len // cfg.distributed.context_parallel,  # this rank's tokens
        micro_batches=cfg.train.grad_accum_steps,
        activations=cfg.activations,
        autocast=autocast,
        check_placement=functools.partial(_check_placement, preflight, node),
        remote=mem.remote,
        node=node,
        base_format=base_format_of(cfg, precision),
        chunk_loss=chunk_loss,
        tracer=tracer,  # the step timeline; armed for --monitor.trace_step
    )
    if grad_sync is not None:
        options.grad_sync = grad_sync
    if sequence_share is not None:  # context parallel: this rank's share of each row
        options.sequence_share = sequence_share
    options = policy.engine_options(options)  # the placement policy's (or the plan's) choices
    profile = sim_profile(cfg.run.device)
    if profile is not None and node is not None:  # the node's link and memory, as planned
        profile = profile.with_overrides(memory_node=memory_node_for(cfg, node.hello))
    engine_device = device if profile is None else SimDevice(
        profile, precision, tf32=cfg.precision.tf32, tracer=tracer)
    return build_engine(model, cfg.optim, options, device=engine_device,
                        initial_weights=initial_weights)


def _check_placement(preflight: Preflight | None, node: NodeClient | None,
                     report: PlacementReport) -> None:
    """The placement's checks before anything is allocated: disk and host memory
    (preflight), and the memory node's capacity for its remote segments."""
    if preflight is not None:
        preflight(report)
    check_node_capacity(report, node)


def _resume(ckpt: Path, cfg: Config, world: World, stepper: Stepper, sampler: Any, fp8: Any,
            param_names: dict[str, tuple[int, ...]]) -> int:
    """Load the checkpoint's weights, optimizer state, sampler position and fp8 scales; its
    step."""
    weights, optim, state = load_checkpoint(ckpt)
    check_tensor_format(ckpt, state, world.size if cfg.distributed.backend == "fsdp" else None)
    check_weight_names(param_names, weights, ckpt)
    stepper.load(weights, optim)
    stepper.skipped_steps = state["skipped_steps"]
    sampler.load_state_dict(state["sampler"])
    fp8_states = state.get("fp8") or [{}]
    fp8.load_state_dict(fp8_states[world.rank] if len(fp8_states) == world.size
                        else fp8_states[0])
    return state["step"]


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


def _predicted_step(cfg: Config, model_config: Any, precision: str, plan: Plan | None,
                    node: NodeHello | None) -> list[TraceEvent]:
    """The plan's simulated step (the replay's steady-state step, op by op), drawn beside the
    measured one in trace.json (`node`: the memory node's handshake, whose link the plan
    priced)."""
    if plan is None:
        return []
    shape = ModelShape.from_config(model_config, optim=cfg.optim, lora=lora_of(cfg),
                                   base_format=base_format_of(cfg, precision),
                                   precision=precision)
    return predicted_timeline(shape, train_shape(cfg, precision), hardware_for(cfg, node=node),
                              plan)
