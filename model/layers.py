"""Building blocks over jagged tokens: attention (the `gemrec.kernels` ops), MLPs, rotary positions, PMA.

Every block that does matmuls has `flops(...) -> (forward, backward)` counting the matmul FLOPs of the
real jagged lengths it sees (2 per multiply-add; backward = the input- and weight-gradient matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from gemrec.kernels import KernelOptions, attention_flops, gdpa, jagged_attention
from gemrec.kernels.reference import rope_cos_sin, rotate_half
from gemrec.model.moe import MoEFeedForward
from torch import nn


@dataclass
class Jagged:
    """Host-side facts about a jagged batch, enough to count FLOPs exactly."""

    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> list[int]:
        return list(accumulate(self.lengths, initial=0))

    @classmethod
    def uniform(cls, batch: int, length: int) -> Jagged:
        return cls([length] * batch)


def linear_flops(rows: int, fan_in: int, fan_out: int, input_grad: bool = True) -> tuple[int, int]:
    fwd = 2 * rows * fan_in * fan_out
    return fwd, fwd * (2 if input_grad else 1)


def add(*pairs: tuple[int, int]) -> tuple[int, int]:
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


class _FewRowsLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.num_rows, ctx.dtype = weight.shape[0], weight.dtype
        return F.embedding(indices, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (indices,) = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        one_hot = F.one_hot(indices.reshape(-1), ctx.num_rows).to(grad.dtype)
        return None, (one_hot.T @ grad).to(ctx.dtype)


def lookup_with_gemm_grad(indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(indices, weight)` whose weight gradient is `one_hot(indices)^T @ grad`."""
    return _FewRowsLookup.apply(indices, weight)


class FewRowsEmbedding(nn.Embedding):
    """An embedding of a few rows looked up by every token (time buckets, recency). On the GPU, inductor lowers the
    usual backward to a scatter-add whose atomics all land on those few rows (1.7 ms per h200-long step); there the
    weight's gradient is one GEMM, `one_hot(indices)^T @ grad`. On the CPU the GEMM is the slower (2.4x at 30k
    lookups), so the usual backward stays."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.is_cuda:
            return lookup_with_gemm_grad(input, self.weight)
        return super().forward(input)

    def flops(self, lookups: int) -> tuple[int, int]:
        return 0, 2 * lookups * self.num_embeddings * self.embedding_dim if self.weight.is_cuda else 0


class Rotary(nn.Module):
    """The separate rotary (`rope = "separate"`): cos/sin of each token's position looked up in tables built once
    (`gemrec.kernels.reference.rope_cos_sin`, float64 angles stored as float32), for `rotate_half` on q and k before
    the kernels. Tables keep trigonometry out of the step (compiled, the angles were recomputed inside every
    rotation kernel); the fused rotary (`rope = "fused"`) rotates inside the kernels instead."""

    # buffers (registered in __init__)
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, head_dim: int, base: float, max_positions: int):
        super().__init__()
        cos, sin = rope_cos_sin(torch.arange(max_positions), head_dim, base)
        self.register_buffer("cos_table", cos.float(), persistent=False)
        self.register_buffer("sin_table", sin.float(), persistent=False)

    def forward(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), float32, shape (tokens, 1, head_dim / 2): broadcast over (tokens, heads, head_dim / 2).
        `max_len` bounds the positions (each is below its sequence's length)."""
        capacity = self.cos_table.shape[0]
        if max_len > capacity:
            raise ValueError(
                f"rotary positions: a sequence of {max_len} tokens is longer than the "
                f"{capacity} positions of the rotary tables (raise model.rotary_max_positions)"
            )
        return self.cos_table[positions][:, None, :], self.sin_table[positions][:, None, :]


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def flops(self, tokens: int) -> tuple[int, int]:
        return add(
            linear_flops(tokens, self.fc1.in_features, self.fc1.out_features),
            linear_flops(tokens, self.fc2.in_features, self.fc2.out_features),
        )


