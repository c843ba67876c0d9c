"""The shapes the planner and the byte replay read: the model's (`ModelShape`, per-segment
sizes, layouts, the optimizer's state slots, the activation bytes a block saves per token, measured
once per model shape by running one block on the meta device under `saved_tensors_hooks`: exact
shapes, no memory) and the training step's (`TrainShape`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from tierlm.config import OptimConfig, PrecisionConfig
from tierlm.finetune.lora import lora_targets
from tierlm.memory.layout import FlatLayout
from tierlm.memory.placement import (
    GRAD_B,
    MASTER_B,
    STAGING_CHUNK_NUMEL,
    update_staging_bytes,
)
from tierlm.models import build_model
from tierlm.models.adapters import ModelAdapter, StepContext
from tierlm.optim import build_flat_optimizer
from tierlm.precision import prepare_precision
from tierlm.precision.nf4 import BLOCK, NF4Format
from tierlm.precision.policy import classify, linear_dims
from tierlm.precision.streaming import ComputeFormat


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
    # copy (tierlm.runtime.frozen: the adapted layers' weights in NF4, or the blocks' linear
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
    modules = dict(model.named_modules())
    shapes = []
    for name in lora_targets(model, lora.targets):
        d_in, d_out = linear_dims(modules[name])
        shapes += [(f"{name}.lora_A", (lora.rank, d_in), True),
                   (f"{name}.lora_B", (d_out, lora.rank), True)]
    return FlatLayout(shapes)


def _base_bytes(model, layouts, lora, base_format: str,
                precision: str) -> tuple[list[int | None], list[int], list[int]]:
    """Per segment, the bytes tierlm.runtime.frozen.FrozenBase holds its base in (None for a
    segment it leaves an fp32 master) and the most bytes one matmul decodes a weight into (the
    largest target's, with the decode's temporaries: tierlm.precision.nf4.NF4Linear): NF4 for the
    targets' weights (a multiple of 64 elements), or bf16 for every linear weight the default
    precision policy computes in bf16 (the blocks'), fp32 for the rest; and the NF4 weights
    each segment holds."""
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
    """Bytes autograd saves for one block's forward over `tokens` tokens under `precision`
    (`_fake_block_saved_storages`, summed)."""
    return sum(_fake_block_saved_storages(config, precision, tokens))


def _fake_block_saved_storages(config: Any, precision: str, tokens: int, batch: int = 1
                               ) -> list[int]:
    """Bytes of each storage autograd saves for one block's forward over `batch` rows of
    `tokens` tokens under `precision`, in the order it first saves them,
    counted as the runtime counts them (tierlm.activations.saved): per storage, without the
    segment's weights, its boundary input and the micro-batch context (rotary tables, masks),
    which the step holds anyway. The block runs on fake CPU tensors (shapes and dtypes, no
    memory), so SDPA takes the fused kernel the runtime takes (it saves q, k, v, the output and
    a (B, H, S) log-sum-exp: linear in the sequence; on the meta device it would take the math
    path and save the (B, H, S, S) softmax), and bf16 autocast and the precision policy's
    layers cast as they do in the run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = build_model(config, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if precision != "fp32":
            prepare_precision(model, PrecisionConfig(mode=precision), precision,
                              torch.device("cpu"), log=lambda line: None)
        seg = ModelAdapter(model).segments[1]
        views = {n: p for n, p, _ in seg.params}
        x = torch.empty(batch, tokens, model.config.hidden_size, requires_grad=True)
        pos = torch.arange(tokens).unsqueeze(0).expand(batch, tokens)
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
    return list(seen.values())


@functools.lru_cache(maxsize=32)
def _saved_storages_cached(config_json: str, precision: str, batch: int, tokens: int
                           ) -> tuple[int, ...]:
    config = _CONFIGS[config_json]
    rows = _fake_block_saved_storages(config, precision, tokens, batch)
    longer = _fake_block_saved_storages(config, precision, 2 * tokens, batch)
    if len(rows) != len(longer):  # not the same storages at twice the tokens: one buffer
        return (int(_saved_bytes_per_token(config, precision, tokens) * batch * tokens),)
    # what does not grow with the sequence (bf16, fp8: casts of fp32 weights, which a compute
    # copy of the run's own precision does not make) is left out, as the slope leaves it out
    return tuple(n for n, m in zip(rows, longer, strict=True) if m != n)


def block_saved_storage_bytes(config: Any, precision: str, batch: int, tokens: int
                              ) -> tuple[int, ...]:
    """Each storage one block's forward saves over `batch` x `tokens` tokens, in the order it
    saves them: what the `offload` policy copies to the host, one buffer per storage."""
    key = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
    _CONFIGS[key] = config
    return _saved_storages_cached(key, precision, batch, tokens)


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
