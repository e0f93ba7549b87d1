"""The one attention dispatch point of the model, over jagged sequences.

Layout (the same as `gemrec.kernels` and FlashAttention varlen): q `(total_q, heads, head_dim)`,
k and v `(total_kv, heads, head_dim)`; sequence i owns query rows `q_offsets[i]:q_offsets[i+1]` and
key/value rows `kv_offsets[i]:kv_offsets[i+1]`; `max_q_len`/`max_kv_len` are host ints. Empty and
length-1 sequences are legal; a query whose sequence has no keys gets a zero output. A 2-entry
`q_offsets` with B > 1 shares one query sequence across all B key sequences (PMA seeds; the output has
B * len_q rows); a 2-entry `kv_offsets` likewise shares one key/value sequence.

Semantics, per sequence, with s_ij = scale * q_i . k_j and `scale` defaulting to head_dim ** -0.5:
- kind="softmax": out_i = sum_j softmax_j(s_ij) v_j
- kind="silu":    out_i = sum_j silu(s_ij) v_j / n_kv   (n_kv: that sequence's key count; pointwise, HSTU-style)
- causal=True: bottom-right aligned, query i of a length-Lq sequence sees keys j <= i + (Lkv - Lq)
  (self-attention: j <= i).

These match `gemrec.kernels.jagged_attention` (softmax) and `gemrec.kernels.gdpa(activation="silu",
normalize="kv_len")`. `attention` runs those Triton kernels for CUDA tensors (same dtype, equal q/v head
dims in 16..256) and the pure-PyTorch reference `jagged_attention_reference` everywhere else, or everywhere
with backend="reference" (the model's `attention_backend`, for before/after measurements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KINDS = ("softmax", "silu")
BACKENDS = ("auto", "reference")

# The reference pads sequences of similar length to a common length and runs them as one batch. A group
# admits a sequence when its lengths are within this fraction of the group's longest; 0 groups equal
# lengths only, so the matmuls do exactly the jagged work (what FLOP-count tests use).
REFERENCE_MAX_PADDING = 0.125
# Largest score tensor (batch x heads x q_len x kv_len elements) one reference group materialises.
REFERENCE_MAX_SCORES = 1 << 25


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    *,
    kind: str = "softmax",
    causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Jagged multi-head attention; returns `(total_q, heads, v_head_dim)`. See the module docstring.

    `backend`: "auto" (the Triton kernels where they apply) or "reference" (always the PyTorch reference)."""
    _check(q, k, v, q_offsets, kv_offsets, kind)
    if backend not in BACKENDS:
        raise ValueError(f"attention: backend must be one of {BACKENDS}, got {backend!r}")
    if (
        backend == "auto"
        and q.is_cuda
        and v.shape[2] == q.shape[2]
        and 16 <= q.shape[2] <= 256
        and q.dtype == k.dtype == v.dtype
    ):
        from gemrec.kernels import gdpa, jagged_attention

        if kind == "softmax":
            return jagged_attention(q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, causal=causal, scale=scale)
        return gdpa(
            q,
            k,
            v,
            q_offsets,
            kv_offsets,
            max_q_len,
            max_kv_len,
            activation="silu",
            causal=causal,
            scale=scale,
            normalize="kv_len",
        )
    return jagged_attention_reference(
        q, k, v, q_offsets, kv_offsets, max_q_len, max_kv_len, kind=kind, causal=causal, scale=scale
    )


