"""Shared helpers of the kernel tests: offsets, an independent per-sequence statement of the semantics (`naive`),
random inputs, one call of either op with all its gradients (`run`), and the error measures the tests assert on."""

import math

import torch
import torch.nn.functional as F
from gemrec.kernels import RelativeBias


def offsets_of(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], device=device)


def _each(x: torch.Tensor, fn) -> torch.Tensor:
    return torch.tensor([fn(int(e)) for e in x.flatten().tolist()], dtype=torch.long).view(x.shape)


def _pos_bucket(d: int, rel: RelativeBias) -> int:
    num_buckets = rel.position.shape[1]
    exact = num_buckets // 2
    if d < exact:
        return d
    return min(
        num_buckets - 1, exact + int(math.log(d / exact) / math.log(rel.max_distance / exact) * (num_buckets - exact))
    )


def _time_bucket(dt: int, rel: RelativeBias) -> int:
    return min(rel.time.shape[1] - 1, int(math.log(max(dt, 1)) / math.log(rel.time_log_base)))


def _rotated(x: torch.Tensor, positions: range, base: float) -> torch.Tensor:
    """Rotate-half RoPE of (len, heads, D) rows at `positions`, angles from scalar float64 math."""
    half = x.shape[-1] // 2
    angle = torch.tensor(
        [[p * base ** (-2 * m / x.shape[-1]) for m in range(half)] for p in positions], dtype=torch.float64
    ).view(-1, half)
    cos, sin = angle.cos()[:, None].to(x.dtype), angle.sin()[:, None].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sees(p: int, j: int, causal: bool, window: int | None, block: int | None) -> bool:
    """Whether a query at position p sees key j, straight from the API's words."""
    if causal and j > p:
        return False
    if window and not (p - window < j if causal else abs(p - j) < window):
        return False
    return not block or p // block == j // block


def naive(
    q,
    k,
    v,
    q_lens,
    kv_lens,
    *,
    activation="softmax",
    causal=False,
    scale=None,
    normalize="kv_len",
    window=None,
    block=None,
    rope_base=None,
    **bias,
):
    """One sequence at a time, scalar bucket and mask math in float64. A 1-entry `q_lens` (or `kv_lens`) is one
    sequence shared by every sequence of the other side. `bias`: attn_bias, rel (a RelativeBias), max_kv (for
    normalize="max_len")."""
    attn_bias, rel = bias.get("attn_bias"), bias.get("rel") or RelativeBias()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_seqs = max(len(q_lens), len(kv_lens))
    shared_q, shared_kv = len(q_lens) == 1 < num_seqs, len(kv_lens) == 1 < num_seqs
    outs, q0, k0, o0 = [], 0, 0, 0
    for b in range(num_seqs):
        lq, lk = q_lens[0 if shared_q else b], kv_lens[0 if shared_kv else b]
        qs, ks, vs = q[q0 : q0 + lq], k[k0 : k0 + lk], v[k0 : k0 + lk]
        if rope_base:
            qs, ks = _rotated(qs, range(lk - lq, lk), rope_base), _rotated(ks, range(lk), rope_base)
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if attn_bias is not None:
            s = s + attn_bias[o0 : o0 + lq, :, :lk].transpose(0, 1)
        if rel.position is not None:
            distance = (torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)[None, :]).abs()
            s = s + rel.position[:, _each(distance, lambda d: _pos_bucket(d, rel))]
        if rel.time is not None:
            dt = (rel.q_timestamps[o0 : o0 + lq, None] - rel.kv_timestamps[None, k0 : k0 + lk]).abs()
            s = s + rel.time[:, _each(dt, lambda t: _time_bucket(t, rel))]
        allowed = torch.tensor(
            [[sees(i + lk - lq, j, causal, window, block) for j in range(lk)] for i in range(lq)], dtype=torch.bool
        ).view(lq, lk)
        if activation == "softmax":
            w = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        else:
            act = {
                "silu": F.silu,
                "relu": F.relu,
                "relu2": lambda x: F.relu(x).square(),
                "gelu": F.gelu,
                "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
            }[activation]
            w = act(s) * allowed
            if normalize != "none":
                w = w / (lk if normalize == "kv_len" else bias["max_kv"]) if lk else w * 0
        outs.append(torch.einsum("hij,jhd->ihd", w, vs))
        q0, k0, o0 = q0 + (0 if shared_q else lq), k0 + (0 if shared_kv else lk), o0 + lq
    return torch.cat(outs) if outs else q[:0]
