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
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop_count

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


# torch's FlopCounterMode has no formula for the CPU SDPA kernel. Counted as the model counts attention: the matmuls
# of QK^T and PV forward and their four gradients backward (torch's CUDA formulas add the backward's recompute).
if torch.ops.aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry:

    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _cpu_sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def _masked_sdpa(q, k, v, allowed, scale):
    """Softmax attention through torch's SDPA (its fused kernels keep no score tensor for backward); `allowed`
    broadcasts to (b, H, lq, lkv). Rows without a visible key attend to every key and are then zeroed."""
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    any_key = allowed.any(-1, keepdim=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~any_key, scale=scale) * any_key


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
    fp8=False,
):
    """out[i] = sum_j w(i, j) v[j] over each sequence's own keys; see `gemrec.kernels` for the semantics (masks:
    `window`, `block`; rotary: `rope_base`, q and k rotated in the compute dtype). `max_padding`: the grouping's
    padding fraction, `MAX_PADDING` when None. fp8: the FP8 forward's emulation (`fp8_attention`): q, k, v rounded
    to e4m3 on 128-row tiles per sequence and head, the weights before PV too, fp32 compute; gradients pass
    straight through the rounding."""
    heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 and not fp8 else torch.float32
    device = q.device
    q_start, q_len, kv_start, kv_len = sequences(q_offsets.tolist(), kv_offsets.tolist())
    if fp8:
        if rope_base:
            raise ValueError("the FP8 attention forward does not support rope_base (RoPE)")
        from gemrec.kernels.fp8_attention import quantize_tiles_reference

        q = quantize_tiles_reference(q, q_offsets.tolist())
        k, v = (quantize_tiles_reference(x, kv_offsets.tolist()) for x in (k, v))
    if max(q_len, default=0) > max_q_len or max(kv_len, default=0) > max_kv_len:
        raise ValueError(
            f"a sequence is longer than max_q_len={max_q_len} / max_kv_len={max_kv_len} "
            f"(longest: {max(q_len, default=0)} / {max(kv_len, default=0)})"
        )
    if activation != "softmax" and normalize not in ("none", "kv_len", "max_len"):
        raise ValueError(f"unknown normalize {normalize!r}; expected 'none', 'kv_len' or 'max_len'")

    def attend(qg, kg, vg, lens_q, lens_kv, ab, q_ts, kv_ts):
        """One group, (b, length, H, D) inputs with every member padded to the group's lengths (lens_q, lens_kv:
        (b,) tensors), or None: no padding. ab: (b, lq, H, lkv); q_ts, kv_ts: (b, lq), (b, lkv). -> (b * lq, H, D)."""
        b, lq, lkv = qg.shape[0], qg.shape[1], kg.shape[1]
        qg, kg, vg = (x.to(compute).transpose(1, 2) for x in (qg, kg, vg))  # (b, H, l, D)
        kv_pos = torch.arange(lkv, device=device)
        # the queries' bottom-right aligned positions: (lq,) without padding, else (b, lq)
        q_at = torch.arange(lq, device=device) + (lkv - lq if lens_kv is None else (lens_kv - lens_q)[:, None])
        if rope_base:  # queries at their aligned positions, keys at their own
            cos, sin = rope_cos_sin(q_at, head_dim, rope_base)
            qg = rotate_half(qg, *((cos, sin) if lens_kv is None else (cos[:, None], sin[:, None])))
            kg = rotate_half(kg, *rope_cos_sin(kv_pos, head_dim, rope_base))
        allowed = None if lens_kv is None else (kv_pos < lens_kv[:, None])[:, None, None, :]
        rel = q_at[..., :, None] - kv_pos if causal or window or pos_table is not None else None  # ([b,] lq, lkv)
        visible = None
        for mask in (
            rel >= 0 if causal else None,
            (rel if causal else rel.abs()) < window if window else None,
            torch.div(q_at[..., :, None], block, rounding_mode="floor") == kv_pos // block if block else None,
        ):
            if mask is not None:
                visible = mask if visible is None else visible & mask
        if visible is not None:
            visible = visible if visible.dim() == 2 else visible[:, None]
            allowed = visible if allowed is None else allowed & visible
        if activation == "softmax" and ab is None and pos_table is None and time_table is None and not fp8 and lkv:
            return _masked_sdpa(qg, kg, vg, allowed, scale).transpose(1, 2).reshape(b * lq, heads, -1)
        scores = (torch.matmul(qg, kg.transpose(-1, -2)) * scale).to(compute)  # (b, H, lq, lkv); fp32 under autocast
        if ab is not None:
            scores = scores + ab.to(compute).transpose(1, 2)
        if pos_table is not None:
            table = pos_table.to(compute)[:, pos_bucket(rel, pos_table.shape[1], pos_max_distance)]
            scores = scores + (table if rel.dim() == 2 else table.transpose(0, 1))
        if time_table is not None:
            bucket = time_bucket(q_ts[:, :, None] - kv_ts[:, None, :], time_table.shape[1], time_log_base)
            scores = scores + time_table.to(compute)[:, bucket].transpose(0, 1)
        if activation == "softmax":
            if allowed is None:
                weights = scores.softmax(-1)
            else:  # a finite fill keeps rows without any visible key finite; the mask then zeroes them
                weights = scores.masked_fill(~allowed, torch.finfo(compute).min).softmax(-1) * allowed
        else:
            weights = _activation(scores, activation)
            weights = weights if allowed is None else weights * allowed
            if normalize == "kv_len":
                weights = weights / (lkv if lens_kv is None else lens_kv.to(compute)[:, None, None, None])
            elif normalize == "max_len":
                weights = weights / max(max_kv_len, 1)
        if fp8:
            from gemrec.kernels.fp8_attention import quantize_weights_reference

            weights = quantize_weights_reference(weights, activation == "softmax")
        return torch.matmul(weights, vg).transpose(1, 2).reshape(b * lq, heads, -1)

    num_seqs = len(q_len)
    shared_q, shared_kv = q_offsets.numel() == 2 < num_seqs + 1, kv_offsets.numel() == 2 < num_seqs + 1

    def side(x, start, length, shared):
        """(num_seqs, length, ...) rows of equal-length sequences: a view, the shared sequence expanded."""
        if shared:
            return x[start : start + length].unsqueeze(0).expand(num_seqs, length, *x.shape[1:])
        rows = x if start == 0 and x.shape[0] == num_seqs * length else x[start : start + num_seqs * length]
        return rows.view(num_seqs, length, *x.shape[1:])  # a slice's backward fills a zero tensor: only if needed

    groups = _length_groups(q_len, kv_len, heads, MAX_PADDING if max_padding is None else max_padding)
    if len(groups) == 1 and len(groups[0]) == num_seqs and len(set(q_len)) == len(set(kv_len)) == 1:
        # every sequence of the same lengths (tokens of a fixed count, shared seeds): views, no gathers
        b, lq, lkv = num_seqs, q_len[0], kv_len[0]
        kg, vg = side(k, kv_start[0], lkv, shared_kv), side(v, kv_start[0], lkv, shared_kv)
        ab = None if attn_bias is None else attn_bias[:, :, :lkv].view(b, lq, heads, lkv)
        q_ts = kv_ts = None
        if time_table is not None:
            q_ts, kv_ts = q_timestamps.view(b, lq), side(kv_timestamps, kv_start[0], lkv, shared_kv)
        out = attend(side(q, q_start[0], lq, shared_q), kg, vg, None, None, ab, q_ts, kv_ts)
        return out.to(out_dtype)
    # A shared side repeated once per sequence: a gather of distinct rows backpropagates faster than one of the
    # same rows many times.
    if shared_q:
        q, q_start = side(q, q_start[0], q_len[0], True).flatten(0, 1), [i * q_len[0] for i in range(num_seqs)]
    if shared_kv:
        k, v = (side(x, kv_start[0], kv_len[0], True).flatten(0, 1) for x in (k, v))
        if time_table is not None:
            kv_timestamps = side(kv_timestamps, kv_start[0], kv_len[0], True).flatten()
        kv_start = [i * kv_len[0] for i in range(num_seqs)]
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
    source_of_row = torch.full((sum(q_len),), q_rows.numel(), dtype=torch.long)
    source_of_row[out_rows[q_valid]] = torch.arange(q_rows.numel())[q_valid]
    sizes = [(len(g), q_len[g[0]], kv_len[g[0]]) for g in groups]
    batches = [b for b, _, _ in sizes]
    q_split, kv_split = [b * lq for b, lq, _ in sizes], [b * lkv for b, _, lkv in sizes]
    kv_index, out_index = kv_rows.to(device), out_rows.to(device)
    per_group = [
        q.index_select(0, q_rows.to(device)).split(q_split),
        k.index_select(0, kv_index).split(kv_split),
        v.index_select(0, kv_index).split(kv_split),
        q_lens[members].to(device).split(batches),
        kv_lens[members].to(device).split(batches),
        out_index.split(q_split),
        kv_index.split(kv_split),
    ]
    outs = [torch.cat([q[:0], k[:0], v[:0]]).to(compute)]  # keeps the result in the graph when no group exists
    for (b, lq, lkv), qg, kg, vg, lens_q, lens_kv, rows, keys in zip(sizes, *per_group):
        ab = None if attn_bias is None else attn_bias.index_select(0, rows)[:, :, :lkv].view(b, lq, heads, lkv)
        q_ts = None if time_table is None else q_timestamps[rows].view(b, lq)
        kv_ts = None if time_table is None else kv_timestamps[keys].view(b, lkv)
        shape = (b, -1, heads, head_dim)
        outs.append(attend(qg.view(shape), kg.view(shape), vg.view(shape), lens_q, lens_kv, ab, q_ts, kv_ts))
    outs.append(q.new_zeros(1, heads, v.shape[2], dtype=compute))
    return torch.cat(outs).to(out_dtype).index_select(0, source_of_row.to(device))
