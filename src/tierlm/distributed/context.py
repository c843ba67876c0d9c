"""Context parallelism: N ranks share every sequence, attention runs as a ring over them.

Layout. The run's ranks form a (dp, cp) grid, rank = dp_rank * cp + cp_rank: the cp ranks of one
data-parallel group see the same rows and each holds a zig-zag share of every sequence. The
sequence (T tokens) is cut into 2N chunks of c = T / 2N; cp rank r holds chunks r and 2N-1-r,
in that order, with their global positions (RoPE reads them). Under a causal mask every rank
then does the same work: a late chunk's many keys balance an early chunk's few.

Ring attention. Each rank's queries meet every rank's keys once: step 0 its own K/V (one
causal block: the two local chunks are in increasing position order, so the local causal mask
is the global one), then N-1 steps in which K/V arrive from rank r-1 (isend/irecv, posted
before the block is computed, so the transfer overlaps it). Against K/V of rank s, the causal
mask leaves exactly one dense half:

    s < r: every local query attends to s's first chunk (s < r < 2N-1-r), not to its second;
    s > r: only the local second chunk (2N-1-r) attends, to both of s's chunks.

Every block returns its output and log-sum-exp; outputs merge exactly (online log-sum-exp, in
fp32). The backward mirrors it: the K/V ring turns again, each block's gradients come from the
kernel's own backward given the merged output and log-sum-exp (so the softmax is the global
one), dQ stays, and dK/dV travel with the K/V they belong to in an fp32 accumulator that
arrives home after N sends.

K/V cross the ring with their own (GQA: fewer) heads and are expanded per block. Bytes each
rank sends per attention call, with kv_bytes = 2 * B * Hkv * (T/N) * D * element size:

    forward:  (N-1) * kv_bytes
    backward: (N-1) * kv_bytes + N * kv_bytes_fp32     (K/V again, then dK/dV home)

`torch.distributed.tensor.experimental.context_parallel` (torch 2.13) does not run here: it
intercepts the CUDA SDPA kernels (flash, efficient, cuDNN) and fails on CPU with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"; it also wants DTensor buffers and a device mesh. This ring is torch.distributed
point-to-point ops only, so it runs on gloo; on CPU each block is the fused
`_scaled_dot_product_flash_attention_for_cpu` kernel (which returns the log-sum-exp), elsewhere
an exact fp32 math block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tierlm.config import ConfigError
from tierlm.memory.tiers import Link
from tierlm.models.adapters import SUPPORTED

ATTN_IMPLEMENTATION = "tierlm_ring"


# -- the layout ----

@dataclass(frozen=True)
class ContextLayout:
    """Where this rank sits in the (dp, cp) grid."""

    rank: int
    world_size: int
    cp: int

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks of this rank's CP group, in ring order."""
        first = self.dp_rank * self.cp
        return list(range(first, first + self.cp))


