"""The planner: a pure function from (model shapes, hardware profile, training shape) to a plan.

It chooses, under the device/host/disk budgets less a safety margin:
- which segments keep their compute weights on the device, and which of those keep their whole
  state (master, gradient, the optimizer's state slots) there;
- where every other segment's state lives (host RAM, spilling the last blocks to disk first,
  since their update is needed last by the next step's forward);
- whether resident segments keep their forward graph (no recompute) or recompute too;
- the micro-batch order;
and predicts the peak bytes per tier and the step time (compute, H2D/D2H, disk, CPU update, the
context-parallel ring's sends, with overlap as the runtime does it), naming the bottleneck.

Memory is predicted by running the runtime's own step walk (tierlm.runtime.walk), schedule and
cache policy over byte counts (`_simulate`), so the prediction follows the runtime's allocation
pattern rather than a formula that could drift from it. Activation workspace (tensors autograd
saves inside a segment) is measured once per model shape by running one block on the meta
device under `saved_tensors_hooks`: exact shapes, no memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tierlm.memory.arena import ArenaReplay
from tierlm.memory.hardware import GiB, HardwareProfile
from tierlm.memory.ledger import Ledger
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    STAGING_SETS,
    KeepGraphs,
    SegmentPlacement,
    chunk_ranges,
    gib,
    keeps_graph,
    staging_numel,
    update_staging_bytes,
)
from tierlm.memory.tiers import Link, TensorClass, Tier
from tierlm.runtime.schedule import grad_landing, transient_grad
from tierlm.runtime.writeback import DEFAULT_WRITEBACK, WriteBack

if TYPE_CHECKING:
    from tierlm.runtime.readahead import ReadAhead

SAFETY_MARGIN = 0.10  # of each budget, left free for fragmentation, the CUDA context, kernels
GPU_RESERVE_BYTES = 1 * GiB  # CUDA context + cuBLAS/cuDNN workspaces, outside the margin
MATMUL_EFFICIENCY = 0.45  # achieved / peak matmul rate for transformer blocks (typical MFU)
COPY_EFFICIENCY = 0.9  # pinned copies reach ~90% of the profile's practical rate


# -- inputs ----------------------------------------------------------------------------------



@dataclass(frozen=True)
class ModelShape:
    """What the planner knows about a model: from a meta-device build, no memory."""

    names: list[str]
    numels: list[int]
    tied_numel: int  # the head's borrowed (tied) weight, owned by `embed`; 0 if untied
    hidden_size: int
    vocab_size: int
    n_layers: int
    block_saved_bytes_per_token: float  # autograd-saved bytes inside one block, per token, fp32
    head_chunk_tokens: int
    # per segment, the optimizer's state bytes (tierlm.optim.flat: its slots over the segment's
    # flat layout), the optimizer's name, and whether it updates whole segments only (align 0)
    optim_state_bytes: list[int]
    optim_name: str = "AdamW"
    optim_whole: bool = False
    # the optimizer's CPU update time per parameter relative to fused fp32 AdamW's
    optim_cpu_cost: float = 1.0
    # the optimizer's config (a tierlm.config.OptimConfig; None: the default), which the
    # replay in virtual time builds the optimizer's slots and update chunks from
    optim_config: Any = field(default=None, compare=False, repr=False)
    # per segment, the entries of its 2-D weights (the matmuls a precision policy lowers to
    # bf16 or fp8; the rest, norms and biases, stays fp32); None: every entry
    matrix_numels: list[int] | None = None
    # per segment, how many 2-D weights (an fp8 compute copy carries one fp32 scale for each)
    matrix_counts: list[int] | None = None
    # --finetune lora: the segments are a frozen base (master bytes only: no gradient, no
    # optimizer state, never updated or written back) and the trained adapters, `trained_numel`
    # parameters with `trained_optim_bytes` of optimizer state, live on the device
    frozen: bool = False
    trained_numel: int = 0
    trained_optim_bytes: int = 0
    lora: Any = None  # its tierlm.config.LoraConfig
    # --finetune qlora, or lora under bf16: per segment, the bytes of its frozen base's own
    # copy (tierlm.models.frozen: the adapted layers' weights in NF4, or the blocks' linear
    # weights in bf16; the rest fp32), which is all its state and the copy it streams in; None
    # where a segment has none (its base is an fp32 master)
    base_bytes: list[int | None] | None = None
    # per segment, the most bytes one matmul decodes an NF4 weight into (its largest target
    # weight, fp32 or bf16 under bf16, and the decode's temporaries), outside the ledger
    base_decoded_bytes: list[int] | None = None
    # per segment, the NF4 weights its matmuls decode (each forward, backward and recompute)
    base_nf4_numels: list[int] | None = None
    # the model's config, to measure what one block saves under bf16 and fp8 (None: half the
    # fp32 bytes)
    model_config: Any = field(default=None, compare=False, repr=False)
    # K/V heads and their width, what the context-parallel ring passes (0: as many heads as
    # the queries, hidden_size wide in all)
    kv_heads: int = 0
    head_dim: int = 0
    # per segment, its parameters as (name, numel) in the engine's order (what top-k sync picks
    # its ratios by), and the entries of each of its optimizer state slots (what delayed sync
    # averages); None: unknown (one unnamed parameter per segment, no slots)
    param_numels: list[tuple[tuple[str, int], ...]] | None = field(default=None, repr=False)
    optim_slot_numels: list[tuple[int, ...]] | None = field(default=None, repr=False)
    # per segment, its compute copy's bytes as the engine lays it out (tierlm.precision.streaming:
    # each entry padded to 16 bytes), in the run's precision, where the shape is made from the
    # engine's own parts (tierlm.runtime.pinned); None: estimated from the precision
    copy_bytes: list[int | None] | None = field(default=None, repr=False)

    @property
    def n_params(self) -> int:
        return sum(self.numels)

    def saved_bytes_per_token(self, precision: str) -> float:
        """What one block's forward saves for its backward, per token, under `precision`."""
        if precision == "fp32" or self.model_config is None:
            return self.block_saved_bytes_per_token * (1 if precision == "fp32" else 0.5)
        return block_saved_bytes_per_token(self.model_config, precision)


    def state_bytes(self, s: int) -> int:
        """Segment `s`'s master, gradient and optimizer state: what its state tier holds."""
        if self.frozen:
            # a base held in its own copy: counted as its compute copy (wire_bytes)
            return 0 if self.base_copy(s) is not None else MASTER_B * self.numels[s]
        return (MASTER_B + GRAD_B) * self.numels[s] + self.optim_state_bytes[s]

    def update_state_bytes(self, s: int) -> int:
        """Segment `s`'s master and optimizer slots: what its update rewrites (and what the
        read-ahead reads)."""
        return MASTER_B * self.numels[s] + (0 if self.frozen else self.optim_state_bytes[s])

    def update_disk_bytes(self, s: int, compute_copy: int | None, *, host_grad: bool = False,
                          read_ahead: bool = False) -> tuple[int, int]:
        """Disk bytes (read, written) by one update of segment `s` on the disk tier: master,
        gradient and slots read (not the gradient where it waits on the host, not master and
        slots where the read-ahead brought them during the backward); master and slots written
        back, and its compute copy."""
        if self.frozen:
            return 0, 0
        written = self.update_state_bytes(s) + (compute_copy or 0)
        read = (0 if read_ahead else self.update_state_bytes(s)) + (
            0 if host_grad else GRAD_B * self.numels[s])
        return read, written

    def update_staging(self, s: int, compute_copy: int | None,
                       chunk_numel: int = STAGING_CHUNK_NUMEL, *, host_grad: bool = False,
                       read_ahead: bool = False) -> int:
        """Host staging of segment `s`'s disk-tier update beyond what is already in RAM (a
        gradient held on the host; master and slots read ahead): in chunks, or whole where it
        has a compute copy to encode (fp8 scales need whole tensors) or the optimizer needs
        it."""
        if self.frozen:
            return 0
        staged = self.state_bytes(s) - (GRAD_B * self.numels[s] if host_grad else 0) - (
            self.update_state_bytes(s) if read_ahead else 0)
        return update_staging_bytes(self.numels[s], staged, compute_copy,
                                    whole=self.optim_whole, chunk_numel=chunk_numel)

    def base_copy(self, s: int) -> int | None:
        """Segment `s`'s frozen base copy bytes (NF4 or bf16; None: an fp32 master)."""
        return None if self.base_bytes is None else self.base_bytes[s]

    @classmethod
    def from_config(cls, config: Any, *, probe_tokens: int = 256, optim: Any = None,
                    lora: Any = None, base_format: str = "fp32",
                    precision: str = "fp32") -> ModelShape:
        """`optim`: the run's tierlm.config.OptimConfig (None: the default, AdamW); `lora`:
        its tierlm.config.LoraConfig under --finetune lora or qlora (None: full fine-tuning);
        `base_format`: how its frozen base is held (tierlm.config.base_format_of: fp32, bf16
        or nf4); `precision`: what it computes in (an NF4 base is decoded to it)."""
        from tierlm.config import OptimConfig
        from tierlm.memory.layout import FlatLayout
        from tierlm.models import build_model
        from tierlm.models.adapters import ModelAdapter
        model = build_model(config, device="meta")
        adapter = ModelAdapter(model)
        segs = adapter.segments
        names = [s.name for s in segs]
        numels = [sum(p.numel() for _, p, _ in s.params) for s in segs]
        layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params]) for s in segs]
        tied = sum(
            p.numel() for n, p, _ in segs[0].params if n in getattr(segs[-1], "borrowed", {})
        )
        saved = block_saved_bytes_per_token(config, "fp32", probe_tokens)
        trained = _lora_layout(model, lora) if lora is not None else None
        base, decoded, nf4_numels = (
            _base_bytes(model, layouts, lora, base_format, precision)
            if lora is not None and base_format != "fp32" else (None, None, None))
        return cls(
            base_bytes=base,
            base_decoded_bytes=decoded,
            base_nf4_numels=nf4_numels,
            lora=lora,
            frozen=trained is not None,
            trained_numel=trained.numel if trained else 0,
            names=names,
            numels=numels,
            tied_numel=tied,
            hidden_size=model.config.hidden_size,
            vocab_size=model.config.vocab_size,
            n_layers=len(segs) - 2,
            block_saved_bytes_per_token=saved,
            model_config=config,
            head_chunk_tokens=max(1, (1 << 24) // model.config.vocab_size),
            **optimizer_fields(layouts, optim or OptimConfig(), trained),
            matrix_numels=[sum(p.numel() for _, p, _ in sg.params if p.ndim == 2)
                           for sg in segs],
            matrix_counts=[sum(p.ndim == 2 for _, p, _ in sg.params) for sg in segs],
            param_numels=[tuple((n, p.numel()) for n, p, _ in sg.params) for sg in segs],
            **_kv_shape(model.config),
        )

    def with_optimizer(self, config: Any, optim: Any) -> ModelShape:
        """This shape under another optimizer (`optim`: an OptimConfig) for the same model
        `config`: only the optimizer's fields differ."""
        from tierlm.memory.layout import FlatLayout
        from tierlm.models import build_model
        from tierlm.models.adapters import ModelAdapter

        model = build_model(config, device="meta")
        segs = ModelAdapter(model).segments
        layouts = [FlatLayout([(n, tuple(p.shape), d) for n, p, d in s.params]) for s in segs]
        trained = _lora_layout(model, self.lora) if self.lora is not None else None
        return dataclasses.replace(self, **optimizer_fields(layouts, optim, trained))

    def wire_bytes(self, s: int, precision: str) -> int | None:
        """Bytes of segment `s`'s compute copy, the form its weights are kept in (host RAM or
        a disk file), cross to the device in and are held there in when its state is off the
        device (tierlm.precision.streaming): block matmul weights in bf16 (2 bytes) or fp8 (1
        byte + a scale), norms and biases in fp32 (the runtime's padding of each entry to 16
        bytes aside). None where the fp32 master itself is used: fp32 runs, and the embeddings and
        head (sensitive, fp32). A frozen base held in its own copy: that copy's bytes."""
        if self.base_copy(s) is not None:
            return self.base_copy(s)
        if self.copy_bytes is not None:
            return self.copy_bytes[s]
        if precision not in ("bf16", "fp8") or s in (0, len(self.numels) - 1):
            return None
        n = self.numels[s]
        mat = n if self.matrix_numels is None else self.matrix_numels[s]
        if precision == "bf16":
            return 2 * mat + 4 * (n - mat)
        scales = 0 if self.matrix_counts is None else 4 * self.matrix_counts[s]
        return mat + scales + 4 * (n - mat)


def _kv_shape(cfg: Any) -> dict[str, int]:
    """A transformers config's K/V heads and head width (GPT-2 names them its own way)."""
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"kv_heads": getattr(cfg, "num_key_value_heads", None) or heads, "head_dim": head_dim}


def optimizer_fields(layouts: list, optim: Any, trained: Any = None) -> dict[str, Any]:
    """ModelShape's optimizer fields for segments with these flat layouts under `optim`
    (`trained`: a LoRA run's adapters' flat layout, whose state is all the optimizer holds)."""
    from tierlm.optim import build_flat_optimizer

    optimizer = build_flat_optimizer(optim)
    return {"optim_state_bytes": [optimizer.state_nbytes(lay) for lay in layouts],
            "optim_name": optimizer.name, "optim_whole": optimizer.align == 0,
            "optim_cpu_cost": optimizer.cpu_cost, "optim_config": optim,
            "optim_slot_numels": [tuple(s.numel(lay) for s in optimizer.slots)
                                  for lay in layouts],
            "trained_optim_bytes": optimizer.state_nbytes(trained) if trained else 0}


