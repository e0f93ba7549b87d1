"""`gemrec bench kernels`: check correctness first, then time every kernel variant and its peers in one run.

Peers (each on its own preferred layout, the layout conversion left out of its time): FlexAttention with
a document mask over the packed tokens, padded SDPA with a key-padding mask, nested-tensor (jagged) SDPA,
and, for GDPA, `torch.compile` of a padded pointwise attention. Variants with a window or block mask are timed
against FlexAttention with the same mask (document, causal, window or block); variants with fused RoPE also against
our same kernel after a separate rotary (the model's rotate-half on q and k, in bf16). TFLOP/s always count the real
(unpadded, unmasked) query-key pairs as model FLOPs (`attention_flops`): 4*pairs*H*D forward, 8*pairs*H*D
backward (FlashAttention's benchmarks also count the recomputed scores, 10*pairs*H*D); the block variants also report
the bytes they must move and the TB/s that makes. Each is timed eagerly (launched from Python, host costs included)
and, after every eager timing, replayed from a CUDA graph (device time only). Ours also gets its host time per eager
call (`host_us`: calls launched back to back, unsynchronized) and its eager fwd+bwd with the backward on the calling
thread instead of autograd's device thread (a training step hands its backward to that thread once, not per op).
"""

import dataclasses
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gemrec.kernels.ops import attention_flops, gdpa, jagged_attention
from gemrec.kernels.options import KernelOptions
from gemrec.kernels.reference import rope_cos_sin, rotate_half
from gemrec.provenance import git_commit

ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Variant:
    """One timed call: op ("jfa" softmax or "gdpa" silu), causal, and the API's window / block / rope_base."""

    op: str
    causal: bool
    window: int | None = None
    block: int | None = None
    rope_base: float | None = None

    @property
    def name(self) -> str:
        return (
            f"{self.op}{'-causal' if self.causal else ''}"
            + (f"-w{self.window}" if self.window else "")
            + (f"-b{self.block}" if self.block else "")
            + ("-rope" if self.rope_base else "")
        )

    @property
    def masks(self) -> dict:
        return {"window": self.window, "block": self.block, "rope_base": self.rope_base}


@dataclass(frozen=True)
class Config:
    name: str
    num_seqs: int
    heads: int
    head_dim: int
    q_lens: str  # "uniform:LO:HI", "lognormal:MEDIAN:MAX" or "shared:N"
    kv_lens: str  # same forms, or "self" (self-attention)
    variants: tuple[Variant, ...]
    targets: str
    plain_peers: bool = True  # the unmasked variants' peers (Flex document mask, SDPA); off where they only repeat A


CONFIGS = {
    "A": Config(
        "A",
        32,
        8,
        128,
        "uniform:1:4096",
        "self",
        (Variant("jfa", False), Variant("jfa", True), Variant("gdpa", True)),
        "JFA >= 450 fwd, >= 350 fwd+bwd; GDPA silu causal >= 450 fwd, >= 300 fwd+bwd",
    ),
    "B": Config(
        "B",
        256,
        4,
        64,
        "lognormal:128:1024",
        "self",
        (Variant("jfa", False), Variant("jfa", True), Variant("gdpa", False), Variant("gdpa", True)),
        ">= 2x FlexAttention, both ops",
    ),
    "C-cross": Config(
        "C-cross",
        32,
        8,
        128,
        "uniform:1:4096",
        "uniform:16:64",
        (Variant("jfa", False), Variant("gdpa", False)),
        ">= 2x the best peer",
    ),
    "C-pma": Config(
        "C-pma",
        32,
        8,
        128,
        "shared:32",
        "uniform:1:4096",
        (Variant("jfa", False), Variant("gdpa", False)),
        ">= 2x the best peer",
    ),
    # long histories (issue 17): full causal attention as the baseline, a 1024-event window, 64-event blocks
    "long": Config(
        "long",
        8,
        8,
        128,
        "uniform:4096:16384",
        "self",
        (
            Variant("jfa", True),
            Variant("jfa", True, window=1024),
            Variant("jfa", True, block=64),
            Variant("jfa", True, block=64, rope_base=ROPE_BASE),
            Variant("jfa", True, window=1024, rope_base=ROPE_BASE),
        ),
        "SWA w1024 <= 0.55 ms fwd, <= 2.7 ms fwd+bwd; block 64 + fused RoPE <= 0.25 ms fwd, <= 0.75 ms fwd+bwd; "
        "fused RoPE >= 1.3x separate rotary + the same attention (fwd+bwd)",
        plain_peers=False,
    ),
    "mixed": Config(
        "mixed",
        32,
        8,
        128,
        "lognormal:2048:16384",
        "self",
        (
            Variant("jfa", True),
            Variant("jfa", True, window=1024),
            Variant("jfa", True, block=64, rope_base=ROPE_BASE),
        ),
        "runs (FlexAttention runs out of memory building its masks here)",
        plain_peers=False,
    ),
}


