"""Shared helpers of the kernel tests: offsets, an independent per-sequence statement of the semantics (`naive`),
random inputs, one call of either op with all its gradients (`run`), and the error measures the tests assert on."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gemrec.kernels import RelativeBias, gdpa, jagged_attention


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


@dataclass
class Case:
    """Random inputs of one jagged problem (float32, on `device`); a 1-entry `q_lens` is one shared query sequence."""

    q_lens: list[int]
    kv_lens: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: dict[str, torch.Tensor]  # attn_bias, pos, time; empty without biases
    q_ts: torch.Tensor
    kv_ts: torch.Tensor
    grad: torch.Tensor
    max_distance: int
    time_log_base: float

    @property
    def rows(self) -> int:
        return self.grad.shape[0]

    def offsets(self):
        device = self.q.device
        return offsets_of(self.q_lens, device), offsets_of(self.kv_lens, device)


def make_case(
    q_lens,
    kv_lens,
    *,
    heads,
    dim,
    bias=False,
    seed=0,
    device="cpu",
    buckets=(8, 6),
    max_distance=24,
    time_log_base=2.5,
    log_uniform_timestamps=False,
) -> Case:
    """Inputs drawn in a fixed order from one seed. `buckets`: (position, time) table sizes. Log-uniform timestamps
    spread time differences over the buckets (a bucket holding nearly whole rows has a softmax gradient that is a
    tiny residual of cancelling terms, ill-conditioned in bf16); otherwise uniform in [0, 400)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shared_q = len(q_lens) == 1 and len(kv_lens) > 1
    rows = q_lens[0] * len(kv_lens) if shared_q else sum(q_lens)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen, device=device)
    k = torch.randn(sum(kv_lens), heads, dim, generator=gen, device=device)
    v = torch.randn(sum(kv_lens), heads, dim, generator=gen, device=device)
    tables = {}
    if bias:
        tables["attn_bias"] = torch.randn(rows, heads, max(kv_lens), generator=gen, device=device)
        tables["pos"] = torch.randn(heads, buckets[0], generator=gen, device=device)
        tables["time"] = torch.randn(heads, buckets[1], generator=gen, device=device)
    if log_uniform_timestamps:
        q_ts = torch.rand(rows, generator=gen, device=device).mul(16).exp2().long()
        kv_ts = torch.rand(k.shape[0], generator=gen, device=device).mul(16).exp2().long()
    else:
        q_ts = torch.randint(0, 400, (rows,), generator=gen, device=device)
        kv_ts = torch.randint(0, 400, (k.shape[0],), generator=gen, device=device)
    grad = torch.randn(rows, heads, dim, generator=gen, device=device)
    return Case(list(q_lens), list(kv_lens), q, k, v, tables, q_ts, kv_ts, grad, max_distance, time_log_base)


GRADIENTS = ["out", "dq", "dk", "dv", "d_attn_bias", "d_pos", "d_time"]


def run(
    case: Case,
    activation: str,
    *,
    backend: str,
    dtype=torch.float32,
    round_to=None,
    causal=False,
    normalize="kv_len",
    options=None,
    backward=True,
    **masks,
) -> list:
    """[out, dq, dk, dv, (d_attn_bias, d_pos, d_time with biases)] of one call: `jagged_attention` for softmax, else
    `gdpa`; the inputs cast to `dtype`, through `round_to` first (a reference seeing bf16-rounded inputs, upcast).
    `masks`: window, block, rope_base. Gradients of inputs the call does not use are None; [out] without `backward`."""

    def cast(t):
        return (t if round_to is None else t.to(round_to)).to(dtype).requires_grad_()

    leaves = [cast(t) for t in (case.q, case.k, case.v)]
    tables = {name: cast(t) for name, t in case.bias.items()}
    rel = None
    if tables:
        rel = RelativeBias(
            position=tables["pos"],
            time=tables["time"],
            q_timestamps=case.q_ts,
            kv_timestamps=case.kv_ts,
            max_distance=case.max_distance,
            time_log_base=case.time_log_base,
        )
    q_off, kv_off = case.offsets()
    args = (*leaves, q_off, kv_off, max(case.q_lens), max(case.kv_lens))
    kw = dict(causal=causal, attn_bias=tables.get("attn_bias"), rel_bias=rel, backend=backend, options=options, **masks)
    if activation == "softmax":
        out = jagged_attention(*args, **kw)
    else:
        out = gdpa(*args, activation=activation, normalize=normalize, **kw)
    inputs = leaves + list(tables.values())
    if not backward:
        return [out.detach()]
    if not out.numel():
        return [out.detach(), *(torch.zeros_like(t) for t in inputs)]
    grads = torch.autograd.grad(
        out, inputs, case.grad.to(dtype if round_to is None else round_to).to(dtype), allow_unused=True
    )
    return [out.detach(), *grads]


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max(|want|, 1)."""
    scale = want.double().abs().max().clamp(min=1.0)
    return float((got.double() - want.double()).abs().max() / scale)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12))


# FP8 forward (`KernelOptions.fp8`) against exact fp64: e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4, about
# 2.5% RMS per operand); q, k (through the scores), the weights and v each add theirs, and the CPU emulation's output
# and gradients measure 4-6% relative L2 on random inputs. A kernel must stay within 8% and within 1.25x (+1%) of the
# emulation's error on the same inputs: a wrong scale or a lost tile costs tens of percent.
FP8_TOL = 0.08
FP8_GRAD_TOL = 0.12


def fp8_errors(
    case: Case, activation: str, *, backend: str, options, dtype=torch.float32, backward=True, **kw
) -> tuple[list, list]:
    """(errors of the FP8 call on `backend`, errors of the CPU-style emulation), each the relative L2 error of the
    output and every gradient against the exact fp64 reference (None where a gradient does not apply; the output
    only without `backward`)."""

    def call(**args):
        return run(case, activation, backward=backward, **args, **kw)

    exact = call(backend="reference", dtype=torch.float64)
    emulated = call(backend="reference", options=options)
    got = call(backend=backend, options=options, dtype=dtype)

    def errors(results):
        return [None if g is None or not w.numel() else rel_l2(g, w) for g, w in zip(results, exact)]

    return errors(got), errors(emulated)


def check_fp8(got: list, emulated: list, tol: float = FP8_TOL, grad_tol: float = FP8_GRAD_TOL) -> None:
    """The output within `tol` of exact and within 1.25x (+1%) of the emulation's error; the gradients (the bf16
    backward reweighting with the FP8 forward's logsumexp, not the emulation's straight-through rounding) within
    `grad_tol`."""
    assert got[0] < tol and got[0] < 1.25 * emulated[0] + 0.01, (
        f"out: fp8 error {got[0]:.3f}, emulation {emulated[0]:.3f}"
    )
    for name, g in zip(GRADIENTS[1:], got[1:]):
        assert g is None or g < grad_tol, f"{name}: fp8 error {g:.3f} (emulation {emulated[GRADIENTS.index(name)]})"