def _lora_layout(model, lora):
    """The flat layout of the adapters `apply_lora` would add: (r, in) and (out, r) per target
    (matrices: they decay, as AdamW's grouping gives them)."""
    from tierlm.memory.layout import FlatLayout
    from tierlm.models.lora import lora_targets
    from tierlm.precision.policy import linear_dims

    modules = dict(model.named_modules())
    shapes = []
    for name in lora_targets(model, lora.targets):
        d_in, d_out = linear_dims(modules[name])
        shapes += [(f"{name}.lora_A", (lora.rank, d_in), True),
                   (f"{name}.lora_B", (d_out, lora.rank), True)]
    return FlatLayout(shapes)


def _base_bytes(model, layouts, lora, base_format: str,
                precision: str) -> tuple[list[int | None], list[int], list[int]]:
    """Per segment, the bytes tierlm.models.frozen.FrozenBase holds its base in (None for a
    segment it leaves an fp32 master) and the most bytes one matmul decodes a weight into (the
    largest target's, with the decode's temporaries: tierlm.models.nf4.NF4Linear): NF4 for the
    targets' weights (a multiple of 64 elements), or bf16 for every linear weight the default
    precision policy computes in bf16 (the blocks'), fp32 for the rest; and the NF4 weights
    each segment holds."""
    from tierlm.config import PrecisionConfig
    from tierlm.models.lora import lora_targets
    from tierlm.models.nf4 import BLOCK, NF4Format
    from tierlm.precision.policy import classify
    from tierlm.precision.streaming import ComputeFormat

    params = dict(model.named_parameters())
    kind_of: dict[str, str] = {}
    if precision == "bf16":  # what slot_kinds reads off the precision layers, by name
        for c in classify(model, PrecisionConfig(mode="bf16"), "bf16"):
            if c.is_linear and c.compute == "bf16":
                kind_of.update({f"{c.name}.weight": "bf16", f"{c.name}.bias": "bf16"})
    base, decoded, nf4_numels = [], [], []
    for lay in layouts:
        kinds = [kind_of.get(s.name, "fp32") for s in lay.slots]
        compute = ComputeFormat(lay, kinds).nbytes if "bf16" in kinds else 4 * lay.numel
        if base_format == "nf4":
            quantised = {f"{t}.weight" for t in lora_targets(model, lora.targets)}
            quantised = {n for n in quantised if n in params and params[n].numel() % BLOCK == 0}
            nf4 = {s.name for s in lay.slots} & quantised
            fmt = NF4Format(lay, quantised, kinds)
            base.append(fmt.nbytes if nf4 else None)
            decoded.append(fmt.decoded_nbytes)  # one matmul's weight: NF4Linear decodes per call
            nf4_numels.append(sum(s.numel for s in lay.slots if s.name in nf4))
        else:
            base.append(compute if "bf16" in kinds else None)
            decoded.append(0)
            nf4_numels.append(0)
    return base, decoded, nf4_numels