def draw_lengths(spec: str, num_seqs: int, gen: torch.Generator) -> list[int]:
    kind, *args = spec.split(":")
    if kind == "uniform":
        lo, hi = int(args[0]), int(args[1])
        return torch.randint(lo, hi + 1, (num_seqs,), generator=gen).tolist()
    if kind == "lognormal":
        median, cap = float(args[0]), int(args[1])
        x = torch.randn(num_seqs, generator=gen, dtype=torch.float64) * 1.0 + math.log(median)
        return x.exp().round().clamp(1, cap).long().tolist()
    if kind == "shared":
        return [int(args[0])]
    raise ValueError(f"unknown length spec {spec!r}")


def offsets_of(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_offsets: torch.Tensor
    kv_offsets: torch.Tensor
    q_lens: list[int]  # per sequence, shared q expanded
    kv_lens: list[int]
    max_q: int
    max_kv: int
    shared_q: bool


def make_case(cfg: Config, seed: int, device, dtype=torch.bfloat16, num_seqs: int | None = None) -> Case:
    gen = torch.Generator().manual_seed(seed)
    b = num_seqs or cfg.num_seqs
    q_lens = draw_lengths(cfg.q_lens, b, gen)
    kv_lens = q_lens if cfg.kv_lens == "self" else draw_lengths(cfg.kv_lens, b, gen)
    shared_q = cfg.q_lens.startswith("shared")
    q = torch.randn(sum(q_lens), cfg.heads, cfg.head_dim, generator=gen).to(device, dtype)
    k = torch.randn(sum(kv_lens), cfg.heads, cfg.head_dim, generator=gen).to(device, dtype)
    v = torch.randn(sum(kv_lens), cfg.heads, cfg.head_dim, generator=gen).to(device, dtype)
    per_seq_q = q_lens * b if shared_q else q_lens
    return Case(
        q,
        k,
        v,
        offsets_of(q_lens, device),
        offsets_of(kv_lens, device),
        per_seq_q,
        kv_lens,
        max(q_lens),
        max(kv_lens),
        shared_q,
    )


def run_ours(variant: Variant, case: Case, backend="auto", q=None, k=None, v=None, options=None, **masks):
    """Our op on the case (q, k, v override its tensors; `masks` the variant's window / block / rope_base)."""
    q, k, v = (case.q if q is None else q), (case.k if k is None else k), (case.v if v is None else v)
    args = (q, k, v, case.q_offsets, case.kv_offsets, case.max_q, case.max_kv)
    kw = {"causal": variant.causal, "backend": backend, "options": options, **(variant.masks | masks)}
    if variant.op == "jfa":
        return jagged_attention(*args, **kw)
    return gdpa(*args, activation="silu", normalize="kv_len", **kw)


# Relative L2 error a check allows: bf16 rounding, or with the FP8 forward e4m3's (3 mantissa bits: 4-6% measured on
# the CPU emulation; `tests/kernels/kernel_harness.FP8_TOL`).
CHECK_TOL = 1e-2
FP8_CHECK_TOL = 0.08


def check_correctness(
    cfg: Config, variant: Variant, device, seed: int, options: KernelOptions, backward: bool = True
) -> dict:
    """bf16 kernel vs fp32 reference on a few sequences of the config: output and (with `backward`) all input
    grads."""
    case = make_case(cfg, seed, device, num_seqs=4)
    leaves = [t.detach().clone().requires_grad_(backward) for t in (case.q, case.k, case.v)]
    out = run_ours(variant, case, "triton", leaves[0], leaves[1], leaves[2], options=options)
    ref_leaves = [t.detach().float().requires_grad_(backward) for t in (case.q, case.k, case.v)]
    ref = run_ours(variant, case, "reference", *ref_leaves)

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm().clamp(min=1e-12))

    errs = {"out": rel(out, ref)}
    if backward:
        grad = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad.float())
        errs.update({f"d{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads)})
    tol = FP8_CHECK_TOL if options.fp8 else CHECK_TOL
    return {"errors": errs, "ok": all(e < tol for e in errs.values())}


def _padded(x: torch.Tensor, lens: list[int], max_len: int) -> torch.Tensor:
    """(total, H, D) jagged -> (B, H, max_len, D) zero padded."""
    padded = x.new_zeros(len(lens), max_len, *x.shape[1:])
    for i, (start, n) in enumerate(zip(offsets_of(lens, "cpu").tolist(), lens)):
        padded[i, :n] = x[start : start + n]
    return padded.transpose(1, 2).contiguous()


def _masks(case: Case, causal: bool, device):
    q_len = torch.tensor(case.q_lens, device=device)
    kv_len = torch.tensor(case.kv_lens, device=device)
    i = torch.arange(case.max_q, device=device)
    j = torch.arange(case.max_kv, device=device)
    mask = (i[None, :, None] < q_len[:, None, None]) & (j[None, None, :] < kv_len[:, None, None])
    if causal:
        mask &= j[None, None, :] <= i[None, :, None] + (kv_len - q_len)[:, None, None]
    return mask[:, None]  # (B, 1, Lq, Lkv)


def _positions(lens: list[int], shifts: list[int], device) -> torch.Tensor:
    """Each jagged row's position: its index within its sequence plus the sequence's shift."""
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    start = offsets_of(lens, device)[:-1]
    return torch.arange(seq.numel(), device=device) - start[seq] + torch.tensor(shifts, device=device)[seq]


def _flex(case: Case, variant: Variant, device):
    """FlexAttention (compiled) with a document mask over the packed tokens, plus the variant's causal, window and
    block conditions, written so that the mask never holds an integer tokens x tokens temporary."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    causal, window, block = variant.causal, variant.window, variant.block
    doc_q = torch.repeat_interleave(
        torch.arange(len(case.q_lens), device=device), torch.tensor(case.q_lens, device=device)
    )
    doc_kv = torch.repeat_interleave(
        torch.arange(len(case.kv_lens), device=device), torch.tensor(case.kv_lens, device=device)
    )
    shifts = [lk - lq for lq, lk in zip(case.q_lens, case.kv_lens)]
    pos_q = _positions(case.q_lens, shifts, device)
    pos_kv = _positions(case.kv_lens, [0] * len(case.kv_lens), device)

    def mask(b, h, qi, ki):
        pq, pk = pos_q[qi], pos_kv[ki]
        seen = doc_q[qi] == doc_kv[ki]
        if causal:
            seen = seen & (pk <= pq)
        if window:
            seen = seen & (pk > pq - window)
            if not causal:
                seen = seen & (pk < pq + window)
        if block:
            seen = seen & (pq // block == pk // block)
        return seen

    block_mask = create_block_mask(mask, None, None, doc_q.numel(), doc_kv.numel(), device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    scale = case.q.shape[-1] ** -0.5
    q_full = case.q.repeat(len(case.kv_lens), 1, 1) if case.shared_q else case.q
    leaves = [t.detach().clone().transpose(0, 1)[None].requires_grad_() for t in (q_full, case.k, case.v)]
    return (lambda q, k, v: flex(q, k, v, block_mask=block_mask, scale=scale)), leaves


def _separate_rotary(variant: Variant, case: Case, device, options: KernelOptions):
    """Our same kernel after a separate rotary, as the model's `Rotary` + `rotate` do it: cos/sin gathered from fp32
    tables per call, q and k rotated in their dtype (a rotated copy of each written and, backward, read again)."""
    head_dim = case.q.shape[-1]
    if variant.rope_base is None:
        raise ValueError(f"the separate-rotary peer needs a RoPE variant, got {variant.name}")
    cos, sin = (
        t.float()
        for t in rope_cos_sin(torch.arange(max(case.max_q, case.max_kv), device=device), head_dim, variant.rope_base)
    )
    shifts = [lk - lq for lq, lk in zip(case.q_lens, case.kv_lens)]
    pos_q = _positions(
        case.q_lens if not case.shared_q else case.q_lens[:1], shifts[:1] if case.shared_q else shifts, device
    )
    pos_kv = _positions(case.kv_lens, [0] * len(case.kv_lens), device)

    def fn(q, k, v):
        q = rotate_half(q, cos[pos_q][:, None], sin[pos_q][:, None])
        k = rotate_half(k, cos[pos_kv][:, None], sin[pos_kv][:, None])
        return run_ours(variant, case, "auto", q, k, v, options=options, rope_base=None)

    return fn, [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]


def peers(variant: Variant, case: Case, device, options: KernelOptions, plain: bool = True):
    """name -> (callable of the leaf tensors returning an output, leaf tensors) for each peer that applies: for a
    masked variant, FlexAttention with its mask; for fused RoPE, the separate rotary; for unmasked variants (where
    `plain`), Flex's document mask, SDPA padded and nested, compiled padded GDPA."""
    out = {}
    if variant.rope_base:
        out["ours, separate rotary"] = _separate_rotary(variant, case, device, options)
    if variant.window or variant.block:
        if variant.op == "jfa":
            label = "+".join(
                ["doc"] + ["causal"] * variant.causal + [f"window {variant.window}"] * bool(variant.window)
            )
            label += f"+block {variant.block}" if variant.block else ""
            out[f"flex ({label} mask)"] = _flex(case, variant, device)
        return out
    if not plain:
        return out
    causal = variant.causal
    scale = case.q.shape[-1] ** -0.5
    q_full = case.q.repeat(len(case.kv_lens), 1, 1) if case.shared_q else case.q
    mask = _masks(case, causal, device)
    qp = _padded(q_full, case.q_lens, case.max_q).requires_grad_()
    kp = _padded(case.k, case.kv_lens, case.max_kv).requires_grad_()
    vp = _padded(case.v, case.kv_lens, case.max_kv).requires_grad_()
    if variant.op == "jfa":
        out["flex (doc mask)"] = _flex(case, variant, device)
        out["sdpa padded (mask)"] = (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
            [qp, kp, vp],
        )
        nq, nk, nv = (t.detach().clone().requires_grad_() for t in (q_full, case.k, case.v))
        kv_off = offsets_of(case.kv_lens, device)

        def nested(nq, nk, nv):
            jq = torch.nested.nested_tensor_from_jagged(nq, offsets_of(case.q_lens, device)).transpose(1, 2)
            jk = torch.nested.nested_tensor_from_jagged(nk, kv_off).transpose(1, 2)
            jv = torch.nested.nested_tensor_from_jagged(nv, kv_off).transpose(1, 2)
            return F.scaled_dot_product_attention(jq, jk, jv, is_causal=causal, scale=scale).transpose(1, 2).values()

        out["sdpa nested"] = (nested, [nq, nk, nv])
    else:
        inv_len = torch.tensor([1.0 / max(n, 1) for n in case.kv_lens], device=device)[:, None, None, None]
        maskf = mask.to(case.q.dtype)

        @torch.compile(dynamic=False)
        def padded_gdpa(q, k, v):
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            return torch.matmul((F.silu(s.float()) * maskf * inv_len).to(q.dtype), v)

        out["compiled padded pointwise"] = (padded_gdpa, [qp, kp, vp])
    return out


# Peers that cannot be captured in a CUDA graph: nested tensors read their offsets on the host.
NOT_CAPTURABLE = {"sdpa nested"}


def _call(fn, leaves, backward: bool):
    """One timed call: `fn(*leaves)`, with backward also the input gradients of a fixed random output gradient."""
    if not backward:
        return lambda: fn(*leaves)
    grad = torch.randn_like(fn(*leaves))

    def call():
        torch.autograd.grad(fn(*leaves), leaves, grad)

    return call


def _time(fn, leaves, backward: bool, graph: bool = False, calling_thread: bool = False) -> float:
    """Median ms of one call `fn(*leaves)` (with backward: forward and input gradients). calling_thread: the
    backward runs on the calling thread (`torch.autograd.set_multithreading_enabled(False)`), not handed to
    autograd's device thread. graph: replayed from a
    CUDA graph, i.e. device time without the host's launch and Python costs (how a graph-captured training step
    runs), on fresh copies of the leaves: an older autograd graph still holding a leaf's gradient accumulator made
    on the default stream makes the capture fail ("operation would make the legacy stream depend on a capturing
    blocking stream")."""
    import triton.testing

    if graph:
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
    call = _call(fn, leaves, backward)
    with torch.set_grad_enabled(backward), torch.autograd.set_multithreading_enabled(not calling_thread):
        call()
        if not graph:
            return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph):
                call()
            return triton.testing.do_bench(cuda_graph.replay, warmup=25, rep=100, return_mode="median")
        finally:
            cuda_graph.reset()  # its memory pool goes back, captured or not


HOST_CALLS = 40  # calls per host-time sample: a few launches each, far below the device's launch queue (1024)


def host_us(fn, leaves, backward: bool, calling_thread: bool = False, calls: int = HOST_CALLS) -> float:
    """Host microseconds per eager call (with backward: forward and input gradients), the median of 5 samples of
    `calls` calls launched back to back without synchronizing: the launch queue never fills, so the host never
    waits for the GPU and wall time is host time. calling_thread: as `_time`."""
    call = _call(fn, leaves, backward)
    cuda = leaves[0].is_cuda
    samples = []
    with torch.set_grad_enabled(backward), torch.autograd.set_multithreading_enabled(not calling_thread):
        for _ in range(5):
            call()
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            samples.append((time.perf_counter() - start) / calls * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(samples)


HOST_ROUNDS = 5  # rounds of the calling-thread columns (`host_rounds`), whose medians the tables show


def _record_host(row: dict, fn, leaves, fwd_only: bool) -> None:
    """Host time of our eager calls (`host_us`): row["host_fwd_us"], and unless fwd_only row["host_fwd+bwd_us"],
    row["host_fwd+bwd_calling_thread_us"] and the eager fwd+bwd with the backward on the calling thread
    (row["fwd+bwd_calling_thread_ms"]); the calling-thread pair also as the first entry of its "_rounds" list."""
    try:
        row["host_fwd_us"] = host_us(fn, leaves, False)
        if not fwd_only:
            row["host_fwd+bwd_us"] = host_us(fn, leaves, True)
            _calling_thread_round(row, fn, leaves)
    except Exception as err:
        row["host_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    torch.cuda.empty_cache()


def _calling_thread_round(row: dict, fn, leaves) -> None:
    """One round of the calling-thread columns: appended to their "_rounds" lists, the columns set to the medians."""
    for label, value in (
        ("host_fwd+bwd_calling_thread_us", host_us(fn, leaves, True, calling_thread=True)),
        ("fwd+bwd_calling_thread_ms", _time(fn, leaves, True, calling_thread=True)),
    ):
        rounds = row.setdefault(f"{label}_rounds", [])
        rounds.append(value)
        row[label] = statistics.median(rounds)


def host_rounds(jobs: list[tuple[dict, Any, list]], rounds: int = HOST_ROUNDS) -> None:
    """The calling-thread columns of each (row, fn, leaves) in `jobs` `rounds - 1` more times (`_record_host` took
    the first), one variant after another, then again: where the host time is near the GPU time these timings moved
    with the machine's load by up to 2x from one variant to the next (H200, 2026-12-01), and a median over rounds
    spread out in time is not moved by a load that passes during one of them."""
    for _ in range(rounds - 1):
        for row, fn, leaves in jobs:
            try:
                _calling_thread_round(row, fn, leaves)
            except Exception as err:
                row["host_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    torch.cuda.empty_cache()


HOST_ONLY_CALLS = 200  # `host_benchmark`'s calls per sample: at most 5 launches each, under the launch queue (1024)


def host_benchmark(
    config_names: list[str], out_dir: Path, options: KernelOptions, seed: int = 0, progress=print, device="cuda"
) -> list[dict]:
    """Host time alone (`gemrec bench kernels --host-only`): per config and variant, our eager forward, fwd+bwd and
    fwd+bwd with the backward on the calling thread (`host_us`, `HOST_ONLY_CALLS` calls back to back, unsynchronized,
    median of 5 samples), then each fwd+bwd's host timeline (kernels_host_timeline.txt). No correctness check, no
    device timing, no peers: seconds per config, to compare host paths (run with `--no-autotune`, every kernel takes
    its first tile at once; host time does not depend on the tile). device: "cpu" runs the reference (tests)."""
    device = torch.device(device)
    rows, timelines = [], []
    for name in config_names:
        cfg = CONFIGS[name]
        case = make_case(cfg, seed, device)
        for variant in cfg.variants:
            leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]

            def fn(q, k, v, variant=variant, case=case):
                return run_ours(variant, case, "auto", q, k, v, options=options)

            row: dict[str, Any] = {"config": name, "variant": variant.name, "impl": "ours (triton)"}
            for label, backward, calling_thread in (
                ("host_fwd_us", False, False),
                ("host_fwd+bwd_us", True, False),
                ("host_fwd+bwd_calling_thread_us", True, True),
            ):
                row[label] = host_us(fn, leaves, backward, calling_thread, calls=HOST_ONLY_CALLS)
            rows.append(row)
            progress(
                f"{name:8s} {variant.name:22s} host us per call: fwd {row['host_fwd_us']:.0f}, fwd+bwd "
                f"{row['host_fwd+bwd_us']:.0f}, fwd+bwd calling thread {row['host_fwd+bwd_calling_thread_us']:.0f}"
            )
            timelines.append(f"{name}/{variant.name}\n{host_timeline(profile_call(fn, leaves).events())}\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(short=True),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "kernel_options": options.to_dict(),
        "calls_per_sample": HOST_ONLY_CALLS,
    }
    (out_dir / "kernels_host.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out_dir / "kernels_host_timeline.txt").write_text("\n".join(timelines))
    return rows


def profile_call(fn, leaves):
    """A torch.profiler profile (host and device) of one eager fwd+bwd `fn(*leaves)` from an idle GPU, after three
    unprofiled calls (autotuning, warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    call = _call(fn, leaves, True)
    cuda = leaves[0].is_cuda
    sync = torch.cuda.synchronize if cuda else lambda: None
    for _ in range(3):
        call()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        call()
        sync()
    return prof


def profile_ours(
    config_names: list[str], options: KernelOptions, seed: int = 0, progress=print, out_dir: Path | None = None
) -> None:
    """Per-kernel device time of one fwd+bwd of our kernels, for each config and variant, then its host timeline
    (`host_timeline`); with out_dir, each profile's Chrome trace goes there."""
    device = torch.device("cuda")
    for name in config_names:
        cfg = CONFIGS[name]
        case = make_case(cfg, seed, device)
        for variant in cfg.variants:
            leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
            prof = profile_call(
                lambda q, k, v, variant=variant, case=case: run_ours(variant, case, "auto", q, k, v, options=options),
                leaves,
            )
            progress(f"profile {name}/{variant.name}")
            progress(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50))
            progress(host_timeline(prof.events()))
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(out_dir / f"trace_{name}_{variant.name}.json"))


def host_timeline(events) -> str:
    """The host side of one profiled call: its CPU events up to three levels deep (the op, its allocations and kernel
    launches; autograd's backward on its own thread), in start order, each with its start in us after the first
    event, its duration and its thread."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not cpu:
        return "(no host events)"
    t0 = min(e.time_range.start for e in cpu)

    def depth(e) -> int:
        d = 0
        while e.cpu_parent is not None:
            e, d = e.cpu_parent, d + 1
        return d

    lines = ["   start us      us  thread  event"]
    for e in sorted(cpu, key=lambda e: e.time_range.start):
        d = depth(e)
        if d <= 3:
            start, took = e.time_range.start - t0, e.time_range.elapsed_us()
            lines.append(f"{start:11.1f} {took:7.1f} {e.thread:7d}  {'  ' * d}{e.name[:80]}")
    return "\n".join(lines)


def least_bytes(case: Case) -> dict[str, int]:
    """The fewest bytes each timing must move through device memory: forward reads q, k, v and writes out (and the
    softmax's logsumexp, 4 bytes per row and head); backward reads q, k, v and dO and writes dq, dk, dv."""
    q_rows = sum(case.q_lens)
    heads, head_dim, size = case.q.shape[1], case.q.shape[2], case.q.element_size()
    q_side, kv_side = q_rows * heads * head_dim * size, case.k.shape[0] * heads * head_dim * size
    fwd = 2 * q_side + 2 * kv_side + q_rows * heads * 4
    total = fwd + 3 * q_side + 4 * kv_side
    return {"fwd": fwd, "fwd+bwd": total, "graph fwd": fwd, "graph fwd+bwd": total}


def _record(row: dict, label: str, flops: int, fn, leaves, backward: bool, graph: bool) -> None:
    """row[label_ms / label_tflops (/ label_tbps with row["bytes"])] from `_time`, or row[label_error] where it fails
    (a peer's OOM, say)."""
    try:
        ms = _time(fn, leaves, backward, graph)
        row[f"{label}_ms"] = ms
        row[f"{label}_tflops"] = flops / (ms * 1e-3) / 1e12
        if "bytes" in row:
            row[f"{label}_tbps"] = row["bytes"][label] / (ms * 1e-3) / 1e12
    except Exception as err:
        row[f"{label}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    torch.cuda.empty_cache()


def _timings(fwd_flops: int, bwd_flops: int):
    """(label, backward, graph, FLOPs) of each timing column."""
    total = fwd_flops + bwd_flops
    return (
        ("fwd", False, False, fwd_flops),
        ("fwd+bwd", True, False, total),
        ("graph fwd", False, True, fwd_flops),
        ("graph fwd+bwd", True, True, total),
    )


def run_benchmark(
    config_names: list[str],
    out_dir: Path,
    options: KernelOptions,
    seed: int = 0,
    with_peers: bool = True,
    progress=print,
    fp8_vs_bf16: bool = False,
    fwd_only: bool = False,
) -> list[dict]:
    """Correctness of every variant first, then fwd and fwd+bwd timings of ours (run with `options`) and the peers.
    fp8_vs_bf16: ours with the FP8 forward too ("ours (triton, fp8 fwd)", checked against fp32 at `FP8_CHECK_TOL`),
    each of its rows with its speed-up over ours (`*_vs_ours`); fwd_only: no fwd+bwd timings."""
    fp8_options = dataclasses.replace(options, fp8=True)

    def ours(variant: Variant) -> dict[str, KernelOptions]:  # the FP8 forward has no RoPE
        fp8 = {FP8_IMPL: fp8_options} if fp8_vs_bf16 and not variant.rope_base else {}
        return {"ours (triton)": options} | fp8

    device = torch.device("cuda")
    # every config and grad mode compiles the peers' flex_attention and padded GDPA again; past dynamo's default
    # limit of 8 recompiles they silently ran uncompiled (the C-pma Flex row at 20 ms)
    torch._dynamo.config.recompile_limit = 64
    rows: list[dict] = []
    graph_jobs = []
    profiled = []  # (label, fn, leaves) of ours, for the host timelines
    host_jobs: list[tuple[dict, Any, list]] = []  # (row, fn, leaves) of ours, for the calling-thread rounds
    checks = {}
    for name in config_names:
        cfg = CONFIGS[name]
        for variant in cfg.variants:
            for impl_options in ours(variant).values():
                key = f"{name}/{variant.name}" + (" fp8 fwd" if impl_options.fp8 else "")
                checks[key] = check_correctness(cfg, variant, device, seed + 1, impl_options, not fwd_only)
                progress(f"check {key}: {'ok' if checks[key]['ok'] else 'FAIL'} {checks[key]['errors']}")
    from gemrec.kernels.triton_attention import tuned_configs

    for name in config_names:
        cfg = CONFIGS[name]
        case = make_case(cfg, seed, device)
        tuned_before = len(tuned_configs())
        for variant in cfg.variants:
            fwd_flops, bwd_flops = attention_flops(
                case.q_offsets,
                case.kv_offsets,
                cfg.heads,
                cfg.head_dim,
                variant.causal,
                window=variant.window,
                block=variant.block,
            )
            leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
            impls = {
                impl: (
                    lambda q, k, v, variant=variant, case=case, impl_options=impl_options: run_ours(
                        variant, case, "auto", q, k, v, options=impl_options
                    ),
                    leaves,
                )
                for impl, impl_options in ours(variant).items()
            }
            if with_peers:
                try:
                    impls.update(peers(variant, case, device, options, plain=cfg.plain_peers))
                except Exception as err:  # a peer that cannot even be set up is reported, not fatal
                    reason = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                    progress(f"peers for {name}/{variant.name} unavailable: {reason}")
                    rows.append(
                        {"config": name, "variant": variant.name, "impl": "peers (setup failed)"}
                        | {f"{label}_error": reason for label in LABELS}
                    )
                torch.cuda.empty_cache()
            for impl, (fn, impl_leaves) in impls.items():
                row = {
                    "config": name,
                    "variant": variant.name,
                    "impl": impl,
                    "fwd_gflop": fwd_flops / 1e9,
                    "bwd_gflop": bwd_flops / 1e9,
                }
                if variant.block:  # memory-bound: the bytes it must move, and the TB/s each timing makes of them
                    row["bytes"] = least_bytes(case)
                for label, backward, graph, flops in _timings(fwd_flops, bwd_flops):
                    if backward and fwd_only:
                        row[f"{label}_error"] = "not timed (--fwd-only)"
                    elif not graph:
                        _record(row, label, flops, fn, impl_leaves, backward, graph)
                    elif impl in NOT_CAPTURABLE:
                        row[f"{label}_error"] = "not capturable"
                    else:
                        graph_jobs.append((row, label, flops, fn, impl_leaves, backward))
                if impl in ours(variant):
                    _record_host(row, fn, impl_leaves, fwd_only)
                    profiled.append((f"{name}/{variant.name} {impl}", fn, impl_leaves))
                    if not fwd_only and "host_error" not in row:
                        host_jobs.append((row, fn, impl_leaves))
                rows.append(row)
                _speedups(rows)
                progress(format_row(row))
        if fp8_vs_bf16:
            rows.append(_quantization_row(name, case, graph_jobs))
            progress(format_row(rows[-1]))
        for entry in tuned_configs()[tuned_before:]:  # every candidate's time, per kernel tuned for this config
            consts = entry["constexprs"]
            progress(
                f"  tuned {name} {entry['kernel']} {entry['dtype']} mode={consts['MODE']} causal={consts['CAUSAL']} "
                f"window={consts.get('WINDOW')} block={consts.get('MASK_BLOCK')} rope={consts.get('ROPE')} "
                f"fuse_dq={consts.get('FUSE_DQ')} buckets={entry['len_buckets']}: "
                + " ".join(f"{c}={ms}" for c, ms in entry["candidates_ms"].items())
                + (
                    ("; finalists, warmed up: " + " ".join(f"{c}={ms}" for c, ms in entry["finalists_ms"].items()))
                    if entry["finalists_ms"]
                    else ""
                )
                + (f" failed: {entry['failures']}" if entry["failures"] else "")
            )
    # CUDA-graph timings last: a failed capture can leave the CUDA RNG and the allocator's pools unusable for the
    # calls after it, which must not cost any eager timing
    for row, label, flops, fn, impl_leaves, backward in graph_jobs:
        _record(row, label, flops, fn, impl_leaves, backward, graph=True)
        if label == ("graph fwd" if fwd_only else "graph fwd+bwd"):
            _speedups(rows)
            progress(format_row(row))
    host_rounds(host_jobs)
    for row, _, _ in host_jobs:
        progress(format_row(row))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not fwd_only:  # after every timing: the profiler must not touch one
        timelines = []
        for key, fn, impl_leaves in profiled:
            try:
                timelines.append(f"{key}\n{host_timeline(profile_call(fn, impl_leaves).events())}\n")
            except Exception as err:
                timelines.append(f"{key}: {type(err).__name__}: {str(err).splitlines()[0][:120]}\n")
        (out_dir / "kernels_host_timeline.txt").write_text("\n".join(timelines))
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(short=True),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "checks": checks,
        "kernel_options": options.to_dict(),
        "fp8_vs_bf16": fp8_vs_bf16,
    }
    import triton

    meta["triton"] = triton.__version__
    meta["tuned"] = tuned_configs()
    (out_dir / "kernels_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out_dir / "kernels_bench.md").write_text(markdown(meta, rows))
    return rows


FP8_IMPL = "ours (triton, fp8 fwd)"


FP8_QUANTIZE = "fp8 k/v quantization (part of fp8 fwd)"


def _quantization_row(name: str, case: Case, graph_jobs: list) -> dict:
    """The FP8 forward's k/v quantization alone (`fp8_attention.quantize_kv`), forward timings only, in TB/s of the
    bytes it moves (reads k and v, writes them in e4m3); CUDA-graph timings go to `graph_jobs`."""
    from gemrec.kernels.fp8_attention import quantize_kv

    row: dict[str, Any] = {"config": name, "variant": "-", "impl": FP8_QUANTIZE, "fwd_gflop": 0.0, "bwd_gflop": 0.0}
    moved = (2 * case.k.element_size() + 2) * case.k.numel()
    row["bytes"] = {"fwd": moved, "graph fwd": moved}

    def fn(q, k, v):
        return quantize_kv(k, v, case.kv_offsets, case.max_kv)[0]

    leaves = [case.q, case.k, case.v]
    for label, backward, graph, _ in _timings(0, 0):
        if backward:
            row[f"{label}_error"] = "forward only"
        elif not graph:
            _record(row, label, 0, fn, leaves, False, False)
        else:
            graph_jobs.append((row, label, 0, fn, leaves, False))
    return row


def _speedups(rows: list[dict]) -> None:
    """Each FP8 row's `<label>_vs_ours`: ours' time over its own, per timing both have."""
    ours = {(r["config"], r["variant"]): r for r in rows if r["impl"] == "ours (triton)"}
    for row in rows:
        base = ours.get((row["config"], row["variant"]))
        if row["impl"] != FP8_IMPL or base is None:
            continue
        for label in LABELS:
            if f"{label}_ms" in row and f"{label}_ms" in base:
                row[f"{label}_vs_ours"] = base[f"{label}_ms"] / row[f"{label}_ms"]


LABELS = tuple(label for label, *_ in _timings(0, 0))  # the timing columns, in order


def format_row(row: dict) -> str:
    def cell(label):
        if f"{label}_tflops" in row:
            tbps = f" {row[f'{label}_tbps']:.2f} TB/s" if f"{label}_tbps" in row else ""
            vs = f" {row[f'{label}_vs_ours']:.2f}x" if f"{label}_vs_ours" in row else ""
            return f"{row[f'{label}_ms']:.3f} ms {row[f'{label}_tflops']:.0f} TF/s{tbps}{vs}"
        return row.get(f"{label}_error", "-")

    host = ""
    if "host_fwd_us" in row:
        host = f" host fwd {row['host_fwd_us']:.0f} us"
        if "host_fwd+bwd_us" in row:
            host += (
                f", fwd+bwd {row['host_fwd+bwd_us']:.0f} us (calling thread {row['host_fwd+bwd_calling_thread_us']:.0f}"
                f" us, eager {row['fwd+bwd_calling_thread_ms']:.3f} ms)"
            )
    elif "host_error" in row:
        host = f" host {row['host_error']}"
    return (
        f"{row['config']:8s} {row['variant']:22s} {row['impl']:30s} "
        + " ".join(f"{label} {cell(label):22s}" for label in LABELS)
        + host
    )


def _host_table(rows: list[dict]) -> list[str]:
    """The markdown table of our rows' host times (`_record_host`) beside eager and graph fwd+bwd."""
    timed = [r for r in rows if "host_fwd+bwd_us" in r]
    if not timed:
        return []

    def ratio(r, label):
        return f"{r[label] / r['graph fwd+bwd_ms']:.2f}" if label in r and "graph fwd+bwd_ms" in r else "-"

    lines = [
        "",
        "Host time (us per eager call, launched back to back without synchronizing; `host_us`); calling thread: the "
        "backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`), not autograd's device "
        f"thread; its columns are medians of {HOST_ROUNDS} rounds, the later ones interleaved across the variants "
        "after the graph timings (`host_rounds`).",
        "",
        "| config | variant | impl | host fwd us | host fwd+bwd us | host fwd+bwd us, calling thread "
        "| eager fwd+bwd ms | eager fwd+bwd ms, calling thread | graph fwd+bwd ms | eager / graph "
        "| eager, calling thread / graph |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        graph = f"{r['graph fwd+bwd_ms']:.3f}" if "graph fwd+bwd_ms" in r else "-"
        eager = f"{r['fwd+bwd_ms']:.3f}" if "fwd+bwd_ms" in r else "-"
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['impl']} | {r['host_fwd_us']:.0f} | {r['host_fwd+bwd_us']:.0f} | "
            f"{r['host_fwd+bwd_calling_thread_us']:.0f} | {eager} | {r['fwd+bwd_calling_thread_ms']:.3f} | {graph} | "
            f"{ratio(r, 'fwd+bwd_ms')} | {ratio(r, 'fwd+bwd_calling_thread_ms')} |"
        )
    return lines


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Date {meta['date']}, commit {meta['commit']}, {meta['device']}, torch {meta['torch']}, "
        f"triton {meta.get('triton')}, kernel options {meta.get('kernel_options')}.",
        "",
        "Correctness (bf16 kernel vs fp32 reference, relative L2 error): "
        + "; ".join(
            f"{k} {'ok' if v['ok'] else 'FAIL'} (max {max(v['errors'].values()):.1e})"
            for k, v in meta["checks"].items()
        ),
        "",
        "Eager: each call launched from Python. Graph: replayed from a CUDA graph (device time, no host costs). "
        "Block variants: TB/s of the least bytes the call must move (`least_bytes`).",
        "",
        "| config | variant | impl | " + " | ".join(f"{label} ms | {label} TFLOP/s" for label in LABELS) + " |",
        "|---|---|---|" + "---|---|" * len(LABELS),
    ]

    def ms(r, label):
        return f"{r[f'{label}_ms']:.3f}" if f"{label}_ms" in r else r.get(f"{label}_error", "-")[:40]

    def tf(r, label):
        if f"{label}_tflops" not in r:
            return "-"
        return (
            f"{r[f'{label}_tflops']:.0f}"
            + (f" ({r[f'{label}_tbps']:.2f} TB/s)" if f"{label}_tbps" in r else "")
            + (f" ({r[f'{label}_vs_ours']:.2f}x ours)" if f"{label}_vs_ours" in r else "")
        )

    for r in rows:
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['impl']} | "
            + " | ".join(f"{ms(r, label)} | {tf(r, label)}" for label in LABELS)
            + " |"
        )
    lines += _host_table(rows)
    return "\n".join(lines) + "\n"