def zigzag_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """(seq_len / cp,) global positions cp rank `cp_rank` holds: chunks r and 2N-1-r of 2N."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x {cp} chunks")
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([first, second])


def ring_send_bytes(*, cp: int, batch: int, kv_heads: int, local_len: int, head_dim: int,
                    element_bytes: int, layers: int, backward: bool = True) -> int:
    """What one rank sends through the ring for `layers` attention calls (the formula above)."""
    kv = 2 * batch * kv_heads * local_len * head_dim
    fwd = (cp - 1) * kv * element_bytes
    bwd = (cp - 1) * kv * element_bytes + cp * kv * 4 if backward else 0
    return layers * (fwd + bwd)


# -- the ring ----

@dataclass
class Ring:
    """One rank's CP group: point-to-point neighbours and the bytes sent through them."""

    group: dist.ProcessGroup | None
    ranks: list[int]  # global ranks in ring order
    index: int  # this rank's place in `ranks`
    sent_bytes: int = field(default=0)
    ledger: Any = None  # the engine's ledger: K/V bytes count as Link.NET_SEND there too

    @property
    def size(self) -> int:
        return len(self.ranks)

    def source(self, step: int) -> int:
        """The ring index whose K/V this rank holds at `step`."""
        return (self.index - step) % self.size

    def pass_on(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Send `t` to the next rank and receive its likes from the previous one, async: the
        buffer that will hold what arrives, and the requests to wait on."""
        got = torch.empty_like(t)
        nxt = self.ranks[(self.index + 1) % self.size]
        prv = self.ranks[(self.index - 1) % self.size]
        # gloo pairs sends and receives by (peer, tag): K/V and dK/dV use different tags
        reqs = [dist.isend(t, nxt, group=self.group, tag=tag),
                dist.irecv(got, prv, group=self.group, tag=tag)]
        nbytes = t.numel() * t.element_size()
        self.sent_bytes += nbytes
        if self.ledger is not None:
            self.ledger.record_move(Link.NET_SEND, nbytes)
            self.ledger.record_move(Link.NET_RECV, nbytes)
        return got, reqs


def _wait(reqs: list) -> None:
    for r in reqs:
        r.wait()


def build_ring(layout: ContextLayout) -> Ring:
    """This rank's ring. Collective: every rank creates every CP group, in the same order."""
    mine = None
    for d in range(layout.dp):
        ranks = list(range(d * layout.cp, (d + 1) * layout.cp))
        group = dist.new_group(ranks) if layout.dp > 1 else dist.group.WORLD
        if d == layout.dp_rank:
            mine = group
    return Ring(group=mine, ranks=layout.cp_ranks, index=layout.cp_rank)


# -- which tokens of a micro-batch this rank trains on (tierlm.runtime.sequence_share: the
# protocol the engine calls, and its whole-sequence default) ----

@dataclass
class ZigzagShare:
    """This rank's zig-zag share of every row. Its loss needs no factor of its own: the engine
    divides each rank's summed token loss by the trained tokens of every rank's step over the
    world size (tierlm.distributed.comm.Comm.token_divisor), so the data-parallel mean of the
    gradients over all ranks, CP and row groups alike, is that of the whole step's mean."""

    layout: ContextLayout
    ring: Ring

    def take(self, ids, targets, positions):
        """(B, T/N) ids, targets and global positions of this rank's tokens."""
        if positions is not None:
            raise ConfigError(
                "--context-parallel: the ring's causal mask spans the whole row, so packed "
                "examples with their own positions would see each other: use --data.packing "
                "stream or off, or drop --context-parallel"
            )
        mine = zigzag_positions(ids.shape[1], self.layout.cp, self.layout.cp_rank)
        mine = mine.to(ids.device)
        return ids[:, mine], targets[:, mine], mine.unsqueeze(0).expand(ids.shape[0], -1)


# -- one block: output and log-sum-exp, and its backward ----

def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, Hkv, L, D) K or V repeated to the queries' heads (GQA)."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_expand`: sum each group of repeated heads."""
    b, h, length, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.view(b, kv_heads, h // kv_heads, length, d).sum(2)


def _causal(q_len: int, k_len: int, device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def _block_forward(q, k, v, causal: bool, scale: float, fused: bool | None = None):
    """(out in q's dtype, lse fp32 (B, H, Lq)) of q (B, H, Lq, D) against k, v (B, Hkv, Lk, D).
    `fused`: the CPU flash kernel (default on CPU), else the exact fp32 math block."""
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if fused if fused is not None else q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return out.to(q.dtype), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float,
                    fused: bool | None = None):
    """dq (q's heads), dk, dv (K/V's heads) of one block, in fp32, given the merged output and
    log-sum-exp of the whole attention (so the probabilities are the global softmax's)."""
    kv_heads = k.shape[1]
    k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    if fused if fused is not None else q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(torch.float32), 0.0, causal, scale=scale)
        dq, dk, dv = dq.float(), dk.float(), dv.float()
    else:
        qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
        s = (qf @ kf.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_causal(s.shape[-2], s.shape[-1], s.device), float("-inf"))
        p = torch.exp(s - lse.unsqueeze(-1))  # (B, H, Lq, Lk)
        dv = p.transpose(-1, -2) @ df
        dp = df @ vf.transpose(-1, -2)
        delta = (df * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq, dk = ds @ kf, ds.transpose(-1, -2) @ qf
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _merge(acc_out, acc_lse, out, lse) -> None:
    """Fold a block's (out, lse) into the running fp32 (acc_out, acc_lse), in place."""
    new = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1))
    acc_out.add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    acc_lse.copy_(new)


