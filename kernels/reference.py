"""Pure-torch reference of `jagged_attention` and `gdpa`: the CPU path, and what every test compares against.

Same semantics as the Triton kernels, bucket arithmetic included (float32); scores and weights in float32 (float64
for float64 inputs), the result in the inputs' dtype; autograd gives every gradient. Sequences of similar length are
grouped and each group padded only to its own longest member (`max_padding`), with each group's score tensor capped
at `MAX_SCORES` elements: nothing of size tokens x tokens is built for a whole batch. Reads the offsets on the host
(one sync).
"""

import math

import torch
import torch.nn.functional as F
from gemrec.kernels.triton_attention import ACTIVATIONS

# A group admits a sequence whose query and key lengths are within this fraction of the group's longest; 0 groups
# equal lengths only, so the matmuls do exactly the jagged work.
MAX_PADDING = 0.125
# Largest score tensor (sequences x heads x query length x key length elements) one group materialises.
MAX_SCORES = 1 << 25


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


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles pos * base^(-2m/D), m < D/2, from float64 angles (as the model's tables):
    shape (*positions.shape, D/2), float64."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x's last dim, [x1 cos - x2 sin, x1 sin + x2 cos] for its halves x1, x2, computed in x's
    dtype; cos and sin (`rope_cos_sin`) broadcast against x[..., : D/2]."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def sequences(q_offsets: list[int], kv_offsets: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per sequence (q_start, q_len, kv_start, kv_len) from host offsets; a 2-entry side is shared by all."""
    num_seqs = max(len(q_offsets), len(kv_offsets)) - 1

    def side(off: list[int]) -> tuple[list[int], list[int]]:
        if len(off) == 2 and num_seqs > 1:
            return [off[0]] * num_seqs, [off[1] - off[0]] * num_seqs
        return off[:-1], [b - a for a, b in zip(off, off[1:])]

    return (*side(q_offsets), *side(kv_offsets))


def _length_groups(q_len: list[int], kv_len: list[int], heads: int, max_padding: float) -> list[list[int]]:
    """Non-empty sequences grouped so that padding each group to its longest member wastes little."""
    order = sorted((i for i in range(len(q_len)) if q_len[i] and kv_len[i]), key=lambda i: (-kv_len[i], -q_len[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            head = groups[-1][0]
            if (
                kv_len[i] >= (1 - max_padding) * kv_len[head]
                and (1 - max_padding) * q_len[head] <= q_len[i] <= q_len[head]
                and (len(groups[-1]) + 1) * heads * q_len[head] * kv_len[head] <= MAX_SCORES
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def _padded_rows(starts: torch.Tensor, lengths: torch.Tensor, padded: torch.Tensor):
    """Rows of sequences laid out back to back, each padded to its `padded` length: (row or 0, valid, position)."""
    which = torch.repeat_interleave(torch.arange(len(padded)), padded)
    pos = torch.arange(which.numel()) - (torch.cumsum(padded, 0) - padded)[which]
    valid = pos < lengths[which]
    return torch.where(valid, starts[which] + pos, 0), valid, pos


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
    window=None,
    block=None,
    rope_base=None,
    max_padding=None,
):
    """out[i] = sum_j w(i, j) v[j] over each sequence's own keys; see `gemrec.kernels` for the semantics (masks:
    `window`, `block`; rotary: `rope_base`, q and k rotated in the compute dtype). `max_padding`: the grouping's
    padding fraction, `MAX_PADDING` when None."""
    heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_start, q_len, kv_start, kv_len = sequences(q_offsets.tolist(), kv_offsets.tolist())
    if max(q_len, default=0) > max_q_len or max(kv_len, default=0) > max_kv_len:
        raise ValueError(
            f"a sequence is longer than max_q_len={max_q_len} / max_kv_len={max_kv_len} "
            f"(longest: {max(q_len, default=0)} / {max(kv_len, default=0)})"
        )
    if activation != "softmax" and normalize not in ("none", "kv_len", "max_len"):
        raise ValueError(f"unknown normalize {normalize!r}; expected 'none', 'kv_len' or 'max_len'")
    total_out = sum(q_len)
    groups = _length_groups(q_len, kv_len, heads, MAX_PADDING if max_padding is None else max_padding)
    # Index plans on the host: each group's members padded to its longest, all groups back to back.
    members = torch.tensor([i for group in groups for i in group], dtype=torch.long)
    lq_pad = torch.tensor([q_len[g[0]] for g in groups for _ in g], dtype=torch.long)
    lkv_pad = torch.tensor([kv_len[g[0]] for g in groups for _ in g], dtype=torch.long)
    q_lens, kv_lens = torch.tensor(q_len, dtype=torch.long), torch.tensor(kv_len, dtype=torch.long)
    out_start = torch.cumsum(q_lens, 0) - q_lens
    q_rows, q_valid, q_pos = _padded_rows(torch.tensor(q_start, dtype=torch.long)[members], q_lens[members], lq_pad)
    out_rows = torch.where(q_valid, out_start[members].repeat_interleave(lq_pad) + q_pos, 0)
    kv_rows, _, _ = _padded_rows(torch.tensor(kv_start, dtype=torch.long)[members], kv_lens[members], lkv_pad)
    # The output row of each padded query row; rows of sequences without keys read the zero row appended last.
    source_of_row = torch.full((total_out,), q_rows.numel(), dtype=torch.long)
    source_of_row[out_rows[q_valid]] = torch.arange(q_rows.numel())[q_valid]
    device = q.device
    sizes = [(len(g), q_len[g[0]], kv_len[g[0]]) for g in groups]
    q_all = q[q_rows.to(device)].to(compute).split([b * lq for b, lq, _ in sizes])
    kv_index = kv_rows.to(device)
    kv_split = [b * lkv for b, _, lkv in sizes]
    k_all, v_all = k[kv_index].to(compute).split(kv_split), v[kv_index].to(compute).split(kv_split)
    q_lens_dev, kv_lens_dev = q_lens[members].to(device), kv_lens[members].to(device)
    out_rows_dev = out_rows.to(device)
    outs = [torch.cat([q[:0], k[:0], v[:0]]).to(compute)]  # keeps the result in the graph when no group exists
    start = 0
    for (b, lq, lkv), qg, kg, vg, lens_q, lens_kv, rows in zip(
        sizes,
        q_all,
        k_all,
        v_all,
        q_lens_dev.split([b for b, _, _ in sizes]),
        kv_lens_dev.split([b for b, _, _ in sizes]),
        out_rows_dev.split([b * lq for b, lq, _ in sizes]),
    ):
        qg = qg.view(b, lq, heads, head_dim).transpose(1, 2)  # (b, H, lq, D)
        kg = kg.view(b, lkv, heads, head_dim).transpose(1, 2)
        vg = vg.view(b, lkv, heads, vg.shape[-1]).transpose(1, 2)
        q_pos, kv_pos = torch.arange(lq, device=device), torch.arange(lkv, device=device)
        if rope_base:  # queries at their bottom-right aligned positions, keys at their own
            cos, sin = rope_cos_sin(q_pos + (lens_kv - lens_q)[:, None], head_dim, rope_base)
            qg = rotate_half(qg, cos[:, None], sin[:, None])
            kg = rotate_half(kg, *rope_cos_sin(kv_pos, head_dim, rope_base))
        scores = (torch.matmul(qg, kg.transpose(-1, -2)) * scale).to(compute)  # (b, H, lq, lkv); fp32 under autocast
        allowed = (kv_pos < lens_kv[:, None])[:, None, None, :]
        if causal or pos_table is not None or window or block:
            rel = q_pos[:, None] + (lens_kv - lens_q)[:, None, None] - kv_pos  # (b, lq, lkv), bottom-right aligned
            if causal:
                allowed = allowed & (rel >= 0)[:, None]
            if window:
                allowed = allowed & ((rel if causal else rel.abs()) < window)[:, None]
            if block:
                q_block = torch.div(q_pos[:, None] + (lens_kv - lens_q)[:, None, None], block, rounding_mode="floor")
                allowed = allowed & (q_block == kv_pos // block)[:, None]
        if attn_bias is not None:
            scores = scores + attn_bias[rows][:, :, :lkv].to(compute).view(b, lq, heads, lkv).transpose(1, 2)
        if pos_table is not None:
            bucket = pos_bucket(rel, pos_table.shape[1], pos_max_distance)
            scores = scores + pos_table.to(compute)[:, bucket].transpose(0, 1)
        if time_table is not None:
            q_ts = q_timestamps[rows].view(b, lq)
            kv_ts = kv_timestamps[kv_index[start : start + b * lkv]].view(b, lkv)
            bucket = time_bucket(q_ts[:, :, None] - kv_ts[:, None, :], time_table.shape[1], time_log_base)
            scores = scores + time_table.to(compute)[:, bucket].transpose(0, 1)
        start += b * lkv
        if activation == "softmax":
            # A finite fill keeps rows without any visible key finite; the mask then zeroes them.
            weights = scores.masked_fill(~allowed, torch.finfo(compute).min).softmax(-1) * allowed
        else:
            weights = _activation(scores, activation) * allowed
            if normalize == "kv_len":
                weights = weights / lens_kv.to(compute)[:, None, None, None]
            elif normalize == "max_len":
                weights = weights / max(max_kv_len, 1)
        outs.append(torch.matmul(weights, vg).transpose(1, 2).reshape(b * lq, heads, -1))
    outs.append(q.new_zeros(1, heads, v.shape[2], dtype=compute))
    return torch.cat(outs).to(q.dtype)[source_of_row.to(device)]