class JaggedAttention(nn.Module):
    """Multi-head attention from query tokens to key/value tokens, jagged on both sides.

    `window`, `block` and `rope_base` are the kernels' mask and fused-rotary keywords, passed to every call as they
    are (None: off); no mask tensor is built here."""

    backend = "auto"  # the kernels' backend ("auto" | "reference"); the model sets it from its config
    kernel_options: KernelOptions | None = None  # the kernels' options; the model sets them from its constructor

    def __init__(
        self,
        dim: int,
        heads: int,
        kind: str = "softmax",
        causal: bool = False,
        *,
        window: int | None = None,
        block: int | None = None,
        rope_base: float | None = None,
    ):
        super().__init__()
        if kind not in ("softmax", "silu"):
            raise ValueError(f"attention kind must be 'softmax' or 'silu', got {kind!r}")
        self.dim, self.heads, self.kind, self.causal = dim, heads, kind, causal
        self.window, self.block, self.rope_base = window, block, rope_base
        self.wq, self.wkv, self.wo = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, xq, xkv, q_offsets, kv_offsets, max_q_len, max_kv_len, rope=None):
        """`rope`: (cos, sin) from `Rotary` for self-attention (xq is xkv), or None."""
        h = self.heads
        hd = self.dim // h
        if rope is not None and self.rope_base is not None:
            raise ValueError("rotary positions are either fused (rope_base) or separate (rope), not both")
        if xq is xkv:  # self-attention: one GEMM for q, k and v, one rotation for q and k
            weight = torch.cat([self.wq.weight, self.wkv.weight])
            bias = torch.cat([self.wq.bias, self.wkv.bias])
            qkv = F.linear(xq, weight, bias).view(xq.shape[0], 3, h, hd)
            qk, v = qkv.split([2, 1], dim=1)  # backward: one cat (a slice and a select each fill a zero tensor)
            if rope is not None:
                qk = rotate_half(qk, *(t[:, None] for t in rope))
            (q, k), v = qk.unbind(1), v.squeeze(1)
        else:
            if rope is not None:
                raise ValueError("rotary positions apply to self-attention only")
            q = self.wq(xq).view(xq.shape[0], h, hd)
            k, v = self.wkv(xkv).view(xkv.shape[0], 2, h, hd).unbind(1)
        out = self.attend(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len)
        return self.wo(out.reshape(xq.shape[0], self.dim))

    def attend(self, q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len):
        """The kernels' op for this layer's kind: softmax is `jagged_attention`; silu is `gdpa` with SiLU normalised
        by each sequence's key count (HSTU-style)."""
        args = (q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len)
        kw = dict(
            causal=self.causal,
            window=self.window,
            block=self.block,
            rope_base=self.rope_base,
            backend=self.backend,
            options=self.kernel_options,
        )
        if self.kind == "softmax":
            return jagged_attention(*args, **kw)
        return gdpa(*args, activation="silu", normalize="kv_len", **kw)

    def flops(self, q: Jagged, kv: Jagged, query_proj_grad: bool = True) -> tuple[int, int]:
        d = self.dim
        return add(
            linear_flops(q.tokens, d, d, input_grad=query_proj_grad),
            linear_flops(kv.tokens, d, 2 * d),
            self.core_flops(q.offsets, kv.offsets),
            linear_flops(q.tokens, d, d),
        )

    def core_flops(self, q_offsets: list[int], kv_offsets: list[int]) -> tuple[int, int]:
        """The attention matmuls themselves over the pairs the mask lets through, model FLOPs (no recomputation in
        the backward)."""
        hd = self.dim // self.heads
        return attention_flops(q_offsets, kv_offsets, self.heads, hd, self.causal, window=self.window, block=self.block)