def _check(q, k, v, q_offsets, kv_offsets, kind):
    if kind not in KINDS:
        raise ValueError(f"attention: kind must be one of {KINDS}, got {kind!r}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"attention: q, k, v must be (tokens, heads, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"attention: shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    nq, nkv = q_offsets.numel(), kv_offsets.numel()
    if q_offsets.dim() != 1 or kv_offsets.dim() != 1 or not (nq == nkv or nq == 2 or nkv == 2):
        raise ValueError(
            f"attention: q_offsets and kv_offsets must both be (B+1,) (or (2,) for a shared q or kv), got "
            f"{tuple(q_offsets.shape)} and {tuple(kv_offsets.shape)}"
        )


def _repeat(x: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence shared by all `batch` sequences of the other side, repeated: (rows, offsets)."""
    repeated = x.unsqueeze(0).expand(batch, *x.shape).reshape(batch * x.shape[0], *x.shape[1:])
    return repeated, torch.arange(batch + 1, device=x.device) * x.shape[0]


def _length_groups(q_len: list[int], kv_len: list[int], heads: int, max_padding: float) -> list[list[int]]:
    """Sequences (non-empty) grouped so that padding to each group's longest wastes little."""
    order = sorted((i for i in range(len(q_len)) if q_len[i] and kv_len[i]), key=lambda i: (-kv_len[i], -q_len[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            head = groups[-1][0]
            fits = (
                kv_len[i] >= (1 - max_padding) * kv_len[head]
                and (1 - max_padding) * q_len[head] <= q_len[i] <= q_len[head]
                and (len(groups[-1]) + 1) * heads * q_len[head] * kv_len[head] <= REFERENCE_MAX_SCORES
            )
            if fits:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    *,
    kind: str = "softmax",
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Pure-PyTorch jagged attention: length groups padded only to their own longest member.

    Never pads the whole batch to (B, max_len, max_len); reads the lengths on the host (one sync).
    """
    _check(q, k, v, q_offsets, kv_offsets, kind)
    heads, head_dim = q.shape[1], q.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    if q_offsets.numel() == 2 and kv_offsets.numel() > 2:
        q, q_offsets = _repeat(q, kv_offsets.numel() - 1)
    elif kv_offsets.numel() == 2 and q_offsets.numel() > 2:
        (k, kv_offsets), (v, _) = _repeat(k, q_offsets.numel() - 1), _repeat(v, q_offsets.numel() - 1)
    q_off = q_offsets.detach().to("cpu", torch.long)
    kv_off = kv_offsets.detach().to("cpu", torch.long)
    q_len = (q_off[1:] - q_off[:-1]).tolist()
    kv_len = (kv_off[1:] - kv_off[:-1]).tolist()
    if max(q_len, default=0) > max_q_len or max(kv_len, default=0) > max_kv_len:
        raise ValueError(
            f"attention: a sequence is longer than max_q_len={max_q_len} / max_kv_len={max_kv_len} "
            f"(longest: {max(q_len, default=0)} / {max(kv_len, default=0)})"
        )
    groups = _length_groups(q_len, kv_len, heads, REFERENCE_MAX_PADDING)
    device = q.device
    # Index plans on the host: each group's members padded to its longest, all groups back to back.
    q_rows, kv_rows, plans = [], [], []
    source_of_row = torch.full((q.shape[0],), -1, dtype=torch.long)  # padded output row of each q row
    padded_rows = 0
    for group in groups:
        members = torch.tensor(group)
        lq, lkv = q_len[group[0]], kv_len[group[0]]
        q_pos, kv_pos = torch.arange(lq), torch.arange(lkv)
        q_valid = q_pos < torch.tensor([q_len[i] for i in group])[:, None]  # (b, lq)
        kv_lens = torch.tensor([kv_len[i] for i in group])
        kv_valid = kv_pos < kv_lens[:, None]  # (b, lkv)
        rows_q = q_off[members][:, None] + q_pos
        q_rows.append(torch.where(q_valid, rows_q, 0).reshape(-1))
        kv_rows.append(torch.where(kv_valid, kv_off[members][:, None] + kv_pos, 0).reshape(-1))
        source_of_row[rows_q[q_valid]] = padded_rows + torch.arange(len(group) * lq).view(len(group), lq)[q_valid]
        padded_rows += len(group) * lq
        allowed = kv_valid[:, None, None, :]
        if causal:
            shift = torch.tensor([kv_len[i] - q_len[i] for i in group])[:, None, None]
            allowed = allowed & (kv_pos <= q_pos[:, None] + shift)[:, None]
        plans.append((len(group), lq, lkv, allowed.to(device), kv_lens.to(device)))
    result_shape = (q.shape[0], heads, v.shape[2])
    if not plans:
        return q.new_zeros(result_shape)
    # One gather per input and one for the output, so the backward scatters once, not once per group.
    q_all = q[torch.cat(q_rows).to(device)].split([b * lq for b, lq, _, _, _ in plans])
    kv_index = torch.cat(kv_rows).to(device)
    kv_sizes = [b * lkv for b, _, lkv, _, _ in plans]
    k_all, v_all = k[kv_index].split(kv_sizes), v[kv_index].split(kv_sizes)
    outs = []
    for (b, lq, lkv, allowed, kv_lens), qg, kg, vg in zip(plans, q_all, k_all, v_all):
        qg = qg.view(b, lq, heads, head_dim).transpose(1, 2)  # (b, H, lq, D)
        kg = kg.view(b, lkv, heads, head_dim).transpose(1, 2)
        vg = vg.view(b, lkv, heads, v.shape[2]).transpose(1, 2)
        scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # (b, H, lq, lkv)
        if kind == "softmax":
            # A finite fill keeps rows without any visible key finite; the mask then zeroes them.
            wide = scores.to(torch.promote_types(scores.dtype, torch.float32))
            probs = (wide.masked_fill(~allowed, torch.finfo(wide.dtype).min).softmax(-1) * allowed).to(v.dtype)
        else:
            norm = (1.0 / kv_lens.to(scores.dtype))[:, None, None, None]
            probs = F.silu(scores).masked_fill(~allowed, 0.0) * norm
        outs.append(torch.matmul(probs, vg).transpose(1, 2).reshape(b * lq, heads, -1))
    # Rows of empty sequences read the appended zero row.
    outs.append(q.new_zeros(1, heads, v.shape[2]))
    source_of_row[source_of_row < 0] = padded_rows
    return torch.cat(outs).to(q.dtype)[source_of_row.to(device)]
