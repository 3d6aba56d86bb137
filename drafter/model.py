"""The EAGLE-3 draft model, laid out as SGLang's `LlamaForCausalLMEagle3` loads it.

One Llama decoder layer whose attention reads 2·H features (the normed token embedding next to
the normed hidden feature), `fc` fusing the target's three captured hidden states (3·H_target to
H), a final norm and an `lm_head` over a reduced draft vocabulary. The token embedding is the
target's, frozen, held as a buffer so that it is neither trained, checkpointed nor exported.

Attention is written for the training-time test (TTT) and for chain drafting at once: queries
attend causally to a *context* (keys of real positions, fed with the target's features) and to
the keys of the *drafts* made before them at the same position (fed with the drafter's own
outputs), which is what the drafter sees when it drafts several tokens in a row at inference.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3d.drafter.fusion import fused_on_cuda
from eagle3d.drafter.loss import Teacher, soft_cross_entropy

KV = tuple[Tensor, Tensor]  # keys and values, [B, kv_heads, T, head_dim]
# The attention's input projections as this model holds them, and as SGLang does.
QKV_HALVES = tuple(f"midlayer.self_attn.qkv_{half}.weight" for half in ("tokens", "hidden"))
SERVED_QKV = tuple(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv")
LOSS_DECAY = 0.8  # TTT step k weighs LOSS_DECAY**k: later drafts matter only if earlier ones hit


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default",
                                                                     "rope_theta": 10000.0})
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, target: Any, draft_vocab_size: int,
                    intermediate_size: int = 0) -> "DraftConfig":
        """The drafter's shape follows the target's (an HF config), as in EAGLE-3; its MLP is
        `intermediate_size` wide where that is set."""
        rope = getattr(target, "rope_parameters", None)
        if not rope:  # transformers 4.x keeps them apart
            rope = dict(getattr(target, "rope_scaling", None) or {"rope_type": "default"})
            rope["rope_theta"] = getattr(target, "rope_theta", 10000.0)
        heads = target.num_attention_heads
        return cls(hidden_size=target.hidden_size, target_hidden_size=target.hidden_size,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   num_attention_heads=heads,
                   num_key_value_heads=getattr(target, "num_key_value_heads", heads),
                   head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
                   rms_norm_eps=target.rms_norm_eps,
                   max_position_embeddings=target.max_position_embeddings,
                   vocab_size=target.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, target.vocab_size),
                   rope_parameters=dict(rope), hidden_act=getattr(target, "hidden_act", "silu"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # As rows: [B, T, H] and the picked [n, H] then share one compiled kernel.
        return _rms_norm(x.flatten(0, -2), self.weight, self.eps).view(x.shape)


@fused_on_cuda
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32, returned in x's dtype (bf16 under autocast: the next matmul's input)."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class Rotary(nn.Module):
    """RoPE with the target's rope settings; transformers computes the frequencies so that every
    rope type it knows (llama3, yarn, ...) matches what the serving side applies."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                         rope_parameters=dict(cfg.rope_parameters))
        self.rope = LlamaRotaryEmbedding(hf)

    def forward(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rope(x, positions)
        return cos[:, None], sin[:, None]  # broadcast over heads


@fused_on_cuda
def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _grouped(t: Tensor, kv_heads: int) -> Tensor:
    """[B, heads, T, ...] as [B, kv_heads, heads / kv_heads, T, ...]: each query head beside the
    others that share its key head, without repeating the keys."""
    return t.unflatten(1, (kv_heads, -1))


@fused_on_cuda
def _join_draft(merged: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                scale: float) -> tuple[Tensor, Tensor]:
    """One step of an online softmax: attention `merged` (float32) over keys whose
    log-sum-exp is `lse`, once one more key `k` per query and its value `v` join them. Grouped
    heads: q and merged [B, kv_heads, group, T, D], lse [B, kv_heads, group, T, 1], k and v
    [B, kv_heads, T, D]."""
    s = (q.float() * k.float()[:, :, None]).sum(-1, keepdim=True) * scale
    total = torch.logaddexp(lse, s)
    return merged * torch.exp(lse - total) + torch.exp(s - total) * v.float()[:, :, None], total


@fused_on_cuda
def _context_grads(grad: Tensor, out: Tensor, merged: Tensor, lse: Tensor,
                   total: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of the context's attention `out` and of its log-sum-exp `lse`, and
    grad . merged, which every key's gradient subtracts (softmax's Jacobian)."""
    g = grad.float()
    through = (g * merged.float()).sum(-1, keepdim=True)
    p = torch.exp(lse - total)
    return (p * g).to(out.dtype), p * ((g * out.float()).sum(-1, keepdim=True) - through), \
        through


@fused_on_cuda
def _draft_grads(dq: Tensor, grad: Tensor, through: Tensor, total: Tensor, q: Tensor,
                 k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One draft's share of the gradients: dq (float32) with its term added, and the draft's
    own dk and dv, summed over the query heads of their group."""
    g, qf, kf = grad.float(), q.float(), k.float()[:, :, None]
    p = torch.exp((qf * kf).sum(-1, keepdim=True) * scale - total)
    ds = p * ((g * v.float()[:, :, None]).sum(-1, keepdim=True) - through) * scale
    return dq + ds * kf, (ds * qf).sum(2).to(k.dtype), (p * g).sum(2).to(v.dtype)


class _DraftsMerge(torch.autograd.Function):
    """with_drafts, one draft at a time in both directions: whatever the number of drafts (1
    to TTT - 1), the same three fixed-signature kernels run. Compiled over a list instead, the
    merge was one graph per list length: ~25 s of compiling each on an H200, minutes before a
    TTT-7 trainer's first step. The backward recomputes each draft's scores from its keys
    rather than keeping them, as flash attention does. A log-sum-exp is kept as [..., T, 1]:
    every compiled kernel then has its features last (fusion.py)."""

    @staticmethod
    def forward(ctx, q: Tensor, out: Tensor, lse: Tensor, scale: float,
                *drafts: Tensor) -> Tensor:
        kv_heads = drafts[0].shape[1]
        # Fresh and contiguous, as every later join's inputs are: the first join takes the
        # same compiled graph.
        qg, merged, total = _grouped(q, kv_heads), *(
            _grouped(t, kv_heads).to(torch.float32, memory_format=torch.contiguous_format,
                                     copy=True) for t in (out, lse[..., None]))
        for k, v in zip(drafts[::2], drafts[1::2]):
            merged, total = _join_draft(merged, total, qg, k, v, scale)
        # Laid out as [B, T, heads, D], where o_proj's input then is a view of it: the tensor
        # kept for this backward is the one o_proj keeps, not a second copy.
        B, heads, T, D = out.shape
        result = out.new_empty(B, T, heads, D).transpose(1, 2)
        result.copy_(merged.flatten(1, 2))
        ctx.scale = scale
        ctx.save_for_backward(q, out, lse, result, total, *drafts)
        return result

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse, result, total, *drafts = ctx.saved_tensors
        kv_heads = drafts[0].shape[1]
        g, qg = _grouped(grad, kv_heads), _grouped(q, kv_heads)
        d_out, d_lse, through = _context_grads(g, _grouped(out, kv_heads),
                                               _grouped(result, kv_heads),
                                               _grouped(lse[..., None], kv_heads).float(), total)
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        d_drafts: list[Tensor] = []
        for k, v in zip(drafts[::2], drafts[1::2]):
            dq, dk, dv = _draft_grads(dq, g, through, total, qg, k, v, ctx.scale)
            d_drafts += [dk, dv]
        return (dq.flatten(1, 2).to(q.dtype), d_out.flatten(1, 2),
                d_lse.flatten(1, 2)[..., 0].to(lse.dtype), None, *d_drafts)


def with_drafts(q: Tensor, out: Tensor, lse: Tensor, drafts: list[KV], scale: float) -> Tensor:
    """The context's attention (`out`, `lse`) once the drafts at each query's own position
    join its softmax: dense_attention's result, from a kernel that saw the context alone. The
    drafts are one key per query: a dot product each, not attention blocks."""
    if not drafts:
        return out
    return _DraftsMerge.apply(q, out, lse, scale, *[t for kv in drafts for t in kv])


def dense_attention(q: Tensor, context: KV, drafts: list[KV], scale: float,
                    key_mask: Tensor | None = None) -> Tensor:
    """EAGLE-3 attention with materialised scores, one softmax over every key a query sees. The
    context is seen causally (query i is context index Tc - T + i); each of `drafts` holds one
    key per query, made earlier at the query's own position. `key_mask` [B, Tc] hides context
    keys a row does not hold (padding, when rows of different lengths share a batch). Returns
    [B, heads, T, head_dim]."""
    ctx_k, ctx_v = context
    T, Tc, kv_heads = q.shape[2], ctx_k.shape[2], ctx_k.shape[1]
    qg = _grouped(q, kv_heads)
    scores = (qg @ ctx_k[:, :, None].transpose(-1, -2)) * scale
    visible = (torch.arange(Tc, device=q.device)[None, :]
               <= torch.arange(Tc - T, Tc, device=q.device)[:, None])
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, None, :]
    scores = scores.masked_fill(~visible, float("-inf"))
    own = [(qg * k[:, :, None]).sum(-1, keepdim=True) * scale for k, _ in drafts]
    probs = torch.softmax(torch.cat([scores, *own], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :Tc] @ ctx_v[:, :, None]
    for j, (_, v) in enumerate(drafts):
        out = out + probs[..., Tc + j:Tc + j + 1] * v[:, :, None]
    return out.view(q.shape)


@fused_on_cuda
def _fold_lse_grad(out: Tensor, d_out: Tensor, d_lse: Tensor) -> Tensor:
    """`out` moved along `d_out` so that rowsum(d_out * result) = rowsum(d_out * out) - d_lse
    (_CausalAttention). d_lse [..., T, 1]. d_out is taken over its largest magnitude first:
    squared, a gradient as small as 1e-16 would fall under float32's smallest numbers (or a
    floor on |d_out|^2 would cut d_lse's share). A row of d_out all zeros has d_lse zero too
    (with_drafts' d_lse is p * g.(O - merged)): it leaves `out` as it is."""
    g = d_out.float()
    top = g.abs().amax(-1, keepdim=True)
    top = torch.where(top > 0, top, 1.0)
    unit = g / top
    norm = (unit * unit).sum(-1, keepdim=True)  # at least 1 where d_out is not all zeros
    return (out.float() - d_lse / top * unit / torch.where(norm > 0, norm, 1.0)).to(out.dtype)


def _laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    return t if t.stride() == like.stride() else torch.empty_like(like).copy_(t)


class _CausalAttention(torch.autograd.Function):
    """Causal attention of queries over the keys at their own positions, and its log-sum-exp,
    by the fused flash kernels PyTorch ships (cuDNN's on CUDA, its own on CPU): no [heads, T, T]
    scores, grouped KV heads as they are, any length.

    with_drafts reads the log-sum-exp, and these kernels' backwards take no gradient for it. It
    enters through the one place they read the output: a first pass computes D = rowsum(dO * O)
    and the scores' gradient is P * (dP - D), where the log-sum-exp's gradient makes it
    P * (dP - D + d_lse). So the backward is handed O' = O - d_lse / |dO|^2 * dO, whose D is
    D - d_lse. That costs no precision: with_drafts' dO is p * g and its d_lse is
    p * g.(O - merged), so |O' - O| <= |O - merged|, the size of an attention output.
    Against flex attention with its log-sum-exp's gradient, on an H200 (8B-sized draft, T=8192,
    bf16) the forward and backward took 4.35 against 5.54 ms (Kimi-K2.5-sized: 8.52 against
    10.33), gradients as close to flex's as PyTorch's own flash kernel's are (a development
    probe, 2026-12-04)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        if q.is_cuda:
            out, lse, *ctx.cudnn, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, True, False, scale=scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        # Without drafts the log-sum-exp is not used: its gradient then comes as None, not as
        # zeros to fold in.
        ctx.set_materialize_grads(False)
        return out, lse.view(out.shape[:-1])

    @staticmethod
    def backward(ctx, d_out: Tensor, d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        folded = out if d_lse is None else _fold_lse_grad(out, d_out, d_lse[..., None])
        # cuDNN's backward reads dO and O as laid out like the forward's output: handed
        # another layout it returns wrong gradients without a word (H200, torch 2.11).
        d_out, out = _laid_out_like(d_out, out), _laid_out_like(folded, out)
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = ctx.cudnn
            grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                d_out, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0,
                True, scale=ctx.scale)
        else:
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                d_out, q, k, v, out, lse, 0.0, True, scale=ctx.scale)
        return *grads, None


def ttt_attention(q: Tensor, context: KV, drafts: list[KV], scale: float) -> Tensor:
    """dense_attention for training, where the context is the queries' own positions: the
    fused causal kernel over the context, its log-sum-exp then merged with the drafts' keys."""
    if context[0].shape[2] != q.shape[2]:
        raise ValueError("ttt_attention needs the context to be the queries' positions")
    out, lse = _CausalAttention.apply(q, *context, scale)
    return with_drafts(q, out, lse, drafts, scale)


def fused_kernel_refusal(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """None where _CausalAttention's kernel runs on these tensors, else what it was handed.
    cuDNN's fused attention wants a recent GPU, bf16 or fp16 and a head size it was built for;
    called without this check it fails with a bare cuDNN error, and PyTorch's own check prints
    its reason from C++ instead of returning it."""
    if not q.is_cuda:
        return None
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    if torch.backends.cuda.can_use_cudnn_attention(params):
        return None
    major, minor = torch.cuda.get_device_capability(q.device)
    return f"{q.dtype}, head size {q.shape[-1]}, on a GPU of compute capability {major}.{minor}"


def attend(q: Tensor, context: KV, drafts: list[KV], scale: float,
           key_mask: Tensor | None) -> Tensor:
    # Training takes the fused kernel, where the dense scores would be [heads, T, T] per TTT
    # step; drafting (a context longer than the queries, rows hiding keys) stays dense.
    if torch.is_grad_enabled() and key_mask is None and context[0].shape[2] == q.shape[2]:
        refusal = fused_kernel_refusal(q, *context)
        if refusal is None:
            return ttt_attention(q, context, drafts, scale)
        # Said once per reason: Python's warnings show a message once from one place.
        warnings.warn(f"training attention materialises its scores (memory quadratic in the "
                      f"sequence length): cuDNN's fused kernel, which wants bf16 or fp16, "
                      f"cannot run on {refusal}")
    return dense_attention(q, context, drafts, scale, key_mask)


class Attention(nn.Module):
    """q, k and v read [normed token embedding ; normed hidden feature], 2·H features, through
    two projections, one per half, each giving q, k and v side by side: their sum is what
    SGLang's q_proj, k_proj and v_proj compute from the whole input (Eagle3Drafter's
    served_weights joins them). Apart, the embedding's share is projected once per unroll: TTT
    step k reads the tokens step 0 read, k positions on, so its share is step 0's moved by k
    rather than made again at every step (at the Kimi-K2.5 shape, TTT 7, 14% of a training
    step's FLOPs; bench/gpu_train.py train_flops)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        self.widths = [n * self.head_dim for n in (self.heads, self.kv_heads, self.kv_heads)]
        self.qkv_tokens = nn.Linear(cfg.hidden_size, sum(self.widths), bias=False)
        self.qkv_hidden = nn.Linear(cfg.hidden_size, sum(self.widths), bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, tokens: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                context: KV | None, drafts: list[KV] | None,
                key_mask: Tensor | None = None) -> tuple[Tensor, KV]:
        """`tokens`: qkv_tokens of the normed embeddings, for as many leading positions as
        have a token to read (the last TTT steps run past the sequence's end, where nothing is
        learnt); `hidden`: the normed feature at every position."""
        B, T, _ = hidden.shape
        qkv = self.qkv_hidden(hidden)
        qkv[:, :tokens.shape[1]] += tokens
        q, k, v = qkv.split(self.widths, dim=-1)
        # v goes into attention in rows of its own (q and k are rotated into fresh tensors):
        # left in qkv, its rows three times further apart, the attention's backward took 4 ms
        # more per step (flex attention, Kimi-K2.5 shape, T = 4096, H200; not measured again
        # with cuDNN's kernel).
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for t in (q, k, v.contiguous()))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if drafts is None:  # real positions: they join the context
            context, drafts = ((k, v) if context is None else
                               (torch.cat([context[0], k], dim=2),
                                torch.cat([context[1], v], dim=2))), []
        else:  # a draft step: the context is fixed, the chain so far is at the same position
            drafts = [*drafts, (k, v)]
        out = attend(q, context, drafts, 1.0 / math.sqrt(self.head_dim), key_mask)
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)
        return self.o_proj(out), (k, v)

    def joined(self, tokens: Tensor, hidden: Tensor) -> list[Tensor]:
        """qkv_tokens' and qkv_hidden's weights as q_proj's, k_proj's and v_proj's: [out, 2·H],
        the embedding's columns first."""
        return [torch.cat(pair, dim=1) for pair in zip(tokens.split(self.widths),
                                                       hidden.split(self.widths))]

    def halves(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """joined's inverse."""
        tokens, hidden = torch.cat([q, k, v]).chunk(2, dim=1)
        return tokens, hidden


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(_silu_mul(self.gate_proj(x), self.up_proj(x)))


@fused_on_cuda
def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """SGLang's EAGLE-3 midlayer: input_layernorm on the embedding, hidden_norm on the feature,
    the residual stream is the (unnormed) feature."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def tokens(self, embeds: Tensor) -> Tensor:
        """The token embeddings' share of the attention's q, k and v (Attention)."""
        return self.self_attn.qkv_tokens(self.input_layernorm(embeds))

    def forward(self, tokens: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
                context: KV | None, drafts: list[KV] | None,
                key_mask: Tensor | None = None) -> tuple[Tensor, KV]:
        attn, kv = self.self_attn(tokens, self.hidden_norm(hidden), cos, sin, context, drafts,
                                  key_mask)
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DraftConfig, embed_tokens: Tensor) -> None:
        super().__init__()
        if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"target embedding {tuple(embed_tokens.shape)} does not fit a "
                             f"drafter of vocab {cfg.vocab_size} and hidden size {cfg.hidden_size}")
        self.cfg = cfg
        self.register_buffer("embed_tokens", embed_tokens.detach().clone(), persistent=False)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def step(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, context: KV | None,
             drafts: list[KV] | None, key_mask: Tensor | None = None) -> tuple[Tensor, KV]:
        """One pass of the decoder layer. `hidden` is fc(aux) for real positions or the
        drafter's previous output for a draft step. `key_mask` [B, keys] marks the context keys
        each row holds: for real positions the context's and these positions' own, for a draft
        step the context's. Returns the pre-norm output (the feature the next draft step reads)
        and this pass's keys and values."""
        cos, sin = self.rotary(hidden, positions)
        return self.midlayer(self.tokens(input_ids, hidden.dtype), hidden, cos, sin, context,
                             drafts, key_mask)

    def tokens(self, input_ids: Tensor, dtype: torch.dtype) -> Tensor:
        return self.midlayer.tokens(F.embedding(input_ids, self.embed_tokens).to(dtype))

    def logits(self, out: Tensor) -> Tensor:
        return self.lm_head(self.norm(out))

    def served_weights(self) -> dict[str, Tensor]:
        """The trainable weights as SGLang's LlamaForCausalLMEagle3 names and holds them."""
        weights = {name: p.detach() for name, p in self.named_parameters()}
        halves = [weights.pop(name) for name in QKV_HALVES]
        return weights | dict(zip(SERVED_QKV, self.midlayer.self_attn.joined(*halves)))

    def load_served_weights(self, served: dict[str, Tensor]) -> None:
        """served_weights' inverse: every weight named, nothing else."""
        weights = dict(served)
        whole = [weights.pop(name) for name in SERVED_QKV if name in weights]
        if len(whole) == len(SERVED_QKV):
            weights |= dict(zip(QKV_HALVES, self.midlayer.self_attn.halves(*whole)))
        self.load_state_dict(weights, strict=True)

    def unroll(self, input_ids: Tensor, aux: Tensor, steps: int) -> list[Tensor]:
        """The training-time test: the pre-norm outputs of `steps` draft steps, [B, T, H] each.

        Step k at index t reads token t+1+k at position t+k; its feature is the target's
        (k = 0) or the drafter's own step k-1 output, and it attends causally to step 0's keys
        and to its own earlier steps at index t: exactly what chain drafting from index t sees.
        """
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        hidden = self.fc(aux)
        # Index t reads token t+1+k at step k: step 0's tokens from index k on, none past the
        # end (where no teacher is left to learn).
        tokens = self.tokens(input_ids[:, 1:], hidden.dtype)
        context: KV | None = None
        drafts: list[KV] = []
        outs = []
        for k in range(steps):
            cos, sin = self.rotary(hidden, positions + k)
            hidden, kv = self.midlayer(tokens[:, k:], hidden, cos, sin, context,
                                       None if k == 0 else drafts)
            if k == 0:
                context = kv
            else:
                drafts.append(kv)
            outs.append(hidden)
        return outs

    def forward(self, input_ids: Tensor, aux: Tensor, teacher: Teacher,
                steps: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Training losses against `teacher` (drafter/loss.py: what each step learns). Returns
        the total loss (step k weighted LOSS_DECAY**k) and, per step, the mean loss, the count
        of argmaxes equal to the teacher's and of positions."""
        losses, correct = [], []
        for out, pick in zip(self.unroll(input_ids, aux, steps), teacher.picks):
            # lm_head only where the loss counts: it is the largest matmul of the drafter.
            logits = self.logits(out[pick.batch, pick.index])
            loss, hits = soft_cross_entropy(logits, teacher.log_probs, pick.rows)
            losses.append(loss / max(logits.shape[0], 1))
            correct.append(hits)
        loss_per_step = torch.stack(losses)
        weights = LOSS_DECAY ** torch.arange(steps, device=loss_per_step.device,
                                             dtype=torch.float32)
        return ((loss_per_step * weights).sum(), loss_per_step.detach(),
                torch.stack(correct), teacher.counts)