class RingAttention(torch.autograd.Function):
    """Causal attention of zig-zag shares over a ring: q (B, H, T/N, D), k, v (B, Hkv, T/N, D)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, ring: Ring):
        half = q.shape[2] // 2
        kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, L, D): one message per step
        acc_out = acc_lse = None
        for step in range(ring.size):
            reqs = []
            if step < ring.size - 1:
                nxt, reqs = ring.pass_on(kv, tag=0)
            src = ring.source(step)
            if step == 0:
                out, lse = _block_forward(q, kv[0], kv[1], True, scale)
                acc_out, acc_lse = out.float(), lse.clone()
            elif src < ring.index:  # all queries, the sender's first chunk
                out, lse = _block_forward(q, kv[0, :, :, :half], kv[1, :, :, :half], False, scale)
                _merge(acc_out, acc_lse, out, lse)
            else:  # the second local chunk, all of the sender's keys
                out, lse = _block_forward(q[:, :, half:], kv[0], kv[1], False, scale)
                _merge(acc_out[:, :, half:], acc_lse[:, :, half:], out, lse)
            _wait(reqs)
            if reqs:
                kv = nxt
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.scale, ctx.ring = scale, ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dout = dout.contiguous()
        half = q.shape[2] // 2
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv_reqs: list = []
        dkv_in = None
        for step in range(ring.size):
            reqs = []
            if step < ring.size - 1:
                nxt, reqs = ring.pass_on(kv, tag=0)
            src = ring.source(step)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            if step == 0:
                g = _block_backward(dout, q, kv[0], kv[1], out, lse, True, scale)
                dq += g[0]
                dkv[0], dkv[1] = g[1], g[2]
            elif src < ring.index:
                g = _block_backward(dout, q, kv[0, :, :, :half], kv[1, :, :, :half], out, lse,
                                    False, scale)
                dq += g[0]
                dkv[0, :, :, :half], dkv[1, :, :, :half] = g[1], g[2]
            else:
                g = _block_backward(dout[:, :, half:], q[:, :, half:], kv[0], kv[1],
                                    out[:, :, half:], lse[:, :, half:], False, scale)
                dq[:, :, half:] += g[0]
                dkv[0], dkv[1] = g[1], g[2]
            if step > 0:  # what the previous ranks accumulated for the same K/V
                _wait(dkv_reqs)
                dkv += dkv_in
            dkv_in, dkv_reqs = ring.pass_on(dkv, tag=1)
            _wait(reqs)
            if reqs:
                kv = nxt
        _wait(dkv_reqs)  # after N passes this rank's own dK/dV, summed over every rank
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None


def ring_attention(q, k, v, scale: float, ring: Ring) -> torch.Tensor:
    """(B, H, T/N, D) causal attention output of this rank's queries over the whole sequence."""
    if ring.size == 1:  # one rank holds the whole sequence: nothing to pass around
        return torch.nn.functional.scaled_dot_product_attention(
            q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), is_causal=True, scale=scale)
    return RingAttention.apply(q, k, v, scale, ring)


# -- the seam into transformers ----

def ring_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, cp_ring: Ring | None = None, **kwargs):
    """An attention function for transformers' `AttentionInterface`: ring attention when the
    model's forward is given `cp_ring=` (the CP stepper's training and evaluation forward),
    SDPA otherwise (sampling from the full sequence on one rank)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cp_ring is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("--context-parallel: attention dropout is not supported; set the "
                         "model's attention_dropout to 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query, key, value, scale, cp_ring)  # (B, H, L, D)
    return out.transpose(1, 2).contiguous(), None


def check_ring_model(model: torch.nn.Module) -> None:
    """Refuse models the ring does not compute exactly: attention not routed through
    transformers' attention interface, sliding windows (the ring's mask is plain causal).
    GPT-2's learned positions need nothing more: its embedding looks up the global positions
    the share gives, as RoPE reads them in the Llama family."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ConfigError(
            f"--context-parallel: {cfg.model_type} is not supported (attention not routed "
            f"through the ring); it runs the {', '.join(SUPPORTED)} families: drop "
            "--context-parallel"
        )
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or (
        cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None))
    if sliding:
        raise ConfigError("--context-parallel: sliding-window attention is not supported (the "
                          "ring's mask is plain causal): drop --context-parallel")


def use_ring_attention(model: torch.nn.Module) -> None:
    """Route `model`'s attention through `ring_attention_forward` (SDPA when not given a ring).
    No mask is built for this implementation: the ring applies the causal mask itself."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    for sub in model.modules():  # sub-configs some models keep per module
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTN_IMPLEMENTATION