def _fake_block_saved_bytes(config: Any, precision: str, tokens: int) -> int:
    """Bytes autograd saves for one block's forward over `tokens` tokens under `precision`,
    counted as the runtime counts them (tierlm.activations.saved): per storage, without the
    segment's weights, its boundary input and the micro-batch context (rotary tables, masks),
    which the step holds anyway. The block runs on fake CPU tensors (shapes and dtypes, no
    memory), so SDPA takes the fused kernel the runtime takes (it saves q, k, v, the output and
    a (B, H, S) log-sum-exp: linear in the sequence; on the meta device it would take the math
    path and save the (B, H, S, S) softmax), and bf16 autocast and the precision policy's
    layers cast as they do in the run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tierlm.config import PrecisionConfig
    from tierlm.models import build_model
    from tierlm.models.adapters import ModelAdapter, StepContext
    from tierlm.precision import prepare_precision

    model = build_model(config, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if precision != "fp32":
            prepare_precision(model, PrecisionConfig(mode=precision), precision,
                              torch.device("cpu"), log=lambda line: None)
        seg = ModelAdapter(model).segments[1]
        views = {n: p for n, p, _ in seg.params}
        x = torch.empty(1, tokens, model.config.hidden_size, requires_grad=True)
        pos = torch.arange(tokens).unsqueeze(0)
        pe = None
        if hasattr(model, "model") and hasattr(model.model, "rotary_emb"):
            pe = model.model.rotary_emb(x, position_ids=pos)
        ctx = StepContext(position_ids=pos, masks={"full_attention": None,
                                                   "sliding_attention": None},
                          position_embeddings=pe)

        def key(t: torch.Tensor) -> int:  # one storage, however many views of it are saved
            return t.untyped_storage()._cdata

        skip = {key(p) for p in views.values()} | {key(x), key(pos)} | {
            key(t) for t in (pe or ()) if isinstance(t, torch.Tensor)}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.numel() and key(t) not in skip:
                seen[key(t)] = t.untyped_storage().nbytes()
            return t

        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32"
                    else contextlib.nullcontext())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            out = seg.forward(views, x, ctx)
        del out
    return sum(seen.values())


@functools.lru_cache(maxsize=32)
def _saved_per_token_cached(config_json: str, precision: str, tokens: int) -> float:
    return _saved_bytes_per_token(_CONFIGS[config_json], precision, tokens)


_CONFIGS: dict[str, Any] = {}  # the cache's key -> the config it was made from


def _saved_bytes_per_token(config: Any, precision: str, tokens: int) -> float:
    """One block's saved bytes per token: the slope between `tokens` and twice as many, which
    leaves out what does not grow with the sequence (under bf16 and fp8, the casts of fp32
    weights: a compute copy of the run's own precision has none)."""
    short = _fake_block_saved_bytes(config, precision, tokens)
    return (_fake_block_saved_bytes(config, precision, 2 * tokens) - short) / tokens


def block_saved_bytes_per_token(config: Any, precision: str, tokens: int = 128) -> float:
    """`_saved_bytes_per_token`, remembered per (model config, precision)."""
    key = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
    _CONFIGS[key] = config
    return _saved_per_token_cached(key, precision, tokens)


@dataclass(frozen=True)
class TrainShape:
    batch_size: int
    seq_len: int  # tokens of each row this rank holds (context parallel: the row's 1/N share)
    micro_batches: int
    precision: str = "fp32"  # compute precision: fp32 or bf16 (autocast)
    context_parallel: int = 1  # ranks sharing each row: its queries attend to N x seq_len keys
    compiled: bool = False  # --compile segments: the blocks run compiled
    # ranks holding one copy of the weights, which sync their gradients (data parallel x
    # context parallel: --nproc), and how (a tierlm.distributed.sync config; None: dense fp32)
    nproc: int = 1
    grad_sync: Any = None
    tf32: bool = False  # --tf32: fp32 matmuls on TF32 tensor cores (else IEEE fp32)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.micro_batches


# -- the plan ------------------------------------------------------------------------------------


@dataclass
class Plan:
    placements: list[SegmentPlacement]
    order: str
    keep_resident_activations: KeepGraphs
    """True: resident segments keep their graph, streamed ones recompute; False: every segment
    recomputes; a flag per segment: those that keep (`_keep_streamed`: streamed blocks too,
    where the device has room)."""
    # ledger-visible peaks (what the runtime's ledger will measure), per tier and tensor class
    device_peak_bytes: int
    host_peak_bytes: int
    disk_bytes: int
    device_by_class: dict[str, int]
    host_by_class: dict[str, int]
    disk_by_class: dict[str, int]
    workspace_bytes: int  # activation workspace inside segments, outside the ledger
    moved_bytes: dict[str, int]  # per step, per link
    times_s: dict[str, float]
    bottleneck: str
    tokens_per_s: float
    budgets: dict[str, int]
    fits: bool = True
    problems: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    numels: list[int] = field(default_factory=list)
    boundary_on_host: bool = False  # boundary activations wait in host RAM for the backward
    # the update's master and slots of disk-tier segments read during the backward (None: off)
    readahead: ReadAhead | None = None
    readahead_segments: list[int] = field(default_factory=list)  # which ones, in update order
    # disk-tier master and slots written back behind the step (None: inside the update)
    writeback: WriteBack | None = DEFAULT_WRITEBACK
    # of the host bytes, those pinned for PCIe copies (arena footprints, tierlm.memory.arena):
    # the peak the replay holds at once, per class, and the arena the engine allocates for
    # them (the peak, and what the order of allocations leaves unusable between them)
    pinned_peak_bytes: int = 0
    pinned_arena_bytes: int = 0
    pinned_by_class: dict[str, int] = field(default_factory=dict)

    @property
    def device_total_bytes(self) -> int:
        return self.device_peak_bytes + self.workspace_bytes

    @property
    def step_s(self) -> float:
        return self.times_s["step"]

    @property
    def step_over_bound(self) -> float:
        """The predicted step over its lower bound, the compute alone: 1.0 is compute-bound."""
        return self.times_s["step"] / self.times_s["compute"]

    def resident_names(self) -> list[str]:
        return [n for n, p in zip(self.names, self.placements, strict=True) if p.resident]

    def tier_counts(self) -> dict[str, int]:
        counts = {t.value: 0 for t in Tier}
        for p in self.placements:
            counts[p.state_tier.value] += 1
        return counts

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["placements"] = [
            {"segment": n, "resident": p.resident, "state_tier": p.state_tier.value,
             "grad_tier": p.gradient_tier.value}
            for n, p in zip(self.names, self.placements, strict=True)
        ]
        d.pop("names")
        d.pop("numels")
        d["device_total_bytes"] = self.device_total_bytes
        d["step_over_bound"] = self.step_over_bound
        return json.loads(json.dumps(d, default=str))


# -- memory: replay the runtime's schedule over byte counts ------------------------------------


_DTYPE_OF_SIZE = {4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}


class _Bytes:
    """Stands in for a tensor in the replay: only its size matters (and whether it is pinned).
    It takes the views, slices and in-place arithmetic the runtime's loaders and landing apply
    to their buffers (tierlm.memory.replay runs them on it), which change nothing but sizes."""

    def __init__(self, numel: int, itemsize: int = 4, pinned: bool = False, *,
                 dtype: torch.dtype | None = None) -> None:
        self._numel = numel
        self.dtype = dtype or _DTYPE_OF_SIZE[itemsize]
        self._itemsize = self.dtype.itemsize
        self.nbytes = numel * self._itemsize
        self.pinned = pinned
        self.offset = 0  # in the pinned arena's region, when pinned

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self._itemsize

    def view(self, dtype: torch.dtype) -> _Bytes:
        return _Bytes(self.nbytes // dtype.itemsize, dtype=dtype)

    def narrow(self, dim: int, start: int, length: int) -> _Bytes:
        return _Bytes(length, dtype=self.dtype)

    def __getitem__(self, key: slice) -> _Bytes:
        return _Bytes(len(range(self._numel)[key]), dtype=self.dtype)

    def split(self, size: int) -> list[_Bytes]:
        return [self.narrow(0, lo, min(size, self._numel - lo))
                for lo in range(0, self._numel, size)]

    def clone(self) -> _Bytes:
        return _Bytes(self._numel, dtype=self.dtype)

    def add_(self, other: object) -> _Bytes:
        return self

    copy_ = mul_ = add_

    def zero_(self) -> _Bytes:
        return self


class _CountingStore:
    """The store on byte counts. Pinned buffers are also cut from an arena of offsets in the
    engine's order, whose size is what the engine's pinned arena needs (`arena.pinned_bytes`)."""

    def __init__(self, ledger: Ledger, arena: ArenaReplay | None = None) -> None:
        self.ledger = ledger
        self.arena = ArenaReplay() if arena is None else arena

    def alloc(self, tier: Tier, cls: TensorClass, numel: int, dtype=None, *,
              pinned: bool = False) -> _Bytes:
        t = _Bytes(numel, pinned=pinned, dtype=dtype or torch.float32)
        self.ledger.allocate(tier, cls, t.nbytes, pinned=pinned)
        if pinned:
            t.offset = self.arena.take(cls, t.nbytes)
        return t

    def free(self, tier: Tier, cls: TensorClass, t: _Bytes) -> None:
        self.ledger.release(tier, cls, t.nbytes, pinned=t.pinned)
        if t.pinned:
            self.arena.give(cls, t.nbytes, t.offset)

    def alloc_pinned(self, cls: TensorClass, nbytes: int, buffers: int) -> list[_Bytes]:
        """`nbytes` of pinned host buffers in `buffers` equal parts (the engine's chunk sets:
        each its own footprint in the arena)."""
        return [self.alloc(Tier.HOST, cls, nbytes // buffers, torch.uint8, pinned=True)
                for _ in range(buffers)]


def _compute_copies(shape: ModelShape, precision: str, placements) -> list[int | None]:
    """Per segment, the bytes of the compute copy the runtime keeps for it (state off the
    device, bf16/fp8 runs), None where its fp32 master serves (tierlm.precision.streaming)."""
    return [None if p.state_tier == Tier.DEVICE else shape.wire_bytes(s, precision)
            for s, p in enumerate(placements)]


def _disk_update_bytes(
    shape: ModelShape, copies: list[int | None], placements,
    read_ahead: frozenset[int] = frozenset(),
) -> tuple[int, int]:
    """Disk bytes (read, written) by one step's updates of disk-tier segments: master, grad
    and slots read (less a gradient held on the host, less what `read_ahead` segments read
    during the backward); master and slots written, and the compute copy re-encoded."""
    moved = [shape.update_disk_bytes(s, c, host_grad=p.host_grad, read_ahead=s in read_ahead)
             for s, (c, p) in enumerate(zip(copies, placements, strict=True))
             if p.state_tier == Tier.DISK]
    return sum(r for r, _ in moved), sum(w for _, w in moved)


def readahead_schedule(
    shape: ModelShape, train: TrainShape, placements: list[SegmentPlacement], order: str,
    boundary_host: bool, readahead: ReadAhead | None, actions: list | None = None,
) -> dict[int, list[int]]:
    """Action index -> disk-tier segments whose update state is read after it: the engine's
    rule (tierlm.runtime.readahead) on this plan's schedule and sizes."""
    from tierlm.runtime.readahead import readahead_starts

    if readahead is None or shape.frozen:
        return {}
    sizes = [(s, shape.update_state_bytes(s)) for s, p in enumerate(placements)
             if p.state_tier == Tier.DISK]
    hidden = train.batch_size * train.seq_len * shape.hidden_size * 4
    return readahead_starts(actions if actions is not None else _actions(shape, train, order),
                            sizes, readahead.extra_bytes,
                            parked_input_bytes=hidden if boundary_host else 0)


def _actions(shape: ModelShape, train: TrainShape, order: str) -> list:
    """The engine's schedule of one step (tierlm.runtime.schedule.step_schedule, which
    Engine.schedule calls) for this shape: a frozen embedding has no backward."""
    from tierlm.runtime.schedule import step_schedule

    return step_schedule(len(shape.names), train.micro_batches, order,
                         first_trained=not shape.frozen)


def _stream_plan(shape: ModelShape, placements: list[SegmentPlacement], actions: list
                 ) -> list[list[int]]:
    """Streamed segments each action reads (Engine.stream_plan, by the same rule), in order."""
    from tierlm.runtime.schedule import streamed_reads

    resident = [p.resident for p in placements]
    tied_owners = [0] if shape.tied_numel else []  # the embedding owns every tie
    return [streamed_reads(a, resident, tied_owners) for a in actions]


class _CountingStep:
    """`Engine.step` on byte counts: the walk's backend in the planner's replay
    (tierlm.runtime.walk). Weights load through the runtime's own stream cache; compute makes
    boundary activations and gradients of one micro-batch's hidden states (fp32); holds, parks,
    gradient buffers, landings and reads ahead allocate, free and move their bytes in the
    ledger. `on_action(k, phase, action)` marks where the step is (see `_simulate`)."""

    def __init__(self, shape: ModelShape, placements: list[SegmentPlacement], store,
                 cache, actions: list, hidden: int, chunk_numel: int,
                 on_action: Callable[[int, str, Any], None], ring,
                 load: Callable[[int], Any] | None = None) -> None:
        self.shape, self.placements, self.store, self.cache = shape, placements, store, cache
        self.ring = ring  # the step's landing ring (tierlm.runtime.landing.LandingRing)
        self.ledger: Ledger = store.ledger
        self.actions, self.chunk_numel, self.on_action = actions, chunk_numel, on_action
        self.streamed = [not p.resident for p in placements]
        self.act = _Bytes(hidden)  # a boundary input or its gradient
        self.grad_written = [False] * len(placements)
        self.ahead_held: list[_Bytes] = []  # read ahead, freed by the update
        self.landing: _Bytes | None = None  # the gradient the landing in flight reads
        # resident segments off the device whose copy the last update made stale: each reloads
        # at its first use (Engine._weights), a disk-tier one through the load's staging
        self.stale = {s for s, p in enumerate(placements)
                      if p.resident and p.state_tier != Tier.DEVICE and not shape.frozen}
        self.load = load  # the replay's loader of a segment's weights (start_load's bytes)

    def begin(self, k: int, a: Any) -> None:
        self.on_action(k, "run", a)

    def weights(self, k: int, s: int) -> None:
        if self.streamed[s]:
            self.cache.acquire(k, s)
        elif s in self.stale and self.load is not None:  # moves counted with the persistent
            self.stale.discard(s)
            self.load(s, count=False).finish(None)

    def running(self, k: int, a: Any) -> contextlib.AbstractContextManager:
        return _NOTHING

    def prefetch(self, k: int) -> None:
        self.on_action(k - 1, "prefetch", self.actions[k - 1])  # action k - 1 starts them
        self.cache.prefetch(k)

    def read_ahead(self, s: int) -> None:  # master and slots, whole, into staging
        nbytes = self.shape.update_state_bytes(s)
        self.ahead_held.append(self.store.alloc(Tier.HOST, TensorClass.STAGING, nbytes,
                                                torch.uint8))
        self.ledger.record_move(Link.DISK_READ, nbytes)

    def forward(self, a: Any, w: None, xs: list) -> list[_Bytes]:
        return [self.act] * len(xs)

    def head(self, k: int, a: Any, i: int, w: None, x: _Bytes, grad: _Bytes,
             tied: _Bytes | None) -> _Bytes:
        return self.act

    def backward(self, a: Any, i: int, w: None, x: _Bytes | None, gout: _Bytes,
                 grad: _Bytes) -> _Bytes:
        return self.act

    def hold(self, t: _Bytes, boundary: int | None) -> None:
        self.ledger.allocate(Tier.DEVICE, TensorClass.ACTIVATION, t.nbytes)

    def drop(self, t: _Bytes, boundary: int | None) -> None:
        self.ledger.release(Tier.DEVICE, TensorClass.ACTIVATION, t.nbytes)

    def park(self, s: int, x: _Bytes) -> _Bytes:
        copy = self.store.alloc(Tier.HOST, TensorClass.ACTIVATION, x.numel(), pinned=True)
        self.ledger.record_move(Link.D2H, x.nbytes)
        return copy

    def wait_parked(self, copy: _Bytes) -> None:
        pass

    def unpark(self, s: int, copy: _Bytes) -> _Bytes:
        self.ledger.record_move(Link.H2D, copy.nbytes)
        self.store.free(Tier.HOST, TensorClass.ACTIVATION, copy)
        return self.act

    def grad_buffer(self, s: int) -> _Bytes:
        if not transient_grad(self.placements[s].state_tier, self.shape.frozen):
            return _IN_PLACE  # the persistent gradient on the device (or none: frozen)
        return self.store.alloc(Tier.DEVICE, TensorClass.GRAD, self.shape.numels[s])

    def tied_grad(self) -> _Bytes:
        return self.store.alloc(Tier.DEVICE, TensorClass.GRAD, self.shape.numels[0])

    def add_grad(self, grad: _Bytes, part: _Bytes) -> None:
        self.store.free(Tier.DEVICE, TensorClass.GRAD, part)

    def land(self, s: int, grad: _Bytes, final: bool) -> None:
        p = self.placements[s]
        if not transient_grad(p.state_tier, self.shape.frozen):  # accumulated in place
            return
        numel = self.shape.numels[s]
        path = grad_landing(p.state_tier, p.gradient_tier, written=self.grad_written[s],
                            final=final)
        # the step's landing ring, taken by the first landing that adds into host RAM and held
        # to the sweep's end; then the landing's own host staging at its peak: each file pass's
        # chunk sets (tierlm.runtime.landing, tierlm.runtime.state)
        if path.ring_numel(numel, self.chunk_numel):
            self.ring.hold()
        staged = path.host_staging_numel(numel, self.chunk_numel)
        if staged:  # the file pass's chunk sets, pinned: the gradient crosses into them
            sets = min(STAGING_SETS, len(chunk_ranges(numel, self.chunk_numel)))
            for t in self.store.alloc_pinned(TensorClass.STAGING, GRAD_B * staged, sets):
                self.store.free(Tier.HOST, TensorClass.STAGING, t)
        for link, nbytes in path.moves(GRAD_B * numel):
            self.ledger.record_move(link, nbytes)
        self.grad_written[s] = path.written
        # a landing (into host RAM, or its passes into the gradient file) runs on the engine's
        # landing worker: its device gradient is freed when the engine next waits for it (the
        # next landing, or the sweep's end)
        self.settle_landing()
        self.landing = grad

    def settle_landing(self) -> None:
        if self.landing is not None:
            self.store.free(Tier.DEVICE, TensorClass.GRAD, self.landing)
            self.landing = None


_NOTHING = contextlib.nullcontext()
_IN_PLACE = _Bytes(0)  # a gradient buffer the replay does not count: the persistent one


def _simulate(
    shape: ModelShape,
    train: TrainShape,
    placements: list[SegmentPlacement],
    order: str,
    keep_resident: KeepGraphs,
    boundary_host: bool = False,
    *,
    ledger: Ledger | None = None,
    on_action: Callable[[int, str, Any], None] = lambda k, phase, action: None,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
    readahead: ReadAhead | None = None,
    parked: frozenset[int] | None = None,
    arena: ArenaReplay | None = None,
) -> tuple[Ledger, int, int]:
    """Replay one steady-state step of `Engine.step` on byte counts. Returns the ledger, the
    activation workspace outside it, and the host staging held by a concurrent update. Its
    pinned buffers are cut from `arena` in the engine's order, whose `pinned_bytes()` is then
    the pinned arena the engine needs for that step.
    `on_action(k, phase, action)` marks where the replay is (phase "run": action k's waits,
    compute and gradient landing; "prefetch": the loads it starts for action k+1; "update":
    after the sweep), so a ledger that logs moves can place them (tierlm.memory.timeline).
    Disk-tier state crosses host staging in chunks of `chunk_numel` elements per copy;
    `readahead`: the update's read-ahead (tierlm.runtime.readahead), its reads counted at the
    backward actions the engine issues them after; `parked`: the segments whose boundary input
    waits on the host where the engine's activation policies say so (None: those `keep_resident`
    and `boundary_host` give).

    The sweep is the engine's own walk (tierlm.runtime.walk) over a counting backend, and the
    rules are the engine's own functions (tierlm.runtime.schedule: the schedule, what an action
    reads, where a gradient goes, which boundary inputs park; tierlm.runtime.state: the
    persistent state and what a load stages and moves); this replay sets up the state before
    the sweep and counts the update after it."""
    from tierlm.runtime.cache import StreamCache, window_bytes
    from tierlm.runtime.landing import LandingRing
    from tierlm.runtime.schedule import landing_ring_numel, parked_inputs
    from tierlm.runtime.state import load_bytes, persistent_bytes, pinned_class
    from tierlm.runtime.walk import StepRules, walk_step

    ledger = Ledger() if ledger is None else ledger
    store = _CountingStore(ledger, arena)
    last = len(shape.names) - 1
    numels = shape.numels
    hidden = train.batch_size * train.seq_len * shape.hidden_size  # elements per boundary
    frozen = shape.frozen

    # the compute copy each segment is kept in off the device (None: its fp32 master), and
    # what one load of it stages and moves
    wire = _compute_copies(shape, train.precision, placements)
    loads = [load_bytes(p.state_tier, numels[s], wire[s], chunk_numel)
             for s, p in enumerate(placements)]

    if frozen:  # the adapters, their gradient and optimizer state, on the device throughout
        ledger.allocate(Tier.DEVICE, TensorClass.MASTER, MASTER_B * shape.trained_numel)
        ledger.allocate(Tier.DEVICE, TensorClass.GRAD, GRAD_B * shape.trained_numel)
        ledger.allocate(Tier.DEVICE, TensorClass.OPTIM, shape.trained_optim_bytes)
    for s, p in enumerate(placements):  # persistent state
        base = shape.base_copy(s)
        copy = wire[s] if base is None else base
        pinned = pinned_class(p, copy)  # what the segment's H2D copies read
        for tier, cls, nbytes in persistent_bytes(
                p, numels[s], 0 if frozen else shape.optim_state_bytes[s],
                copy, frozen=frozen, base_copy=base is not None):
            if tier == Tier.HOST and cls == pinned:  # cut from the arena's persistent region
                store.alloc(tier, cls, nbytes, torch.uint8, pinned=True)
            else:
                ledger.allocate(tier, cls, nbytes)

    class Load:  # tierlm.runtime.state.start_load's loader, on byte counts
        def __init__(self, s: int, count: bool = True) -> None:
            self.load = loads[s]
            self.count = count  # the moves (a resident reload's are counted with the state)
            # the disk read's staging, pinned: the H2D copy reads it
            self.staging = store.alloc_pinned(TensorClass.STAGING, self.load.staging_bytes,
                                              self.load.staging_buffers)
            if self.load.disk_read_bytes and count:
                ledger.record_move(Link.DISK_READ, self.load.disk_read_bytes)

        def start(self, dst, after) -> None:
            pass

        def finish(self, dst) -> None:
            if self.count:
                ledger.record_move(Link.H2D, self.load.h2d_bytes)
            for t in self.staging:
                store.free(Tier.HOST, TensorClass.STAGING, t)

    streamed = {i: loads[i].h2d_bytes for i, p in enumerate(placements) if not p.resident}
    cache = StreamCache(store, streamed.__getitem__, window_bytes(streamed.values()), Load)  # type: ignore[arg-type]
    actions = _actions(shape, train, order)
    ahead = readahead_schedule(shape, train, placements, order, boundary_host, readahead, actions)
    keep = keeps_graph(placements, keep_resident)
    cache.begin(_stream_plan(shape, placements, actions))
    # resident segments with host/disk state are refreshed after each update: one load per step
    for s, p in enumerate(placements):
        if p.resident and p.state_tier != Tier.DEVICE and not frozen:
            ledger.record_move(Link.H2D, loads[s].h2d_bytes)
            if loads[s].disk_read_bytes:
                ledger.record_move(Link.DISK_READ, loads[s].disk_read_bytes)

    landings = [(p.state_tier, p.gradient_tier, numels[s])
                if transient_grad(p.state_tier, frozen) else None
                for s, p in enumerate(placements)]
    ring_numel = landing_ring_numel(actions, train.micro_batches, landings, chunk_numel)
    ring = LandingRing(store, ring_numel)  # type: ignore[arg-type]
    step = _CountingStep(shape, placements, store, cache, actions, hidden, chunk_numel,
                         on_action, ring, Load)
    tied_owners = [0] if shape.tied_numel else []  # the embedding owns every tie
    rules = StepRules(
        micro_batches=train.micro_batches,
        # the boundary inputs that wait on the host: the engine's rule on the policies `keep`
        # gives (resident graphs kept, the rest recomputed)
        parked=parked_inputs(["keep" if k else "full" for k in keep[:last]], boundary_host)
        if parked is None else parked,
        tied_owners=tied_owners,
        # the head's contribution to tied weights is held in a buffer the size of the owner's
        # gradient, which the owner's backward then accumulates its own into (frozen: none)
        tied_trained=bool(tied_owners) and not frozen,
        state_tiers=[p.state_tier for p in placements],
        first_trained=not frozen,
    )
    with ring:  # held from the first landing to the end of the sweep, as the engine does
        walk_step(step, actions, rules, ahead)
        step.settle_landing()

    on_action(len(actions), "update", None)
    # the optimizer update: disk segments read master, grad and slots, write master and slots
    # back (and their compute copy); staged chunk by chunk, or whole where a compute copy is
    # encoded or the optimizer takes whole segments
    read_ahead = frozenset(s for segs in ahead.values() for s in segs)
    update_read, update_write = _disk_update_bytes(shape, wire, placements, read_ahead)
    ledger.record_move(Link.DISK_READ, update_read)
    ledger.record_move(Link.DISK_WRITE, update_write)
    for t in step.ahead_held:  # written back and freed by the update (`_update_overlap_bytes`)
        store.free(Tier.HOST, TensorClass.STAGING, t)
    update_staging = max([shape.update_staging(s, wire[s], chunk_numel,
                                               host_grad=p.host_grad, read_ahead=s in read_ahead)
                          for s, p in enumerate(placements) if p.state_tier == Tier.DISK],
                         default=0)

    # workspace outside the ledger, by the dynamic policy's byte model
    # (tierlm.activations.dynamic): graphs kept by resident segments for the micro-batches in
    # flight, then the larger of the head (its input, its gradient and one chunk of logits) and
    # one recomputed block's saved tensors during the backward
    workspace = activation_workspace_bytes(shape, train, keep[:last], order)
    # a QLoRA matmul decodes its NF4 weight into a buffer of its own, one weight at a time
    workspace += max(shape.base_decoded_bytes or [0])
    return ledger, workspace, update_staging


def activation_workspace_bytes(shape: ModelShape, train: TrainShape, keep: list[bool],
                               order: str) -> int:
    """Device bytes of activations outside the ledger at their peak over one step: segments
    that `keep` their graph hold one block's saved tensors per micro-batch in flight, the others
    recompute theirs in the backward (`full`); the head's chunked loss runs in between. One
    block's saved tensors are linear in the tokens (SDPA's fused kernel), measured under the
    run's precision."""
    from tierlm.activations.dynamic import (
        SegmentCosts,
        activation_peak_bytes,
        head_workspace_bytes,
    )

    tokens = train.batch_size * train.seq_len
    block = SegmentCosts(int(shape.saved_bytes_per_token(train.precision) * tokens), 0, 0)
    costs = [SegmentCosts(0, 0, 0)] + [block] * (len(keep) - 1)  # embed saves token ids only
    policies = ["keep" if k else "full" for k in keep]
    head = head_workspace_bytes(shape.head_chunk_tokens, shape.vocab_size, tokens,
                                shape.hidden_size)
    in_flight = train.micro_batches if order == "layer-outer" else 1
    return activation_peak_bytes(policies, costs, in_flight=in_flight, head_bytes=head)


# -- time model ----------------------------------------------------------------------------------


def writeback_bytes(
    shape: ModelShape, placements, copies: list[int | None], writeback: WriteBack | None,
    chunk_numel: int = STAGING_CHUNK_NUMEL,
) -> dict[int, int]:
    """Disk-tier segment -> bytes of its update written back behind the step (and held in host
    staging until written): those updated in one chunk (Engine._update_whole: a compute copy's
    segment, an optimizer of whole segments, or one no larger than a chunk), their master and
    slots where the forward reads a compute copy, else the slots. Empty without a deferred
    write-back."""
    if writeback is None or shape.frozen:
        return {}
    return {s: shape.update_state_bytes(s) - (0 if copies[s] is not None else
                                              MASTER_B * shape.numels[s])
            for s, p in enumerate(placements)
            if p.state_tier == Tier.DISK and (copies[s] is not None or shape.optim_whole
                                              or shape.numels[s] <= chunk_numel)}


@dataclass
class UpdateSpan:
    """One segment's update in `_update_chain` (seconds from the window's start): its disk
    reads, CPU work and the writes the forward needs, one after another from `start_s`; its
    deferred write-back (0 s where none) queued on the drive, ending at `writeback_end_s`."""

    seg: int
    start_s: float
    read_s: float
    cpu_s: float
    write_s: float
    writeback_s: float = 0.0
    writeback_end_s: float = 0.0

    @property
    def ready_s(self) -> float:
        """When the next forward of the segment may start."""
        return self.start_s + self.read_s + self.cpu_s + self.write_s


def _update_chain(
    shape: ModelShape, hw: HardwareProfile, placements, copies: list[int | None],
    read_ahead: frozenset[int], deferred: dict[int, int], limit: int | None,
    starts: list[float], late: float, spans: list[UpdateSpan] | None = None,
) -> float:
    """How long the first forward waits for the updates: the updates run one after another in
    forward order from `late` on (each its disk reads, CPU work and the writes the forward
    needs: its compute copy, or its fp32 master), the deferred write-backs one after another
    behind them, the update of a `deferred` segment first waiting until fewer than `limit`
    write-backs are pending; segment s's forward starts at `starts[s]` (seconds into the
    window) and waits for its update. The write-back shares the drive in pieces, so the
    update's own requests are taken as running at the drive's full rate (the step's disk total
    bounds both). `spans`, where given, receives each update's times (the predicted trace
    draws them: tierlm.memory.timeline)."""
    cpu_s = 0.0 if shape.frozen else shape.optim_cpu_cost / hw.cpu_adam_params_per_s
    t, stall, written = late, 0.0, []
    for s, p in enumerate(placements):
        if p.state_tier == Tier.DEVICE:
            continue
        read = write = 0
        if p.state_tier == Tier.DISK:
            read, write = shape.update_disk_bytes(s, copies[s], host_grad=p.host_grad,
                                                  read_ahead=s in read_ahead)
            write -= deferred.get(s, 0)
            if s in deferred and limit is not None and len(written) >= limit:
                t = max(t, written[-limit])
        span = UpdateSpan(s, t, read / hw.disk_read_Bps, shape.numels[s] * cpu_s,
                          write / hw.disk_write_Bps)
        t = span.ready_s
        if s in deferred:
            span.writeback_s = deferred[s] / hw.disk_write_Bps
            written.append(max(t, written[-1] if written else 0.0) + span.writeback_s)
            span.writeback_end_s = written[-1]
        stall = max(stall, t - starts[s])
        if spans is not None:
            spans.append(span)
    return stall


def update_spans(shape: ModelShape, train: TrainShape, hw: HardwareProfile, plan: Plan,
                 chunk_numel: int = STAGING_CHUNK_NUMEL) -> tuple[list[UpdateSpan], float]:
    """`plan`'s updates as `_times` models them, segment by segment, from the end of the sweep
    (`_update_chain`'s spans), and the stall they cause the next step's forward."""
    copies = _compute_copies(shape, train.precision, plan.placements)
    deferred = writeback_bytes(shape, plan.placements, copies, plan.writeback, chunk_numel)
    limit = None if plan.writeback is None else plan.writeback.segments
    spans: list[UpdateSpan] = []
    stall = _update_chain(shape, hw, plan.placements, copies,
                          frozenset(plan.readahead_segments), deferred, limit,
                          forward_starts(shape, plan.times_s["update_window"]),
                          plan.times_s["update_late"], spans)
    return spans, stall


def forward_starts(shape: ModelShape, window: float) -> list[float]:
    """Per segment, when its forward starts in a forward of `window` seconds: at its share of
    the forward's FLOPs before it (the embedding lookup takes none)."""
    fwd = [0] + list(shape.numels[1:-1]) + [shape.numels[-1] + shape.tied_numel]
    return [window * sum(fwd[:s]) / max(1, sum(fwd)) for s in range(len(fwd))]


def _times(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
    keep_resident: KeepGraphs,
    moved: dict[str, int], *, read_ahead: frozenset[int] = frozenset(), groups: int = 1,
    writeback: WriteBack | None = None, chunk_numel: int = STAGING_CHUNK_NUMEL,
) -> dict[str, float]:
    """Seconds per step by resource. `read_ahead`: disk-tier segments whose master and slots the
    last group's backward reads (they count in the sweep's disk, not the update's); `groups`:
    micro-batch groups per step (M for microbatch-outer, 1 for layer-outer): the update of step
    i hides behind the first group's forward of step i+1 (every segment's forward waits for its
    update: `_update_chain`), and the read-ahead runs during the last group's backward;
    `writeback`: the disk-tier master and slots written back behind the step (they must fit the
    step on the one drive, not the window)."""
    tokens = train.tokens_per_step
    block_params = sum(shape.numels[1:-1])
    head_params = shape.numels[-1] + shape.tied_numel
    keep = keeps_graph(placements, keep_resident)
    recomputed = sum(n for n, k in zip(shape.numels[1:-1], keep[1:-1], strict=True) if not k)
    # forward 2 FLOPs/param/token, backward 4; recomputed blocks run their forward twice;
    # attention scores add 2*2*T*D per token per layer forward (causal: half), x3 with backward
    attn = 6 * train.seq_len * train.context_parallel * shape.hidden_size * shape.n_layers
    # a frozen base's weights take no gradient: the backward is 2 FLOPs/param/token; compiled
    # blocks take their measured share of the eager time, counted as eager-rate FLOPs
    block_flops = tokens * ((4 if shape.frozen else 6) * block_params + 2 * recomputed) * (
        compiled_block_factor(train, hw))
    flops = block_flops + tokens * (6 * head_params + attn)
    peak = hw.fp32_compute_flops(tf32=train.tf32) if train.precision == "fp32" else (
        hw.matmul_flops)
    rate = peak * (1.0 if hw.device_is_cpu else MATMUL_EFFICIENCY)
    if hw.device_is_cpu and train.precision == "bf16":
        rate *= 1.5  # measured on the dev CPU: bf16 autocast ~1.5x fp32 (bench/step_time.py)
    compute = flops / rate
    if train.precision == "fp8" and hw.fp8_matmul_flops and not hw.device_is_cpu:
        # the blocks' matmuls (forward, input and weight gradients) run on the fp8 units;
        # attention scores and the head stay bf16
        fp8_rate = hw.fp8_matmul_flops * MATMUL_EFFICIENCY
        compute = block_flops / fp8_rate + (flops - block_flops) / rate
    decode = _decode_s(shape, train, hw, placements, keep_resident)
    compute += decode
    forward = compute * 2 * (block_params + head_params) / (flops / tokens)
    net, net_lane = _net_lane(shape, train, hw, placements, keep_resident, compute,
                              attention_s=tokens * attn / rate)
    sync, sync_exposed = _grad_sync_lane(shape, train, hw, compute, backward_s=compute - forward,
                                         groups=groups, ring_s=net)
    net_lane += sync_exposed
    h2d = moved.get(Link.H2D.value, 0) / (hw.h2d_Bps * COPY_EFFICIENCY)
    d2h = moved.get(Link.D2H.value, 0) / (hw.d2h_Bps * COPY_EFFICIENCY)
    update_read, update_write = _disk_update_bytes(
        shape, _compute_copies(shape, train.precision, placements), placements, read_ahead)
    sweep_disk = (
        (moved.get(Link.DISK_READ.value, 0) - update_read) / hw.disk_read_Bps
        + (moved.get(Link.DISK_WRITE.value, 0) - update_write) / hw.disk_write_Bps
    )
    cpu_params = 0 if shape.frozen else sum(  # a frozen base is never updated
        n for n, p in zip(shape.numels, placements, strict=True) if p.state_tier != Tier.DEVICE)
    update_cpu = cpu_params * shape.optim_cpu_cost / hw.cpu_adam_params_per_s
    update_disk = update_read / hw.disk_read_Bps + update_write / hw.disk_write_Bps
    update = update_cpu + update_disk
    if hw.device_is_cpu:
        # no separate copy engines or GPU: copies and compute share the cores
        sweep = compute + h2d + d2h + sweep_disk + (net_lane - compute)
    else:
        sweep = max(compute, h2d, d2h, sweep_disk, net_lane)
    # the read-ahead starts with the last group's backward; what it has not read by the
    # sweep's end delays the update
    readahead = sum(shape.update_state_bytes(s) for s in read_ahead) / hw.disk_read_Bps
    late = max(0.0, readahead - (compute - forward) / groups)
    # the update of step i runs behind the first group's forward of step i+1, each segment's
    # forward starting at its share of the forward's FLOPs (embed: none); what does not fit
    # stalls it
    window = forward / groups
    starts = forward_starts(shape, window)
    copies = _compute_copies(shape, train.precision, placements)
    deferred = writeback_bytes(shape, placements, copies, writeback, chunk_numel)
    limit = None if writeback is None else writeback.segments
    stall = _update_chain(shape, hw, placements, copies, read_ahead, deferred, limit, starts,
                          late)
    # what the write-back's limit adds to the stall (it waits for the drive)
    ungated = _update_chain(shape, hw, placements, copies, read_ahead, deferred, None, starts,
                            late)
    writeback_s = sum(deferred.values()) / hw.disk_write_Bps
    # one disk serves the sweep, the update and its write-back
    step = max(sweep + stall, sweep_disk + update_disk)
    return {
        "compute": compute,
        "decode": decode,
        "h2d": h2d,
        "d2h": d2h,
        "sweep_disk": sweep_disk,
        "update_disk": update_disk,
        "disk": sweep_disk + update_disk,
        "cpu_update": update_cpu,
        "update": update,
        "writeback": writeback_s,  # part of update_disk, drained behind the step
        "update_ready": update - writeback_s,  # what the forward waits for: CPU, reads, copies
        "writeback_wait": stall - ungated,  # stall added by waiting for the write-back's limit
        "readahead": readahead,
        "update_late": late,  # the update starts this long after the sweep (the read-ahead)
        "net": net,
        "grad_sync": sync,
        "grad_sync_exposed": sync_exposed,
        "net_lane": net_lane,
        "attention": tokens * attn / rate,
        "update_window": window,
        "update_stall": step - sweep,
        "step": step,
    }


def ring_kv_bytes(shape: ModelShape, train: TrainShape, placements,
                  keep_resident: KeepGraphs) -> int:
    """What one context-parallel rank sends through the ring per step (the formula of
    tierlm.distributed.context): every block's K/V in the forward, again in the backward with
    dK/dV sent home, and the forward's once more for each block that recomputes (streamed, or
    resident without its graph). K/V travel in the compute precision, dK/dV in fp32."""
    if train.context_parallel == 1:
        return 0
    from tierlm.distributed.context import ring_send_bytes

    recomputed = sum(not k for k in keeps_graph(placements, keep_resident)[1:-1])
    kw = dict(cp=train.context_parallel, batch=train.batch_size, local_len=train.seq_len,
              kv_heads=shape.kv_heads or 1, head_dim=shape.head_dim or shape.hidden_size,
              element_bytes=4 if train.precision == "fp32" else 2)
    return train.micro_batches * (ring_send_bytes(**kw, layers=shape.n_layers)
                                  + ring_send_bytes(**kw, layers=recomputed, backward=False))


def _net_lane(shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
              keep_resident: KeepGraphs, compute: float, *,
              attention_s: float) -> tuple[float, float]:
    """(seconds the ring's K/V take to send, the sweep's `net` lane). Each ring step posts the
    next K/V block before computing attention against the current one, so the sends hide
    behind attention only: the lane is the compute with the attention stretched to the sends'
    time where they take longer."""
    net = ring_kv_bytes(shape, train, placements, keep_resident) / hw.net_Bps
    return net, compute + max(0.0, net - attention_s)


def _sync_segments(shape: ModelShape) -> tuple[list, list[int]]:
    """What the gradient sync exchanges: per segment its parameters as (name, numel), and the
    entries of every optimizer state slot; a frozen base's ranks exchange the adapters only."""
    if shape.frozen:
        return [(("adapters", shape.trained_numel),)], []
    segments = shape.param_numels or [(("", n),) for n in shape.numels]
    return list(segments), [n for seg in shape.optim_slot_numels or () for n in seg]


def grad_sync_bytes(shape: ModelShape, train: TrainShape) -> float:
    """What one rank sends per step, on average, to keep its weights equal to the other
    `train.nproc - 1` ranks' (data parallel x context parallel): the sync strategy's own count
    (tierlm.distributed.sync: the bytes `Comm` records in the ledger as net_send)."""
    if train.nproc == 1:
        return 0.0
    from tierlm.distributed.sync import DenseSync

    segments, slots = _sync_segments(shape)
    return (train.grad_sync or DenseSync()).send_bytes(segments, train.nproc, slots)


def _grad_sync_lane(shape: ModelShape, train: TrainShape, hw: HardwareProfile, compute: float,
                    *, backward_s: float, groups: int, ring_s: float) -> tuple[float, float]:
    """(seconds the gradient sync's sends take per step, the part of them the step waits for).
    Dense and top-k start a segment's exchange as soon as its gradient is complete, during the
    last micro-batch group's backward: they hide behind that backward, sharing the link with
    the ring's K/V of that time (the ring's sends spread over the sweep as the compute is),
    except the exchange of the segment whose gradient completes last (the embedding's), which
    the update waits for. Delayed sync averages after the step: all of it is waited for."""
    sync_s = grad_sync_bytes(shape, train) / hw.net_Bps
    if not sync_s:
        return 0.0, 0.0
    from tierlm.distributed.sync import DenseSync

    sync = train.grad_sync or DenseSync()
    if not sync.overlaps_backward:
        return sync_s, sync_s
    last_s = sync.send_bytes(_sync_segments(shape)[0][:1], train.nproc) / hw.net_Bps
    window = backward_s / groups
    free = max(0.0, window - ring_s * window / compute)
    return sync_s, last_s + max(0.0, sync_s - last_s - free)


def compiled_block_factor(train: TrainShape, hw: HardwareProfile) -> float:
    """The blocks' compute time under `train`'s compile choice over the eager time: the
    compiled block's measured ratio (`tierlm probe --compile segments`) when the run compiles
    and the profile holds one, else 1.0."""
    if train.compiled and hw.compiled_block_time_ratio is not None:
        return hw.compiled_block_time_ratio
    return 1.0


def compiled_block_source(train: TrainShape, hw: HardwareProfile) -> str | None:
    """Where `compiled_block_factor` came from, for the plan's output (None: compile off)."""
    if not train.compiled:
        return None
    factor = compiled_block_factor(train, hw)
    if hw.compiled_block_time_ratio is None:
        return (f"compile: segments; blocks' compute x{factor:.2f} (not probed: run `tierlm "
                "probe --compile segments` on the training machine and plan with --hardware "
                "auto)")
    return (f"compile: segments; blocks' compute x{factor:.2f} of eager (probed: "
            f"{hw.compiled_block_probe or 'tierlm probe --compile segments'})")


def _decode_s(shape: ModelShape, train: TrainShape, hw: HardwareProfile, placements,
              keep_resident: KeepGraphs) -> float:
    """Seconds per step a QLoRA base spends decoding NF4 weights on the device (part of its
    compute): each matmul decodes its weight (tierlm.models.nf4.NF4Linear) in every micro-batch's
    forward and backward, and once more where the segment recomputes its forward; a memory-bound
    pass at `decode_traffic_bytes` per weight over the device's memory bandwidth."""
    if not shape.base_nf4_numels:
        return 0.0
    import torch

    from tierlm.models.nf4 import decode_traffic_bytes

    dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32
    decodes = sum(n * (2 + (not k)) for n, k in zip(
        shape.base_nf4_numels, keeps_graph(placements, keep_resident), strict=True))
    rate = hw.device_memory_Bps * (1.0 if hw.device_is_cpu else COPY_EFFICIENCY)
    return train.micro_batches * decode_traffic_bytes(decodes, dtype) / rate


def _bottleneck(t: dict[str, float]) -> str:
    """The resource whose time sets the step: the sweep's longest lane, plus the share of the
    update stall each of the update's parts causes."""
    stall = t["update_stall"] - t["writeback_wait"]  # the rest waits for the drive
    ready = t["update_ready"]  # the CPU work and the disk work the forward waits for
    share = stall / ready if ready > 0 else 0.0
    ready_disk = ready - t["cpu_update"]
    # the net lane includes the compute: named where the sends outlast what hides them, after
    # whichever of its two parts adds more
    net = t["net_lane"] if t["net_lane"] > t["compute"] else 0.0
    ring_over = t["net_lane"] - t["compute"] - t["grad_sync_exposed"]
    parts = {
        "compute": t["compute"],
        "PCIe (H2D/D2H)": max(t["h2d"], t["d2h"]),
        "interconnect (ring K/V)": net if ring_over >= t["grad_sync_exposed"] else 0.0,
        "interconnect (gradient all-reduce)": net if ring_over < t["grad_sync_exposed"] else 0.0,
        "disk": max(t["sweep_disk"] + share * ready_disk + t["writeback_wait"],
                    t["disk"] if t["disk"] >= t["step"] else 0.0),
        "CPU optimizer update": share * t["cpu_update"],
    }
    return max(parts, key=parts.get)  # type: ignore[arg-type]


# -- search -------------------------------------------------------------------------------------


def _priority(names: list[str]) -> list[int]:
    """Segments in the order they deserve the device: embed and head (costliest reload per
    use), then blocks from the last one back (their backward comes first)."""
    return sorted(range(len(names)), key=lambda i: (names[i] not in ("embed", "head"), -i))


def evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host=False, *,
             chunk_numel: int = STAGING_CHUNK_NUMEL, readahead: ReadAhead | None = None,
             writeback: WriteBack | None = DEFAULT_WRITEBACK) -> Plan:
    """Predict memory and time for one given placement (the planner's inner step; also used to
    predict runs whose placement the user chose; `chunk_numel`: the engine's
    staging_chunk_numel; `readahead`: its update read-ahead; `writeback`: its deferred
    write-back)."""
    return _evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host,
                     chunk_numel=chunk_numel, readahead=readahead, writeback=writeback)


def _update_overlap_bytes(
    shape: ModelShape, placements: list[SegmentPlacement], copies: list[int | None],
    chunk_numel: int = STAGING_CHUNK_NUMEL, *, read_ahead: frozenset[int] = frozenset(),
    parked_per_block: int = 0, pending_bytes: int = 0,
) -> int:
    """Host staging while the background update overlaps the next forward. Updates run in
    forward order; the forward of segment a waits for a's update, then reads a's weights
    (disk: through staging chunks) while the worker updates the next segment b (disk: chunks of
    master, gradient and the optimizer's slots staged). The read-ahead's buffers of b and of
    every segment after it are still held (each is freed once its update has written it back),
    and the forward has parked the boundary inputs of the blocks up to a + 1 on the host
    (`parked_per_block`: one block's, for the micro-batches of the first group); with a
    deferred write-back, `pending_bytes` of earlier segments' master and slots may still wait
    to be written. So the peak is the worst such pair."""
    order = [i for i, p in enumerate(placements) if p.state_tier != Tier.DEVICE]
    last = len(placements) - 1

    def read(i: int) -> int:  # the compute file, or the fp32 master in chunks
        if placements[i].state_tier != Tier.DISK:
            return 0
        return (MASTER_B * staging_numel(shape.numels[i], chunk_numel) if copies[i] is None
                else copies[i])

    def update(i: int) -> int:  # master, gradient, slots; the compute copy it encodes
        if placements[i].state_tier != Tier.DISK:
            return 0
        held = sum(shape.update_state_bytes(j) for j in read_ahead if j >= i)
        return pending_bytes + held + shape.update_staging(i, copies[i], chunk_numel,
                                           host_grad=placements[i].host_grad,
                                           read_ahead=i in read_ahead)

    def parked(a: int) -> int:  # boundary inputs of blocks 1 .. a + 1
        return parked_per_block * max(0, min(a + 1, last - 1))

    pairs = [update(order[0])] if order else [0]
    pairs += [parked(a) + read(a) + update(b) for a, b in zip(order, order[1:], strict=False)]
    return max(pairs)


def _evaluate(shape, train, hw, placements, order, keep, budgets, boundary_host=False, *,
              chunk_numel: int = STAGING_CHUNK_NUMEL, readahead: ReadAhead | None = None,
              writeback: WriteBack | None = DEFAULT_WRITEBACK, replay=None) -> Plan:
    """`replay`: this placement's `_replay` when the caller has it (the write-back options
    change neither the sweep's bytes nor its ledger)."""
    ledger, workspace, read_ahead, arena = replay or _replay(
        shape, train, placements, order, keep, boundary_host, chunk_numel, readahead)
    device_peak = ledger.peak_tier_bytes[Tier.DEVICE]
    host_persistent = ledger.tier_bytes(Tier.HOST)
    first_group = train.micro_batches if order == "layer-outer" else 1
    copies = _compute_copies(shape, train.precision, placements)
    # The write-back's staging outlives the update: up to `segments` of them may wait while
    # the next sweep runs (on top of its ledger peak), one fewer while an update stages.
    pending = sorted(writeback_bytes(shape, placements, copies, writeback, chunk_numel).values(),
                     reverse=True)
    limit = 0 if writeback is None else writeback.segments
    host_peak = max(ledger.peak_tier_bytes[Tier.HOST] + sum(pending[:limit]),
                    host_persistent + _update_overlap_bytes(
                        shape, placements, copies, chunk_numel,
                        read_ahead=frozenset(read_ahead),
                        parked_per_block=parked_bytes(shape, train, order, boundary_host)
                        // max(1, len(shape.names) - 2),
                        pending_bytes=sum(pending[:max(0, limit - 1)])))
    moved = {link.value: ledger.total_moved_bytes[link] for link in Link}
    times = _times(shape, train, hw, placements, keep, moved, read_ahead=frozenset(read_ahead),
                   groups=train.micro_batches // first_group, writeback=writeback,
                   chunk_numel=chunk_numel)

    def by_class(tier: Tier) -> dict[str, int]:
        return {c.value: ledger.peak_class_bytes[(tier, c)] for c in TensorClass
                if ledger.peak_class_bytes[(tier, c)]}

    plan = Plan(
        placements=placements, order=order, keep_resident_activations=keep,
        device_peak_bytes=device_peak, host_peak_bytes=host_peak,
        disk_bytes=ledger.tier_bytes(Tier.DISK),
        device_by_class=by_class(Tier.DEVICE), host_by_class=by_class(Tier.HOST),
        disk_by_class=by_class(Tier.DISK), workspace_bytes=workspace, moved_bytes=moved,
        times_s=times, bottleneck=_bottleneck(times),
        tokens_per_s=train.tokens_per_step / times["step"], budgets=budgets,
        names=shape.names, numels=shape.numels, boundary_on_host=boundary_host,
        readahead=readahead, readahead_segments=read_ahead, writeback=writeback,
        pinned_peak_bytes=ledger.pinned_peak_bytes, pinned_arena_bytes=arena.total_bytes,
        pinned_by_class={c.value: ledger.pinned_class_peak_bytes[c] for c in TensorClass
                         if ledger.pinned_class_peak_bytes[c]},
    )
    plan.problems = _problems(plan, budgets)
    plan.fits = not plan.problems
    return plan


def _replay(shape, train, placements, order, keep, boundary_host, chunk_numel, readahead):
    """The sweep's replay (ledger, workspace), the segments it reads ahead and the pinned arena
    it needs."""
    arena = ArenaReplay()
    ledger, workspace, _ = _simulate(shape, train, placements, order, keep, boundary_host,
                                     chunk_numel=chunk_numel, readahead=readahead, arena=arena)
    read_ahead = [s for segs in readahead_schedule(
        shape, train, placements, order, boundary_host, readahead).values() for s in segs]
    return ledger, workspace, read_ahead, arena.pinned_bytes()


def _problems(plan: Plan, budgets: dict[str, int]) -> list[str]:
    out = []
    if plan.device_total_bytes > budgets["device"]:
        short = plan.device_total_bytes - budgets["device"]
        out.append(f"device needs {gib(plan.device_total_bytes)} (state "
                   f"{gib(plan.device_peak_bytes)} + activation workspace "
                   f"{gib(plan.workspace_bytes)}), usable {gib(budgets['device'])}: "
                   f"{short:,} bytes ({gib(short)}) short")
    if plan.host_peak_bytes > budgets["host"]:
        out.append(f"host needs {gib(plan.host_peak_bytes)}, usable {gib(budgets['host'])}")
    if plan.disk_bytes > budgets["disk"]:
        out.append(f"disk needs {gib(plan.disk_bytes)}, usable {gib(budgets['disk'])}")
    return out


def usable_budgets(
    hw: HardwareProfile, *, device_budget: int | None = None, host_budget: int | None = None,
    margin: float = SAFETY_MARGIN,
) -> dict[str, int]:
    """Budgets the plan must fit: the explicit ones, or the hardware's sizes; less the margin
    (and, on a GPU, the CUDA context reserve)."""
    device = device_budget if device_budget is not None else hw.gpu_memory_bytes - (
        0 if hw.device_is_cpu else GPU_RESERVE_BYTES)
    host = host_budget if host_budget is not None else hw.host_memory_bytes
    return {
        "device": int(device * (1 - margin)),
        "host": int(host * (1 - margin)),
        "disk": int(hw.disk_budget_bytes * (1 - margin)),
    }


def plan(
    shape: ModelShape,
    train: TrainShape,
    hw: HardwareProfile,
    *,
    device_budget: int | None = None,
    host_budget: int | None = None,
    orders: tuple[str, ...] = ("microbatch-outer", "layer-outer"),
    park_boundaries: bool = True,
    advise: bool = True,
) -> Plan:
    """The fastest predicted plan that fits; if none fits, the closest one with `fits=False`
    and `problems` saying what would make it fit (`advise`: each budget named there is the
    least at which this search finds a plan, checked at the value printed; off, the problems
    alone, for callers that only tabulate whether a plan fits)."""
    # the advice searches again under other budgets: the replays (which do not depend on the
    # budgets) are shared, per step shape
    replays: dict[int, tuple[TrainShape, dict]] = {}

    def search(step: TrainShape, profile: HardwareProfile, device: int | None,
               host: int | None, simulate: bool = False) -> Plan:
        cache = replays.setdefault(id(step), (step, {}))[1]
        return _search(shape, step, profile, device, host, orders=orders,
                       park_boundaries=park_boundaries, replays=cache, simulate=simulate)

    p = search(train, hw, device_budget, host_budget, simulate=True)
    if not p.fits and advise:
        p.problems = p.problems + _what_would_fit(search, shape, train, hw, p, device_budget,
                                                  host_budget)
    if "simulated_step" not in p.times_s:
        p.times_s.update(simulated_times(shape, train, hw, p))
    return p


SIMULATED_LANES = {"compute": "compute", "h2d": "H2D", "d2h": "D2H", "disk": "disk",
                   "cpu_update": "cpu update", "cpu_adds": "cpu"}


def simulated_times(shape: ModelShape, train: TrainShape, hw: HardwareProfile, p: Plan
                    ) -> dict[str, float]:
    """`p`'s steady-state step as the replay simulates it (tierlm.memory.replay: the engine's
    operations on a timing device, two steps, the second's), for `times_s`: the step, each
    lane's busy time in it (`simulated_<lane>`) and each copy lane's busy time under compute
    (`simulated_<lane>_overlap`). Run for the chosen plan only: the search still ranks
    candidates by `_times` (a replay in virtual time costs ~0.3-2 s at 7B; the search
    evaluates thousands of candidates)."""
    from tierlm.memory.replay import ReplayConfig, simulate_step

    r = simulate_step(shape, train, p.placements, p.order, p.keep_resident_activations,
                      p.boundary_on_host, ReplayConfig(hw=hw), readahead=p.readahead,
                      writeback=p.writeback)
    out = {"simulated_step": r.step_s, "simulated_transfer_wait": r.transfer_wait_s}
    for key, lane in SIMULATED_LANES.items():
        out[f"simulated_{key}"] = r.lane_busy_s.get(lane, 0.0)
    for key in ("h2d", "d2h", "disk"):
        out[f"simulated_{key}_overlap"] = r.overlap_s.get(SIMULATED_LANES[key], 0.0)
    return out


def _search(shape: ModelShape, train: TrainShape, hw: HardwareProfile,
            device_budget: int | None, host_budget: int | None, *, orders: tuple[str, ...],
            park_boundaries: bool, replays: dict | None = None, simulate: bool = False) -> Plan:
    """`plan`'s search: the fastest plan that fits, else the one that overshoots least.
    `replays`: `_fill_host`'s cache, shared by searches of one step shape. Each variant (order,
    activations, boundary tier) grows its placement by the formula (`_times`: thousands of
    candidates); `simulate`: the variants that fit are then ranked by their simulated step
    (the replay of the engine's operations, `simulated_times`: one per variant, 0.2-2 s each
    at 7B), so the plan chosen is the one the simulated GPU runs fastest. Off for the
    advice's searches, which only ask whether a plan fits."""
    replays = {} if replays is None else replays
    budgets = usable_budgets(hw, device_budget=device_budget, host_budget=host_budget)
    n = len(shape.names)
    best: Plan | None = None
    fallback: Plan | None = None
    fitting: list[Plan] = []
    # kept graphs pin their boundary inputs on the device: parking them on the host goes with
    # recomputing every segment
    # (park_boundaries False: the run's activation policy keeps graphs somewhere)
    variants = [(order, keep, host) for order in (orders if train.micro_batches > 1 else orders[:1])
                for keep, host in ((True, False), (False, False), (False, True))
                if park_boundaries or not host]
    for order, keep, host in variants:
        # the write-back inside the update: _disk_options tries deferring it
        start = _fill_host(shape, train, hw, [SegmentPlacement(False, Tier.HOST)] * n,
                           order, keep, host, budgets, replays=replays)
        grow = functools.partial(_grow, shape, train, hw, order=order, keep=keep, host=host,
                                 budgets=budgets, replays=replays)
        candidate = grow(start, _priority(shape.names))
        if not candidate.fits:  # the largest state first: most RAM freed per segment moved
            by_size = grow(start, sorted(range(n), key=lambda i: -shape.state_bytes(i)))
            if by_size.fits or _overshoot(by_size) < _overshoot(candidate):
                candidate = by_size
        candidate = _disk_options(shape, train, hw, candidate, budgets, replays)
        candidate = _keep_streamed(shape, train, hw, candidate, budgets)
        if candidate.fits:
            fitting.append(candidate)
        if candidate.fits and (best is None or candidate.step_s < best.step_s):
            best = candidate
        if fallback is None or _overshoot(candidate) < _overshoot(fallback):
            fallback = candidate
    if best is not None and simulate and len(fitting) > 1:
        for candidate in fitting:
            candidate.times_s.update(simulated_times(shape, train, hw, candidate))
        # ties (equal simulated steps) go to the formula's order
        return min(fitting, key=lambda c: (c.times_s["simulated_step"], c.step_s))
    if best is not None:
        return best
    assert fallback is not None
    return fallback


def _keep_streamed(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
                   budgets: dict[str, int]) -> Plan:
    """Streamed blocks keep their graph too, last first (their backward comes first, so their
    saved tensors are held the shortest), while the device budget left by the candidate holds
    their saved tensors: no recompute for them, and nothing else changes (a kept graph holds
    positions in its weights, not the weights: tierlm.activations.policies). The same rule
    `--grad-checkpointing none` applies on its own (tierlm.activations.spec.keep_streamed), by
    the planner's byte model. Not for candidates that recompute every segment or park boundary
    inputs on the host (a kept graph pins its input on the device), nor for a LoRA base (the
    engine recomputes its streamed segments: tierlm.runtime.plan)."""
    if (not candidate.fits or candidate.keep_resident_activations is False
            or candidate.boundary_on_host or shape.frozen):
        return candidate
    keep = keeps_graph(candidate.placements, candidate.keep_resident_activations)
    last = len(keep) - 1
    other = candidate.workspace_bytes - activation_workspace_bytes(shape, train, keep[:last],
                                                                   candidate.order)
    kept = keep
    for s in reversed(range(last)):  # embed too: it saves only its token ids
        if kept[s]:
            continue
        trial = kept[:s] + [True] + kept[s + 1:]
        need = candidate.device_peak_bytes + other + activation_workspace_bytes(
            shape, train, trial[:last], candidate.order)
        if need <= budgets["device"]:
            kept = trial
    if kept == keep:
        return candidate
    p = _evaluate(shape, train, hw, candidate.placements, candidate.order, tuple(kept), budgets,
                  candidate.boundary_on_host, readahead=candidate.readahead,
                  writeback=candidate.writeback)
    return p if p.fits and p.step_s <= candidate.step_s else candidate


def _grow(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
          priority: list[int], *, order: str, keep: bool, host: bool,
          budgets: dict[str, int], replays: dict) -> Plan:
    """Grow the candidate's device share one segment at a time, in `priority` order (first
    resident weights, then state on the device), the rest of the state filled into RAM and
    disk by `_fill_host`: while the plan does not fit, wherever that brings it closer without
    pushing the device further over its budget (state on the device frees host RAM and disk;
    a device already short cannot pay for that); then while it fits and is not slower."""
    for upgrade in ("resident", "state"):
        for i in priority:
            trial = list(candidate.placements)
            cur = trial[i]
            if upgrade == "resident" and not cur.resident:
                trial[i] = SegmentPlacement(True, cur.state_tier)
            elif upgrade == "state" and cur.state_tier != Tier.DEVICE and (
                    cur.resident or not candidate.fits):  # (streamed ones: to fit at all)
                trial[i] = SegmentPlacement(True, Tier.DEVICE)
            else:
                continue
            p = _fill_host(shape, train, hw, trial, order, keep, host, budgets, replays=replays)
            if p.fits:
                if not candidate.fits or p.step_s <= candidate.step_s * 1.0001:
                    candidate = p
            elif not candidate.fits and _overshoot(p) < _overshoot(candidate) and (
                    _device_over(p) <= _device_over(candidate)):
                candidate = p
    return candidate


READAHEAD_EXTRA_SHARES = (0.0, 0.125, 0.25, 0.5, 1.0)
# write-backs pending at most (None: every disk-tier segment's) the planner tries
WRITEBACK_SEGMENTS: tuple[int | None, ...] = (1, 4, None)


def _disk_options(shape: ModelShape, train: TrainShape, hw: HardwareProfile, candidate: Plan,
                  budgets: dict[str, int], replays: dict | None = None) -> Plan:
    """The candidate with the three disk-tier options tried on its device choices: disk-tier
    gradients held in host RAM (fewer segments' state fits there); the update's read-ahead
    during the backward with a host budget of a share of the disk-tier update state beyond
    what the backward frees; and the write-back deferred behind the step, up to some
    segments' master and slots pending in host staging (the read-ahead's share and the
    write-back's segments are reserved, so fewer segments' state fits on the host). The
    fastest that fits, or the candidate."""
    from tierlm.runtime.readahead import ReadAhead

    if shape.frozen or not any(p.state_tier == Tier.DISK for p in candidate.placements):
        return candidate
    order, keep, host = (candidate.order, candidate.keep_resident_activations,
                         candidate.boundary_on_host)
    largest = max(shape.update_state_bytes(s) for s in range(len(shape.numels)))
    # the sweep does not depend on the write-back: replayed once
    replays = {} if replays is None else replays
    best = candidate
    for host_grads in (False, True):
        base = _fill_host(shape, train, hw, candidate.placements, order, keep, host, budgets,
                          host_grads=host_grads, replays=replays)
        disk_state = sum(shape.update_state_bytes(s) for s, p in enumerate(base.placements)
                         if p.state_tier == Tier.DISK)
        n_disk = sum(p.state_tier == Tier.DISK for p in base.placements)
        limits = sorted({n_disk if n is None else min(n, n_disk) for n in WRITEBACK_SEGMENTS})
        for share in (None, *READAHEAD_EXTRA_SHARES):
            extra = 0 if share is None else int(share * disk_state)
            ra = None if share is None else ReadAhead(extra_bytes=extra)
            for segments in (None, *limits):
                wb = None if segments is None else WriteBack(segments=segments)
                # the read-ahead's share reserved; then, where the pending write-backs do not
                # fit beside it, theirs too
                for reserve in dict.fromkeys((extra, extra + (segments or 0) * largest)):
                    p = _fill_host(shape, train, hw, candidate.placements, order, keep, host,
                                   budgets, reserve=reserve, host_grads=host_grads,
                                   readahead=ra, writeback=wb, replays=replays)
                    if p.fits and p.step_s < best.step_s * 0.9999:
                        best = p
                    if p.fits:
                        break
    return best


def _device_over(p: Plan) -> int:
    return max(0, p.device_total_bytes - p.budgets["device"])


def _overshoot(p: Plan) -> float:
    b = p.budgets
    return (max(0, p.device_total_bytes - b["device"]) + max(0, p.host_peak_bytes - b["host"])
            + max(0, p.disk_bytes - b["disk"]))


def parked_bytes(shape: ModelShape, train: TrainShape, order: str, on_host: bool) -> int:
    """Host bytes of the boundary activations parked there at the forward's end: the inputs
    the engine parks when every block recomputes (tierlm.runtime.schedule.parked_inputs: every
    block's; the head's is used at once), for the micro-batches in flight."""
    from tierlm.runtime.schedule import micro_batches_in_flight, parked_inputs

    parked = parked_inputs(["full"] * (len(shape.names) - 1), on_host)
    return micro_batches_in_flight(train.micro_batches, order) * len(parked) * \
        train.batch_size * train.seq_len * shape.hidden_size * 4


def _host_then_disk(
    shape: ModelShape, placements, budgets, precision: str = "fp32", parked: int = 0,
    host_grads: bool = False, extra: int = 0,
    ring_bytes: Callable[[list[SegmentPlacement]], int] = lambda placements: 0,
) -> list[SegmentPlacement]:
    """Give host RAM to non-device state (and its compute copy, in bf16/fp8) while it fits;
    spill the last blocks first (their update is needed last by the next forward, so disk
    latency hides best there). `host_grads`: a spilled segment keeps its gradient in host RAM
    (no gradient byte touches the disk); `parked`: host bytes reserved for other uses;
    `extra`: segments spilled, in the same order, beyond those this estimate spills (the
    estimate leaves out staging only the replay knows: `_fill_host` backs off by it);
    `ring_bytes`: the gradients' landing ring under a placement, held beside the state through
    the sweep, less what of `parked` it is not held beside (the estimate then also checks
    the state and the ring together: a lower bound of the replay's peak)."""
    from tierlm.runtime.state import load_bytes  # the engine's loader rule (it imports memory)

    placements = [
        p if p.state_tier == Tier.DEVICE else SegmentPlacement(p.resident, Tier.HOST)
        for p in placements
    ]
    grad_tier = Tier.HOST if host_grads and not shape.frozen else None
    held = [_host_held_bytes(shape, i, precision) for i in range(len(shape.numels))]
    host_state = parked + sum(
        h for h, p in zip(held, placements, strict=True) if p.state_tier == Tier.HOST)

    def staging(i: int) -> int:  # one disk update + one streamed read in flight
        wire = shape.wire_bytes(i, precision)
        # the engine's loader: fp32 state streams through chunks, a compute copy is staged whole
        read = load_bytes(Tier.DISK, shape.numels[i], wire, STAGING_CHUNK_NUMEL).staging_bytes
        return shape.update_staging(i, wire, host_grad=grad_tier is not None) + read

    spilled = 0
    for i in _spill_order(shape):
        if host_state + spilled <= budgets["host"] and (
                host_state + ring_bytes(placements) <= budgets["host"]):
            if extra <= 0:
                break
            extra -= placements[i].state_tier == Tier.HOST
        if placements[i].state_tier == Tier.HOST:
            placements[i] = SegmentPlacement(placements[i].resident, Tier.DISK, grad_tier)
            host_state -= held[i] - (0 if grad_tier is None else GRAD_B * shape.numels[i])
            spilled = max(spilled, staging(i))
    return placements


@functools.lru_cache(maxsize=4096)
def _segment_ring_numel(n_segments: int, micro_batches: int, order: str, frozen: bool, s: int,
                        p: SegmentPlacement, numel: int) -> int:
    """Elements of the landing ring segment `s`'s own gradient landings need under placement
    `p` (tierlm.runtime.schedule.landing_ring_numel over its landings alone): the step's ring
    is the largest of these."""
    from tierlm.runtime.schedule import landing_ring_numel, step_schedule

    if not transient_grad(p.state_tier, frozen):
        return 0
    landings: list = [None] * n_segments
    landings[s] = (p.state_tier, p.gradient_tier, numel)
    actions = step_schedule(n_segments, micro_batches, order, first_trained=not frozen)
    return landing_ring_numel(actions, micro_batches, landings, STAGING_CHUNK_NUMEL)


def _spill_order(shape: ModelShape) -> list[int]:
    """The order in which `_host_then_disk` moves segments' state from host RAM to disk: the
    head, then the blocks from the last one back, the embedding last."""
    last = len(shape.names) - 1
    order = [i for i in range(last + 1) if shape.names[i] != "head"][::-1]
    return [last] + order if shape.names[last] == "head" else order


def _host_held_bytes(shape: ModelShape, s: int, precision: str) -> int:
    """Host RAM that segment `s`'s state (and its compute copy, in bf16/fp8) holds there."""
    return shape.state_bytes(s) + (shape.wire_bytes(s, precision) or 0)


def _fill_host(
    shape: ModelShape, train: TrainShape, hw: HardwareProfile, device_choice, order: str,
    keep: bool, host: bool, budgets: dict[str, int], *, reserve: int = 0,
    host_grads: bool = False, readahead: ReadAhead | None = None,
    writeback: WriteBack | None = None, replays: dict | None = None,
) -> Plan:
    """The plan of `device_choice` (which segments are resident, which keep their state on the
    device) with the rest of the state in host RAM as far as the replay says it fits, the
    remainder on disk. `_host_then_disk` spills by an estimate (held state plus one update's
    and one read's staging); the replay also counts what only the engine's walk shows (the
    gradients' landing ring, a forward's read beside an update's chunks, the boundary inputs
    parked meanwhile, pending write-backs), so while the replayed host peak is over the
    budget one segment more goes to disk, in the same order. `reserve`: host bytes kept free
    for the read-ahead and the write-back; `replays`: a cache of `_replay`s by placement and
    read-ahead, shared by callers that try several write-backs on one sweep."""
    replays = {} if replays is None else replays
    parked = parked_bytes(shape, train, order, host) + reserve
    segments = (len(shape.names), train.micro_batches, order, shape.frozen)

    def ring_bytes(placements: list[SegmentPlacement]) -> int:  # the replay's own rule
        # held beside the state, not beside the parked inputs and reserves (the backward that
        # lands gradients frees the parked inputs as it goes), so those are taken off
        return GRAD_B * max(_segment_ring_numel(*segments, s, p, shape.numels[s])
                            for s, p in enumerate(placements)) - parked

    def placed(extra: int) -> tuple[list[SegmentPlacement], Plan]:
        trial = _host_then_disk(shape, device_choice, budgets, train.precision, parked,
                                host_grads, extra, ring_bytes)
        key = (tuple(trial), order, keep, host, readahead)
        if key not in replays:
            replays[key] = _replay(shape, train, trial, order, keep, host, STAGING_CHUNK_NUMEL,
                                   readahead)
        return trial, _evaluate(shape, train, hw, trial, order, keep, budgets, host,
                                readahead=readahead, writeback=writeback, replay=replays[key])

    over_at = -1  # the most extra spills known to overshoot
    extra = 0
    while True:
        trial, p = placed(extra)
        over = p.host_peak_bytes - budgets["host"]
        if over <= 0 or not any(pl.state_tier == Tier.HOST for pl in trial):
            break
        over_at = extra
        # spill the next segments, in order, until the bytes they free cover the overshoot
        # (at least one; what they stage instead the replay checks)
        freed = 0
        for i in _spill_order(shape):
            if trial[i].state_tier == Tier.HOST and freed < over:
                extra += 1
                freed += _host_held_bytes(shape, i, train.precision) - (
                    GRAD_B * shape.numels[i] if host_grads and not shape.frozen else 0)
    # the jump may spill more than needed (a spill frees more than its state: staging and
    # write-backs with it): the fewest spills between that fit
    while p.host_peak_bytes <= budgets["host"] and extra - over_at > 1:
        mid = (over_at + extra) // 2
        _, q = placed(mid)
        if q.host_peak_bytes <= budgets["host"]:
            extra, p = mid, q
        else:
            over_at = mid
    return p


BUDGET_FLAGS = {"device": "--device-budget", "host": "--host-budget", "disk": "--disk-budget"}
BUDGET_WHAT = {"device": "device memory", "host": "host RAM",
               "disk": "free disk at --offload-dir"}
ADVICE_DOUBLINGS = 4  # past 16x the plan's own need, no budget of that tier is advised


def _size_text(nbytes: int) -> str:
    """`nbytes` rounded up to two decimals of the unit `gib` prints it in, as a flag's value."""
    unit, scale = _size_unit(nbytes)
    return f"{-(-nbytes * 100 // scale) / 100:.2f}{unit}"


def _size_unit(nbytes: float) -> tuple[str, int]:
    """The unit `gib` prints `nbytes` in."""
    return next(((u, k) for u, k in (("GiB", 2**30), ("MiB", 2**20)) if nbytes >= k),
                ("KiB", 2**10))


def _least_budget(fits_at: Callable[[int], bool], lo: int, need: int) -> str | None:
    """The least budget above `lo` (where it does not fit) at which `fits_at` holds, to three
    significant digits of the unit `gib` prints `need` in ("1.03GiB", "569MiB"), as a flag's
    value, checked at the bytes `tierlm.config.parse_bytes` reads back from it; None where
    none up to 2**ADVICE_DOUBLINGS x `need` fits. Starts at `need` (the closest plan's own
    need, where the answer usually is), gallops away from it, then bisects."""
    from tierlm.config import parse_bytes

    unit, scale = _size_unit(need)

    def stride(k: int) -> int:  # hundredths of the unit a printed digit stands for here
        return 100 if k >= 100 * 100 else 10 if k >= 10 * 100 else 1

    def text(k: int) -> str:  # k hundredths of the unit
        return f"{k / 100:.{ {100: 0, 10: 1, 1: 2}[stride(k)] }f}{unit}"

    tried: dict[int, bool] = {}

    def ok(k: int) -> bool:
        if k not in tried:
            tried[k] = fits_at(parse_bytes(text(k)))
        return tried[k]

    def up(k: int) -> int:  # k rounded up to a printed value
        return -(-k // stride(k)) * stride(k)

    k_lo = lo * 100 // scale  # its printed value is at most `lo`: it does not fit
    k_hi = up(max(k_lo + 1, -(-need * 100 // scale)))
    if ok(k_hi):  # gallop down to a value that does not fit
        step = stride(k_hi)
        while k_hi - step > k_lo and ok(k_hi - step):
            k_hi -= step
            step *= 2
        k_lo = max(k_lo, k_hi - step)
    else:  # gallop up
        for _ in range(ADVICE_DOUBLINGS):
            k_lo, k_hi = k_hi, up(2 * k_hi)
            if ok(k_hi):
                break
        else:
            return None
    while k_hi - k_lo > stride(k_hi):
        mid = up((k_lo + k_hi) // 2)
        if mid >= k_hi:
            break
        if ok(mid):
            k_hi = mid
        else:
            k_lo = mid
    return text(k_hi)


def _what_would_fit(search: Callable[..., Plan], shape: ModelShape, train: TrainShape,
                    hw: HardwareProfile, p: Plan, device_budget: int | None,
                    host_budget: int | None) -> list[str]:
    """What would make `p`'s search find a plan: for each budget it overshoots, the least
    value of that budget alone at which `search` (the planner's own) finds one, checked at the
    value printed; all of them together where none alone does; and on the device, the step
    and precision changes that `search` confirms fit within the budgets as they are."""
    sizes = {"device": hw.gpu_memory_bytes - (0 if hw.device_is_cpu else GPU_RESERVE_BYTES),
             "host": hw.host_memory_bytes}
    raw = {"device": device_budget if device_budget is not None else sizes["device"],
           "host": host_budget if host_budget is not None else sizes["host"],
           "disk": hw.disk_budget_bytes}
    from tierlm.config import parse_bytes

    needs = {"device": p.device_total_bytes, "host": p.host_peak_bytes, "disk": p.disk_bytes}
    over = [t for t in raw if needs[t] > p.budgets[t]]

    def fits(budgets: dict[str, int], step: TrainShape = train) -> bool:
        return search(step, hw.with_overrides(disk_budget_bytes=budgets["disk"]),
                      budgets["device"], budgets["host"]).fits

    def need(t: str) -> int:  # the plan's own need, grossed up by the margin
        return int(needs[t] / (1 - SAFETY_MARGIN))

    hints = []
    for t in over:
        least = _least_budget(lambda v, t=t: fits({**raw, t: v}), raw[t], need(t))
        if least is not None:
            beyond = (f", more than {hw.name}'s {gib(sizes[t])}"
                      if parse_bytes(least) > sizes.get(t, 1 << 62) else "")
            hints.append(f"at least {least} of {BUDGET_WHAT[t]}{beyond} ({BUDGET_FLAGS[t]} "
                         f"{least})")
    if not hints and len(over) > 1:  # raised together, each to its share of its own need
        def raised(share: int) -> dict[str, int]:  # `share` in 1/1024ths of each need
            return {**raw, **{t: max(raw[t], need(t) * share // 1024) for t in over}}

        least = _least_budget(lambda v: fits(raised(v)), 1023, 1024)
        if least is not None:
            share = parse_bytes(least)
            values = {t: _size_text(raised(share)[t]) for t in over}
            if fits({**raw, **{t: parse_bytes(v) for t, v in values.items()}}):
                hints.append(" ".join(f"{BUDGET_FLAGS[t]} {v}" for t, v in values.items()))
    if "device" in over:
        steps = []
        if train.batch_size > 1:
            steps.append((f"a smaller micro-batch (--batch-size {train.batch_size // 2} "
                          f"--grad-accum-steps {train.micro_batches * 2})",
                          dataclasses.replace(train, batch_size=train.batch_size // 2,
                                              micro_batches=train.micro_batches * 2)))
        if train.precision == "fp32" and shape.base_bytes is None:
            steps.append(("--precision bf16 (smaller activations)",
                          dataclasses.replace(train, precision="bf16")))
        if p.workspace_bytes > p.budgets["device"] // 4:  # a long sequence: share it over ranks
            cp = 2 * train.context_parallel
            row = train.seq_len * train.context_parallel
            steps.append((f"--context-parallel {cp} (each rank holds {row // cp} tokens of "
                          "every row) or a shorter --seq-len",
                          dataclasses.replace(train, seq_len=row // cp, context_parallel=cp,
                                              nproc=max(train.nproc, cp))))
        hints += [text for text, step in steps if fits(raw, step)]
    return ["would fit with: " + "; or ".join(hints)] if hints else []


# -- presentation -------------------------------------------------------------------------------


def describe(
    p: Plan, shape: ModelShape, train: TrainShape, hw: HardwareProfile,
    run_flags: list[str] | None = None,
) -> str:
    lines = []
    n = shape.n_params
    emb = shape.numels[0]
    lines.append(f"model: {n / 1e9:.2f}B params ({shape.n_layers} blocks; embed "
                 f"{emb / 1e6:.0f}M, blocks {sum(shape.numels[1:-1]) / 1e9:.2f}B, head "
                 f"{shape.numels[-1] / 1e6:.0f}M{', tied' if shape.tied_numel else ''})")
    if shape.frozen:  # --finetune lora/qlora: a frozen base and the trained adapters
        base = sum(MASTER_B * shape.numels[s] if shape.base_copy(s) is None
                   else shape.base_copy(s) for s in range(len(shape.numels)))
        t, optim = shape.trained_numel, shape.trained_optim_bytes
        lines.append(f"model state by class: frozen base {gib(base)}; adapters "
                     f"{t / 1e6:.1f}M params: master {gib(MASTER_B * t)}, gradients "
                     f"{gib(GRAD_B * t)}, {shape.optim_name} state {gib(optim)} "
                     f"({optim / max(t, 1):.2f} B/param)  (all of it in one place needs "
                     f"{gib(base + (MASTER_B + GRAD_B) * t + optim)} + activations)")
    else:
        optim = sum(shape.optim_state_bytes)
        lines.append(f"model state by class: compute/master {gib(MASTER_B * n)}, gradients "
                     f"{gib(GRAD_B * n)}, {shape.optim_name} state {gib(optim)} "
                     f"({optim / n:.2f} B/param)  (all of it in one place needs "
                     f"{gib((MASTER_B + GRAD_B) * n + optim)} + activations)")
    lines.append(f"hardware: {hw.name}; budgets after a {SAFETY_MARGIN:.0%} margin: device "
                 f"{gib(p.budgets['device'])}, host {gib(p.budgets['host'])}, disk "
                 f"{gib(p.budgets['disk'])}")
    cp = train.context_parallel
    share = (f" per rank (context parallel {cp}: rows of {cp * train.seq_len})" if cp > 1
             else "")
    precision = train.precision
    if precision == "fp32" and not hw.device_is_cpu:
        rate = hw.fp32_compute_flops(tf32=train.tf32) / 1e12
        precision += (f" (TF32 tensor cores, {rate:.0f} TFLOPS peak)" if train.tf32 else
                      f" (IEEE, {rate:.0f} TFLOPS peak; --tf32 for the tensor cores)")
    lines.append(f"step: {train.micro_batches} x {train.batch_size} x {train.seq_len} "
                 f"tokens{share}, {precision}, micro-batch order {p.order}")
    compiled = compiled_block_source(train, hw)
    if compiled:
        lines.append(compiled)
    lines.append("")
    lines.append("peak bytes per tier (by tensor class):")
    for tier, total, classes in (
        ("device", p.device_peak_bytes, p.device_by_class),
        ("host", p.host_peak_bytes, p.host_by_class),
        ("disk", p.disk_bytes, p.disk_by_class),
    ):
        parts = ", ".join(f"{c} {gib(v)}" for c, v in classes.items())
        lines.append(f"  {tier:6s} {gib(total):>10s}  ({parts})")
    lines.append(f"  + device activation workspace {gib(p.workspace_bytes)} -> device total "
                 f"{gib(p.device_total_bytes)}")
    pinned = ", ".join(f"{c} {gib(v)}" for c, v in p.pinned_by_class.items())
    lines.append(f"  of host, pinned for PCIe copies {gib(p.pinned_peak_bytes)} at peak"
                 + (f" ({pinned})" if pinned else "")
                 + f", in one arena of {gib(p.pinned_arena_bytes)} (4 KiB units)"
                 if p.pinned_arena_bytes else "  of host, pinned for PCIe copies: nothing")
    counts = p.tier_counts()
    resident = p.resident_names()
    lines.append("")
    lines.append(f"placement: state on device {counts['device']}, host {counts['host']}, disk "
                 f"{counts['disk']} of {len(p.placements)} segments; compute weights resident: "
                 f"{_short(resident)}; streamed: {len(p.placements) - len(resident)}")
    host_grads = sum(pl.host_grad for pl in p.placements)
    if counts["disk"]:
        ra = ("off" if p.readahead is None else
              f"{len(p.readahead_segments)} segments' master and slots "
              f"({gib(sum(shape.update_state_bytes(s) for s in p.readahead_segments))}) read "
              f"during the backward, up to {gib(p.readahead.extra_bytes)} beyond what it frees")
        wb = ("inside the update" if p.writeback is None else
              f"behind the step, up to {p.writeback.segments} segments pending")
        lines.append(f"disk tier: gradients of {host_grads} of {counts['disk']} segments held in "
                     f"host RAM; update read-ahead: {ra}; master and slots written back {wb}")
    keeps = keeps_graph(p.placements, p.keep_resident_activations)
    streamed = [s for s, q in enumerate(p.placements[:-1]) if not q.resident]
    streamed_keep = sum(keeps[s] for s in streamed)
    lines.append(f"activations: resident segments "
                 f"{'keep their graph' if p.keep_resident_activations else 'recompute'}, "
                 + ("streamed segments recompute from their boundary input" if not streamed_keep
                    else f"{streamed_keep} of {len(streamed)} streamed segments keep theirs "
                    "(the last; the others recompute from their boundary input)")
                 + "; boundary activations wait on the "
                 + ("host" if p.boundary_on_host else "device"))
    t = p.times_s
    lines.append("")
    decode = f" incl. NF4 decode {t['decode']:.2f}" if t.get("decode") else ""
    behind = (f", of which the write-back {t['writeback']:.2f} drains behind the step"
              if t["writeback"] else "")
    lines.append(f"predicted step: {t['step']:.2f} s = sweep max(compute {t['compute']:.2f}"
                 f"{decode}, "
                 f"H2D {t['h2d']:.2f}, D2H {t['d2h']:.2f}, disk {t['sweep_disk']:.2f}) "
                 f"+ update stall {t['update_stall']:.2f} (the update, {t['update']:.2f} s = "
                 f"CPU {shape.optim_name} {t['cpu_update']:.2f} + disk "
                 f"{t['update_disk']:.2f}{behind}, runs behind the next step's first forward "
                 f"({t['update_window']:.2f} s); one disk serves sweep and update: "
                 f"{t['disk']:.2f} s)")
    if cp > 1 or train.nproc > 1:
        kv = ring_kv_bytes(shape, train, p.placements, p.keep_resident_activations)
        ring = (f"ring K/V {gib(kv)} sent per rank per step = {t['net']:.2f} s, overlapping "
                f"attention {t['attention']:.2f} s" if cp > 1 else "")
        how = "dense fp32" if train.grad_sync is None else train.grad_sync.summary()
        grads = (f"gradient sync ({how} over {train.nproc} ranks) "
                 f"{gib(grad_sync_bytes(shape, train))} per rank per step = "
                 f"{t['grad_sync']:.2f} s, {t['grad_sync_exposed']:.2f} s of it waited for"
                 if train.nproc > 1 else "")
        lines.append(f"  + net lane {t['net_lane']:.2f} s in the sweep's max, at "
                     f"{hw.net_Bps / 1e9:.1f} GB/s: " + "; ".join(x for x in (ring, grads) if x))
    if "simulated_step" in t:  # the replay of the engine's operations in virtual time
        busy = ", ".join(f"{lane} {t[f'simulated_{key}']:.2f}"
                         for key, lane in SIMULATED_LANES.items() if t[f"simulated_{key}"])
        lines.append(f"simulated step: {t['simulated_step']:.2f} s "
                     f"({t['simulated_step'] / max(t['simulated_compute'], 1e-30):.2f}x its "
                     f"compute {t['simulated_compute']:.2f}; the formula above: "
                     f"{t['step']:.2f} s); lanes busy: {busy}; compute waiting for copies "
                     f"{t['simulated_transfer_wait']:.2f}")
    lines.append(f"tokens/s: {p.tokens_per_s:,.0f}; bottleneck: {p.bottleneck}; lower bound "
                 f"{t['compute']:.2f} s (the step's compute at the profile's rate, "
                 f"{train.tokens_per_step / t['compute']:,.0f} tokens/s): predicted step "
                 f"{p.step_over_bound:.2f}x of it")
    lines.append("moved per step: " + ", ".join(
        f"{k} {gib(v)}" for k, v in p.moved_bytes.items() if v))
    lines.append("")
    if p.fits:
        lines.append("fits. Train with: tierlm train " + " ".join((run_flags or []) + flags(p)))
    else:
        lines.append("DOES NOT FIT: " + "; ".join(p.problems))
    return "\n".join(lines)


def _short(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names) if len(names) <= 6 else ", ".join(names[:6]) + f", ... ({len(names)})"


def flags(p: Plan) -> list[str]:
    out = ["--offload-policy", "auto", "--microbatch-order", p.order]
    if not p.keep_resident_activations:
        out += ["--grad-checkpointing", "full"]
    if p.boundary_on_host:
        out += ["--boundary-activations", "host"]
    return out


def ledger_prediction(p: Plan) -> dict[str, int]:
    return {
        "predicted_device_peak_bytes": p.device_peak_bytes,
        "predicted_host_peak_bytes": p.host_peak_bytes,
        "predicted_disk_bytes": p.disk_bytes,
    }
