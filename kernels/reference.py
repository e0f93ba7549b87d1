"""Pure-torch reference for jagged softmax attention and GDPA (padded internally, autograd-friendly).

Same semantics as the Triton kernels, bucket arithmetic included (float32), so tests can compare
them exactly. Materializes `[B, H, max_q_len, max_kv_len]`: fine for tests and small CPU models.
"""

import math

import torch
import torch.nn.functional as F
from gemrec.kernels.triton_attention import ACTIVATIONS


def pos_bucket(rel: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """|rel| exactly below num_buckets // 2, log-spaced up to max_distance, clamped to the last bucket."""
    exact = num_buckets // 2
    log_inv = torch.tensor((num_buckets - exact) / math.log(max_distance / exact), dtype=torch.float32)
    d = rel.abs()
    large = exact + (torch.log(d.clamp(min=exact).float() / exact) * log_inv).to(torch.int64)
    return torch.where(d < exact, d, large.clamp(max=num_buckets - 1))


def time_bucket(dt: torch.Tensor, num_buckets: int, log_base: float) -> torch.Tensor:
    """floor(log(max(|dt|, 1)) / log(log_base)), clamped to the last bucket."""
    log_inv = torch.tensor(1.0 / math.log(log_base), dtype=torch.float32)
    return (torch.log(dt.abs().float().clamp(min=1.0)) * log_inv).to(torch.int64).clamp(max=num_buckets - 1)


def _activation(s: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(s)
    if name == "gelu":
        return F.gelu(s)
    if name == "gelu_tanh":
        return F.gelu(s, approximate="tanh")
    if name == "relu":
        return F.relu(s)
    if name == "relu2":
        return F.relu(s).square()
    raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")


def _pad(x: torch.Tensor, start: torch.Tensor, length: torch.Tensor, max_len: int):
    """Rows [start, start+length) of a jagged tensor -> (B, max_len, ...) with zeros past the length."""
    pos = torch.arange(max_len, device=start.device)
    valid = pos[None, :] < length[:, None]
    if x.shape[0] == 0:
        return x.new_zeros((start.shape[0], max_len, *x.shape[1:])), valid
    idx = torch.where(valid, start[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    padded = x[idx]
    mask = valid.reshape(*valid.shape, *([1] * (x.dim() - 1)))
    return torch.where(mask, padded, torch.zeros_like(padded)), valid


def seq_ranges(q_offsets, kv_offsets, q_rows: int):
    """Per-sequence (q_start, q_len, kv_start, kv_len, out_offsets), with shared (single) q or kv broadcast."""
    num_seqs = max(q_offsets.numel(), kv_offsets.numel()) - 1
    q_offsets, kv_offsets = q_offsets.long(), kv_offsets.long()
    if q_offsets.numel() == 2 and num_seqs > 1:
        q_start, q_len = q_offsets[:1].expand(num_seqs), (q_offsets[1:] - q_offsets[:1]).expand(num_seqs)
    else:
        q_start, q_len = q_offsets[:-1], q_offsets[1:] - q_offsets[:-1]
    if kv_offsets.numel() == 2 and num_seqs > 1:
        kv_start, kv_len = kv_offsets[:1].expand(num_seqs), (kv_offsets[1:] - kv_offsets[:1]).expand(num_seqs)
    else:
        kv_start, kv_len = kv_offsets[:-1], kv_offsets[1:] - kv_offsets[:-1]
    out_offsets = torch.cat([q_len.new_zeros(1), torch.cumsum(q_len, 0)])
    return q_start, q_len, kv_start, kv_len, out_offsets


def attention_reference(
    q,
    k,
    v,
    q_offsets,
    kv_offsets,
    max_q_len,
    max_kv_len,
    *,
    activation="softmax",
    causal=False,
    scale=None,
    normalize="none",
    attn_bias=None,
    pos_table=None,
    time_table=None,
    q_timestamps=None,
    kv_timestamps=None,
    pos_max_distance=128,
    time_log_base=2.0,
):
    """out[i] = sum_j w(i, j) v[j] over each sequence's own keys; see `gemrec.kernels` for the semantics."""
    head_dim = q.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_start, q_len, kv_start, kv_len, out_offsets = seq_ranges(q_offsets, kv_offsets, q.shape[0])
    num_seqs = q_len.shape[0]
    qp, q_valid = _pad(q.to(compute), q_start, q_len, max_q_len)
    kp, kv_valid = _pad(k.to(compute), kv_start, kv_len, max_kv_len)
    vp, _ = _pad(v.to(compute), kv_start, kv_len, max_kv_len)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * scale
    rows = torch.arange(max_q_len, device=q.device)
    cols = torch.arange(max_kv_len, device=q.device)
    rel = rows[None, :, None] + (kv_len - q_len)[:, None, None] - cols[None, None, :]
    if attn_bias is not None:
        bp, _ = _pad(attn_bias.to(compute), out_offsets[:-1], q_len, max_q_len)
        s = s + bp.permute(0, 2, 1, 3)[..., :max_kv_len]
    if pos_table is not None:
        bucket = pos_bucket(rel, pos_table.shape[1], pos_max_distance)
        s = s + pos_table.to(compute)[:, bucket].permute(1, 0, 2, 3)
    if time_table is not None:
        qts, _ = _pad(q_timestamps, out_offsets[:-1], q_len, max_q_len)
        kts, _ = _pad(kv_timestamps, kv_start, kv_len, max_kv_len)
        bucket = time_bucket(qts[:, :, None] - kts[:, None, :], time_table.shape[1], time_log_base)
        s = s + time_table.to(compute)[:, bucket].permute(1, 0, 2, 3)
    valid = q_valid[:, None, :, None] & kv_valid[:, None, None, :]
    if causal:
        valid = valid & (rel >= 0)[:, None]
    if activation == "softmax":
        s = s.masked_fill(~valid, torch.finfo(compute).min)
        w = torch.softmax(s, dim=-1) * valid
    else:
        w = _activation(s, activation) * valid
        if normalize == "kv_len":
            w = w * torch.where(kv_len > 0, 1.0 / kv_len.clamp(min=1).to(compute), 0.0)[:, None, None, None]
        elif normalize == "max_len":
            w = w / max(max_kv_len, 1)
        elif normalize != "none":
            raise ValueError(f"unknown normalize {normalize!r}; expected 'none', 'kv_len' or 'max_len'")
    out = torch.einsum("bhij,bjhd->bihd", w, vp)
    total_out = int(q.shape[0] * num_seqs) if q_offsets.numel() == 2 and num_seqs > 1 else q.shape[0]
    row_seq = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_len, output_size=total_out)
    row_pos = torch.arange(total_out, device=q.device) - out_offsets[row_seq]
    return out[row_seq, row_pos].to(q.dtype)