class SeqLayer(nn.Module):
    """Self-attention + MLP over the jagged history tokens, pre-norm (or `post_norm`: each residual sum normalised,
    as BERT and the SASRec baselines of the published tables); `dropout` on both residual branches; `window`,
    `block`, `rope_base`: the attention's mask and fused rotary (`JaggedAttention`)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        hidden: int,
        kind: str,
        causal: bool,
        dropout: float = 0.0,
        *,
        window: int | None = None,
        block: int | None = None,
        rope_base: float | None = None,
        post_norm: bool = False,
    ):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = JaggedAttention(dim, heads, kind, causal, window=window, block=block, rope_base=rope_base)
        self.mlp = Mlp(dim, hidden)
        self.dropout = nn.Dropout(dropout)
        self.post_norm = post_norm

    def forward(self, x, offsets, max_len, rope=None):
        if self.post_norm:
            x = self.norm1(x + self.dropout(self.attn(x, x, offsets, offsets, max_len, max_len, rope)))
            return self.norm2(x + self.dropout(self.mlp(x)))
        y = self.norm1(x)
        x = x + self.dropout(self.attn(y, y, offsets, offsets, max_len, max_len, rope))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def flops(self, seq: Jagged) -> tuple[int, int]:
        return add(self.attn.flops(seq, seq), self.mlp.flops(seq.tokens))


class PMA(nn.Module):
    """Pooling by multihead attention: K learned seeds (shared by all sequences) -> K tokens per sequence."""

    # buffers (registered in __init__)
    seed_offsets: torch.Tensor

    def __init__(self, dim: int, heads: int, hidden: int, seeds: int, kind: str, init_std: float):
        super().__init__()
        self.num_seeds = seeds
        self.seeds = nn.Parameter(torch.empty(seeds, dim))
        self.register_buffer("seed_offsets", torch.tensor([0, seeds]), persistent=False)
        nn.init.trunc_normal_(self.seeds, std=init_std)
        self.norm_kv, self.norm_out = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = JaggedAttention(dim, heads, kind)
        self.mlp = Mlp(dim, hidden)

    def forward(self, seq, seq_offsets, max_len, batch: int) -> torch.Tensor:
        k = self.num_seeds
        dim, heads = self.seeds.shape[1], self.attn.heads
        kv = self.norm_kv(seq)
        # The K seed queries are projected once and shared by every sequence (a 2-entry q_offsets).
        q = self.attn.wq(self.seeds).view(k, heads, dim // heads)
        keys, values = self.attn.wkv(kv).view(kv.shape[0], 2, heads, dim // heads).unbind(1)
        out = self.attn.attend(q, keys, values, self.seed_offsets, seq_offsets, k, max_len)
        x = self.seeds.unsqueeze(0) + self.attn.wo(out.reshape(batch, k, dim))
        return x + self.mlp(self.norm_out(x))

    def flops(self, seq: Jagged) -> tuple[int, int]:
        d, k = self.seeds.shape[1], self.num_seeds
        return add(
            linear_flops(k, d, d),
            linear_flops(seq.tokens, d, 2 * d),
            self.attn.core_flops([0, k], seq.offsets),  # the K seeds shared by every sequence
            linear_flops(seq.batch * k, d, d),
            self.mlp.flops(seq.batch * k),
        )


class TokenLayer(nn.Module):
    """Pre-norm layer over a fixed number of tokens per example, (B, n, dim).

    Self-attention among the tokens, optional cross-attention from them to the jagged sequence, then a
    feed-forward that is an MLP or a mixture of experts. `forward` returns (x, aux_loss or None).
    """

    def __init__(self, dim: int, heads: int, hidden: int, cross: bool, kind: str, moe: MoEFeedForward | None):
        super().__init__()
        self.norm_self, self.norm_ffn = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = JaggedAttention(dim, heads, kind)
        self.cross = cross
        if cross:
            self.norm_cross_q, self.norm_cross_kv = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.cross_attn = JaggedAttention(dim, heads, kind)
        self.ffn = moe if moe is not None else Mlp(dim, hidden)

    def forward(self, x, seq=None, seq_offsets=None, max_seq_len=0):
        batch, n, dim = x.shape
        flat = x.reshape(batch * n, dim)
        offsets = torch.arange(batch + 1, device=x.device) * n
        y = self.norm_self(flat)
        flat = flat + self.self_attn(y, y, offsets, offsets, n, n)
        if self.cross:
            kv = self.norm_cross_kv(seq)
            flat = flat + self.cross_attn(self.norm_cross_q(flat), kv, offsets, seq_offsets, n, max_seq_len)
        aux = None
        if isinstance(self.ffn, MoEFeedForward):
            out, aux = self.ffn(self.norm_ffn(flat))
        else:
            out = self.ffn(self.norm_ffn(flat))
        return (flat + out).view(batch, n, dim), aux

    def flops(self, batch: int, n: int, seq: Jagged | None) -> tuple[int, int]:
        tokens = Jagged.uniform(batch, n)
        parts = [self.self_attn.flops(tokens, tokens), self.ffn.flops(batch * n)]
        if self.cross:
            if seq is None:
                raise ValueError("a cross-attention layer's FLOPs need the sequence it attends to")
            parts.append(self.cross_attn.flops(tokens, seq))
        return add(*parts)
