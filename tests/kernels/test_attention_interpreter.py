"""The Triton kernels under the CPU interpreter (TRITON_INTERPRET=1) against the torch reference.

Forward and every gradient (q, k, v, attn_bias, position and time tables). The interpreter must be chosen
before triton is first imported, so when this process imported triton without it these tests are skipped
here and run in a subprocess by test_attention_interpreter_subprocess.py. The kernels run with `ONE_LAUNCH`
options (the one-launch backward and the tensor-descriptor tiles on) unless a test passes others. With 16-wide head
dims nearly every shape here fits the resident-K/V kernels, so the main tests run each shape three ways
(`kernel_path`).
"""

import collections
import dataclasses
import functools
import importlib.util
import itertools
import subprocess
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from gemrec.kernels import KernelOptions, attention_flops, gdpa, jagged_attention
from gemrec.kernels import triton_attention as kernels_module
from gemrec.kernels.reference import rope_cos_sin
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_harness import GRADIENTS, make_case, max_error, offsets_of, run
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.skipif(
    not kernels_module.INTERPRET, reason="triton was imported without TRITON_INTERPRET=1 (run in a subprocess)"
)
HEADS, DIM = 2, 16
ONE_LAUNCH = KernelOptions(one_launch=True)
SEPARATE = KernelOptions(one_launch=False, resident=False)  # the delta, dK/dV and dQ kernels


def compare(
    q_lens,
    kv_lens,
    op="jfa",
    causal=False,
    normalize="kv_len",
    bias=False,
    dim=DIM,
    dtype=torch.float32,
    seed=0,
    tol=2e-5,
    options=ONE_LAUNCH,
    **masks,
):
    """The Triton kernels against the reference: output and every gradient, max error relative to max(|ref|, 1);
    `masks`: window, block, rope_base."""
    case = make_case(q_lens, kv_lens, heads=HEADS, dim=dim, bias=bias, seed=seed)
    activation = "softmax" if op == "jfa" else op
    kw = dict(dtype=dtype, causal=causal, normalize=normalize, **masks)
    got = run(case, activation, backend="triton", options=options, **kw)
    want = run(case, activation, backend="reference", **kw)
    assert got[0].shape == (case.rows, HEADS, dim)
    for name, g, w in zip(GRADIENTS, got, want):
        g = torch.zeros_like(w) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        assert g.shape == w.shape, name
        if g.numel():
            err = max_error(g, w)
            assert err < tol, f"{name}: max error {err:.2e}"


EDGE = [5, 0, 17, 1, 33]  # empty, length 1, lengths not multiples of the 16-wide interpreter tiles


@pytest.fixture(params=["resident_kv", "resident_q", "tiled"])
def kernel_path(request, monkeypatch) -> KernelOptions:
    """The options of a path. resident_kv: K/V resident wherever the keys fit, 32 query rows per program;
    resident_q: only query sequences of up to 16 rows fit, so those shapes keep the queries resident; tiled:
    resident kernels off."""
    if request.param == "resident_q":
        monkeypatch.setattr(kernels_module, "RESIDENT_MAX_TILE", 16 * DIM)
    return KernelOptions(one_launch=True, resident=request.param != "tiled")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_self_attention_with_all_biases(op, causal, kernel_path):
    compare(EDGE, EDGE, op=op, causal=causal, bias=True, seed=int(causal), options=kernel_path)


@pytest.mark.parametrize(
    "op,normalize", [("gelu", "max_len"), ("gelu_tanh", "none"), ("relu", "kv_len"), ("relu2", "max_len")]
)
def test_activations(op, normalize, kernel_path):
    compare([7, 18], [7, 18], op=op, causal=True, normalize=normalize, seed=3, options=kernel_path)
    compare([5, 40], [9, 3], op=op, causal=True, normalize=normalize, seed=30, options=kernel_path)


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_asymmetric_lengths(op, kernel_path):
    compare([4], [20, 0, 37], op=op, bias=True, seed=4, options=kernel_path)  # PMA: shared seeds, never copied B times
    compare(
        [20, 3, 40], [5, 1, 2], op=op, causal=True, bias=True, seed=5, options=kernel_path
    )  # cross-attention: long q over few keys
    compare([20, 3], [6], op=op, seed=6, options=kernel_path)  # one key/value sequence shared by every query sequence
    compare([1, 50], [50, 1], op=op, causal=True, bias=True, seed=7, options=kernel_path)  # very unequal, both ways
    compare(
        [70, 0, 33], [3, 4, 0], op=op, seed=24, options=kernel_path
    )  # 3 query chunks of 32 rows over resident keys; no keys at all
    compare(
        [3, 0, 9], [70, 5, 0], op=op, causal=True, bias=True, seed=25, options=kernel_path
    )  # 3 key chunks over resident queries


def test_resident_kernels_are_the_ones_that_run(monkeypatch):
    launched = []
    call = kernels_module._Kernel.__call__

    def record(self, *args, **kwargs):
        launched.append(self.kind)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(kernels_module._Kernel, "__call__", record)
    compare([40, 3], [5, 9], seed=26)
    assert launched == ["fwd_rkv", "bwd_rkv"]
    launched.clear()
    monkeypatch.setattr(kernels_module, "RESIDENT_MAX_TILE", 16 * DIM)
    compare([4], [40, 3], op="silu", seed=27)
    assert launched == ["fwd", "bwd_rq"]
    launched.clear()
    compare([4], [40, 3], op="silu", seed=27, options=KernelOptions(one_launch=True, resident=False))
    assert "bwd_rq" not in launched and "fwd_rkv" not in launched


def test_resident_side_choice_on_the_benchmark_shapes():
    def problem(q_rows, kv_rows, q_seqs, max_q, max_kv, dim=128):  # 32 key sequences; q_seqs 1: shared queries
        q = torch.empty(q_rows, 8, dim, device="meta")
        k = torch.empty(kv_rows, 8, dim, device="meta")
        return kernels_module.Problem(
            q,
            k,
            k,
            torch.zeros(q_seqs + 1),
            torch.zeros(33),
            max_q,
            max_kv,
            0,
            False,
            0.1,
            0,
            None,
            None,
            None,
            None,
            None,
            128,
            2.0,
            KernelOptions(),
        )

    assert problem(65536, 1280, 32, 4096, 4096).resident() is None  # max lengths 4096 both ways
    assert problem(65536, 1280, 32, 4096, 64).resident() == "kv"  # C-cross: 64 keys x 128 dims
    assert problem(32, 65536, 1, 32, 4096).resident() == "q"  # C-pma: 32 seeds
    assert problem(32, 65536, 1, 64, 4096, dim=256).resident() is None  # 64 seeds x 256 dims stay tiled


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the public ops take the custom ops' route."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "q_lens,kv_lens,op,causal,masks",
    [
        ([5, 0, 17, 1], [5, 0, 17, 1], "jfa", True, {}),
        ([4], [20, 0, 37], "silu", False, {}),
        ([20, 3, 40], [5, 1, 2], "jfa", True, {"window": 7, "rope_base": 100.0}),
        ([9, 40], [9, 40], "silu", False, {"block": 16}),
    ],
)
def test_eager_path_equals_the_custom_ops(q_lens, kv_lens, op, causal, masks, monkeypatch):
    """Eager calls on plain tensors launch the kernels from Python, the backward reusing the forward's `Problem`
    bound to the saved tensors; under a dispatch mode the same kernels run through the custom ops, each building its
    own. Outputs and every gradient are identical."""
    monkeypatch.setattr(kernels_module, "FUSE_DQ_MIN_KV", 0)  # the fused dQ buffer too
    bound = []
    bind = kernels_module.Problem.bind
    monkeypatch.setattr(
        kernels_module.Problem, "bind", lambda p, tensors: bound.append(tensors is None) or bind(p, tensors)
    )
    case = make_case(q_lens, kv_lens, heads=HEADS, dim=DIM, bias=True, seed=len(q_lens))
    activation = "softmax" if op == "jfa" else op
    # resident kernels where they fit, then the separate launches; half precision: the kernels cast their fp32 sums
    for options, dtype in itertools.product((ONE_LAUNCH, SEPARATE), (torch.float32, torch.float16)):
        bound.clear()
        eager = run(case, activation, backend="triton", causal=causal, options=options, dtype=dtype, **masks)
        # kept without tensors by the forward, bound by the backward and without them again after
        assert bound == [True, False, True]
        with _PassThrough():
            through_ops = run(case, activation, backend="triton", causal=causal, options=options, dtype=dtype, **masks)
        assert bound == [True, False, True]
        for name, a, b in zip(GRADIENTS, eager, through_ops):
            assert (a is None and b is None) or torch.equal(a, b), (name, options, dtype)


def test_a_retained_graph_runs_its_backward_twice():
    """The kept `Problem` holds no tensor the first backward frees: a retained graph's second backward, on the same
    saved tensors, gives the same gradients."""
    off = offsets_of([5, 0, 17])
    q, k, v = (torch.randn(22, HEADS, DIM, requires_grad=True) for _ in range(3))
    out = jagged_attention(q, k, v, off, off, 17, 17, causal=True, backend="triton", options=SEPARATE)
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_backward_with_dq_fused_into_the_key_block_kernel(op, monkeypatch):
    monkeypatch.setattr(kernels_module, "FUSE_DQ_MIN_KV", 0)  # dq by atomics from the dK/dV kernel everywhere
    compare(EDGE, EDGE, op=op, causal=True, seed=11, options=SEPARATE)
    compare([4], [20, 0, 37], op=op, seed=12, options=SEPARATE)  # shared seeds: dq reduced over the key sequences
    compare([20, 3, 40], [5, 1, 2], op=op, causal=True, seed=13, options=SEPARATE)
    compare([20, 3], [6], op=op, seed=14, options=SEPARATE)
    compare([9, 4], [9, 4], op=op, dim=24, seed=15, options=SEPARATE)


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_backward_in_separate_launches(op, monkeypatch):
    """The backward in separate launches (every other test here runs the one-launch backward): delta kernel, dK/dV
    kernel, dQ kernel with the bias gradients; through tensor descriptors, then through pointer loads."""
    compare(EDGE, EDGE, op=op, causal=True, bias=True, seed=20, options=SEPARATE)
    compare([4], [20, 0, 37], op=op, bias=True, seed=21, options=SEPARATE)
    pointers = KernelOptions(one_launch=False, resident=False, tma=False)
    compare([20, 3, 40], [5, 1, 2], op=op, causal=True, seed=22, options=pointers)
    compare([9, 4], [9, 4], op=op, dim=24, bias=True, seed=23, options=pointers)


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_half_precision_gradients_cast_by_the_last_program(op, monkeypatch):
    """fp16 inputs, whose fp32 sums the last program of each region casts (`_last_arrival`): dQ of the fused key-block
    kernel, dK and dV of the resident-key kernel, dQ of the resident-query kernel (shared queries: one region per
    head), with several programs per region, empty sequences and sequences that no program but the last reaches; and
    the fused dQ of the custom ops and of a large problem, cast by one copy after the kernel."""
    monkeypatch.setattr(kernels_module, "FUSE_DQ_MIN_KV", 0)
    half = {"dtype": torch.float16, "tol": 1e-2}
    compare(EDGE, EDGE, op=op, causal=True, seed=30, options=SEPARATE, **half)
    compare([20, 3, 40], [5, 1, 2], op=op, seed=31, options=SEPARATE, **half)
    compare([40, 0, 70], [3, 4, 0], op=op, seed=32, options=KernelOptions(), **half)  # resident keys
    monkeypatch.setattr(kernels_module, "RESIDENT_MAX_TILE", 16 * DIM)
    compare([4], [40, 0, 70], op=op, seed=33, options=KernelOptions(), **half)  # resident shared queries
    compare([3, 0, 9], [70, 5, 0], op=op, causal=True, seed=34, options=KernelOptions(), **half)
    with _PassThrough():  # the custom ops (what compiled steps call): the fused dQ copied after the kernel
        compare(EDGE, EDGE, op=op, causal=True, seed=36, options=SEPARATE, **half)
    monkeypatch.setattr(kernels_module, "ONE_LAUNCH_MAX_WORK", 0)  # a large problem: copied after it too
    compare(EDGE, EDGE, op=op, causal=True, seed=35, options=SEPARATE, **half)


def _host_path(fn) -> tuple[list[str], collections.Counter]:
    """The kernels one call of `fn` launches, and the torch ops it calls beside them: the `aten::` ops called from
    Python (none above them, nor inside a launch), on the calling thread."""
    from torch.profiler import ProfilerActivity, profile, record_function

    kinds = []
    launch = kernels_module._Kernel.__call__

    def recorded(self, *args, **kwargs):
        kinds.append(self.kind)
        with record_function("launch"):
            return launch(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels_module._Kernel, "__call__", recorded)
        with torch.autograd.set_multithreading_enabled(False), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()

    def from_python(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name == "launch" or parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return event.name.startswith("aten::") and event.name not in ("aten::resolve_conj", "aten::resolve_neg")

    return kinds, collections.Counter(e.name.removeprefix("aten::") for e in prof.events() if from_python(e))


B, C_CROSS, C_PMA = ([130, 3, 40], [130, 3, 40]), ([40, 3, 20], [5, 9, 16]), ([8], [130, 3, 40])


@pytest.mark.parametrize(
    "lens,op,kinds,ops",
    [
        (B, "jfa", ["fwd", "delta", "dkdv"], {"new_empty": 5, "split_with_sizes": 1}),
        (B, "silu", ["fwd", "dkdv"], {"new_empty": 3, "new_zeros": 1, "split_with_sizes": 1}),
        (C_CROSS, "jfa", ["fwd_rkv", "bwd_rkv"], {"new_empty": 3, "new_zeros": 1, "split_with_sizes": 2}),
        (C_CROSS, "silu", ["fwd_rkv", "bwd_rkv"], {"new_empty": 3, "new_zeros": 1, "split_with_sizes": 2}),
        (C_PMA, "jfa", ["fwd", "bwd_rq"], {"new_empty": 3, "new_zeros": 1, "split_with_sizes": 1}),
        (C_PMA, "silu", ["fwd", "bwd_rq"], {"new_empty": 3, "new_zeros": 1, "split_with_sizes": 1}),
    ],
    ids=["B-jfa", "B-silu", "C-cross-jfa", "C-cross-silu", "C-pma-jfa", "C-pma-silu"],
)
def test_host_path_of_one_eager_call_on_the_benchmark_paths(lens, op, kinds, ops):
    """One eager fwd+bwd in half precision on the paths of configs B (fused dQ), C-cross (resident keys) and C-pma
    (resident shared queries): each launch, allocation and torch op costs the host microseconds per call (issue 16
    item 8). The kernels it launches, and beside them only allocations (out and lse; the gradients, one; the fp32
    sum that the kernels add into and cast from, with B's softmax delta) and a zero fill where no kernel zeroes that
    sum: no cast, copy or reduction launched from Python."""
    q_lens, kv_lens = lens
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(sum(q_lens), HEADS, 64, generator=gen).half().requires_grad_()
    k, v = (torch.randn(sum(kv_lens), HEADS, 64, generator=gen).half().requires_grad_() for _ in range(2))
    grad = torch.randn(q.shape[0] * (len(kv_lens) if len(q_lens) == 1 else 1), HEADS, 64, generator=gen).half()
    attention = jagged_attention if op == "jfa" else functools.partial(gdpa, activation=op)
    args = (q, k, v, offsets_of(q_lens), offsets_of(kv_lens), max(q_lens), max(kv_lens))

    def call():
        return torch.autograd.grad(attention(*args, backend="triton"), (q, k, v), grad)

    call()  # the launchers' caches
    launched, called = _host_path(call)
    assert (launched, called) == (kinds, collections.Counter(ops))


def test_batch_of_one_fp16_and_odd_head_dim():
    compare([19], [19], causal=True, dtype=torch.float16, tol=1e-2, seed=8)
    compare([19], [19], op="silu", dtype=torch.float16, tol=1e-2, seed=9)
    compare([9, 4], [9, 4], dim=24, causal=True, bias=True, seed=10)  # head_dim not a power of two


def test_all_sequences_empty():
    compare([0, 0], [0, 0])
    compare([0, 3], [2, 0], op="silu", causal=True)


@settings(
    max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # kernel_path only selects a path
@given(
    lens=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3),
    op=st.sampled_from(["jfa", "silu", "gelu_tanh"]),
    causal=st.booleans(),
    bias=st.booleans(),
)
def test_random_jagged_shapes(lens, op, causal, bias, kernel_path):
    q_lens, kv_lens = [a for a, _ in lens], [b for _, b in lens]
    if max(q_lens) == 0 or max(kv_lens) == 0:
        q_lens, kv_lens = [a + 1 for a in q_lens], [b + 1 for b in kv_lens]
    compare(q_lens, kv_lens, op=op, causal=causal, bias=bias, seed=sum(q_lens) * 7 + sum(kv_lens), options=kernel_path)


def test_custom_op_compiles_fullgraph_and_counts_flops():
    from torch.utils.flop_counter import FlopCounterMode

    lens = [5, 0, 20, 1]
    off = offsets_of(lens)
    q, k, v = (torch.randn(sum(lens), HEADS, 32, requires_grad=True) for _ in range(3))
    compiled = torch.compile(
        lambda q, k, v: gdpa(q, k, v, off, off, 20, 20, causal=True, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    out = compiled(q, k, v)
    torch.testing.assert_close(out, gdpa(q, k, v, off, off, 20, 20, causal=True, backend="triton"))
    with FlopCounterMode(display=False) as counter:
        jagged_attention(q, k, v, off, off, 20, 20, causal=True, backend="triton").sum().backward()
    fwd, bwd = attention_flops(off, off, HEADS, 32, causal=True)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    assert (fwd, bwd) == (4 * pairs * HEADS * 32, 8 * pairs * HEADS * 32)
    assert counter.get_total_flops() == fwd + bwd


def test_one_tensor_in_several_roles_under_compile():
    off = offsets_of([5, 0, 12])
    x = torch.randn(17, HEADS, DIM, requires_grad=True)
    compiled = torch.compile(
        lambda x: jagged_attention(x, x, x, off, off, 12, 12, causal=True, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    out = compiled(x)
    ref = jagged_attention(x, x, x, off, off, 12, 12, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0], rtol=1e-5, atol=1e-5
    )


def test_compiled_op_does_not_recompile_for_new_tensors(monkeypatch):
    # The eager path's id()-based aliasing check once made dynamo guard on tensor identity: a recompile per call.
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    off = offsets_of([5, 0, 12])
    compiled = torch.compile(
        lambda q, k, v: jagged_attention(q, k, v, off, off, 12, 12, causal=True, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    for _ in range(3):
        q, k, v = (torch.randn(17, HEADS, DIM, requires_grad=True) for _ in range(3))
        compiled(q, k, v).sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_pointer_loads_without_tensor_descriptors(op, kernel_path):
    options = dataclasses.replace(kernel_path, tma=False)  # the fallback for layouts a TMA descriptor cannot describe
    compare(EDGE, EDGE, op=op, causal=True, bias=True, seed=16, options=options)
    compare([4], [20, 0, 37], op=op, seed=17, options=options)
    compare([20, 3, 40], [5, 1, 2], op=op, causal=True, seed=18, options=options)


def test_tensor_descriptors_only_for_aligned_layouts():
    x = torch.randn(10, HEADS, DIM)
    assert kernels_module.tma_ok(x, x.half())
    assert not kernels_module.tma_ok(torch.randn(10, HEADS, DIM + 1)[..., 1:])  # head stride not 16-byte aligned
    assert not kernels_module.tma_ok(torch.randn(10, HEADS, 2).half())  # rows narrower than 16 bytes


@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_a_sequence_never_reads_its_neighbours_rows(op):
    # NaN keys/values in sequence 1 must not reach sequence 0, whose ragged last tile ends where they start
    lens = [21, 11]
    off = offsets_of(lens)
    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(sum(lens), HEADS, DIM, generator=gen) for _ in range(3))
    k[21:], v[21:] = float("nan"), float("nan")
    kw = dict(causal=False, backend="triton")
    out = (
        jagged_attention(q, k, v, off, off, 21, 21, **kw)
        if op == "jfa"
        else gdpa(q, k, v, off, off, 21, 21, activation=op, **kw)
    )
    first = offsets_of(lens[:1])
    ref = (
        jagged_attention(q[:21], k[:21], v[:21], first, first, 21, 21, backend="reference")
        if op == "jfa"
        else gdpa(q[:21], k[:21], v[:21], first, first, 21, 21, activation=op, backend="reference")
    )
    torch.testing.assert_close(out[:21], ref, rtol=1e-5, atol=1e-5)


MASKS = {
    "window3": dict(window=3),
    "window_longer_than_every_sequence": dict(window=200),
    "block16": dict(block=16),  # a mask of the tiled kernels (blocks other than 64 and 128)
    "block64": dict(block=64),  # the block kernels
    "block64_window5": dict(block=64, window=5),
}
MASK_LENGTHS = [66, 0, 5, 1, 20]  # two 64-blocks, empty, length 1, lengths not multiples of any block or tile


@pytest.mark.parametrize("rope", [False, True], ids=["no_rope", "rope"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["jfa", "silu"])
def test_masks_and_rope(op, causal, mask, rope):
    """Every mask x RoPE x op x causal through the tiled kernels (separate launches) or the block kernels: output and
    the gradients of q, k, v, and with causal ones, of every score bias too."""
    masks = MASKS[mask] | ({"rope_base": 100.0} if rope else {})
    seed = sorted(MASKS).index(mask) * 4 + 2 * causal + rope
    compare(MASK_LENGTHS, MASK_LENGTHS, op=op, causal=causal, bias=causal, seed=seed, options=SEPARATE, **masks)


def test_masks_and_rope_on_every_kernel_path(kernel_path):
    """Cross-attention, shared seeds and head dim 24 (12-wide halves) with windows, blocks and RoPE: the
    resident-side kernels (K/V or queries kept loaded) with the one-launch backward, or the tiled kernels."""
    kw = dict(options=kernel_path, rope_base=10.0)
    compare([20, 3, 40], [5, 1, 2], causal=True, bias=True, seed=31, window=2, **kw)
    compare([4], [20, 0, 37], op="silu", seed=32, window=3, **kw)  # PMA seeds: q rotated per key sequence
    compare([30, 3], [20, 1], op="silu", seed=34, block=4, dim=24, **kw)


def test_masks_and_rope_with_dq_fused_into_the_key_block_kernel(monkeypatch):
    """dQ added up w.r.t. the rotated queries by the dK/dV kernel, rotated back once per row after."""
    monkeypatch.setattr(kernels_module, "FUSE_DQ_MIN_KV", 0)  # dq by atomics from the dK/dV kernel everywhere
    compare([50, 20, 0], [50, 20, 0], causal=True, seed=35, window=20, rope_base=100.0, options=SEPARATE)
    compare([40, 20], [50, 20], op="silu", seed=36, window=30, block=32, rope_base=1000.0, options=SEPARATE)
    # shared seeds: each sequence's dQ rotated back at its own positions before the sum over sequences
    compare([4], [20, 0, 37], causal=True, seed=37, window=3, rope_base=10.0, options=SEPARATE)
    # queries longer than their keys: rows at negative positions, whose cos/sin rows lie below the table's position 0
    compare([50, 9], [20, 3], seed=45, window=40, rope_base=100.0, options=SEPARATE)


@triton.jit
def _rope_cos_sin_kernel(POS, RF, C, S, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.arange(0, ROWS)
    c, s = kernels_module._rope_cos_sin(tl.load(POS + rows), RF, BLOCK_D, False)
    offs = rows[:, None] * (BLOCK_D // 2) + tl.arange(0, BLOCK_D // 2)[None, :]
    tl.store(C + offs, c)
    tl.store(S + offs, s)


def test_rope_angles_accurate_at_long_positions():
    """The kernels' cos/sin (`_rope_cos_sin`: whole turns removed exactly, by the 1.5 * 2^23 rounding) against float64
    at positions up to +-65,535, where an angle rounded to fp32 before the reduction would be off by ~4e-3."""
    head_dim, base = 128, 10000.0
    gen = torch.Generator().manual_seed(0)
    edges = [0, 1, 2, 63, 64, 4095, 4096, 16383, 16384, 32767, 65535, -1, -4097, -65535]
    pos = torch.cat([torch.tensor(edges), torch.randint(-65535, 65536, (64 - len(edges),), generator=gen)])
    pos = pos.to(torch.int32)
    table = kernels_module.rope_frequencies(head_dim, base, head_dim, torch.device("cpu"))
    c = torch.empty(64, head_dim // 2)
    s = torch.empty_like(c)
    _rope_cos_sin_kernel[(1,)](pos, table, c, s, ROWS=64, BLOCK_D=head_dim)
    angles = pos.double()[:, None] * base ** (-2 * torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    assert (c.double() - angles.cos()).abs().max() < 2e-5
    assert (s.double() - angles.sin()).abs().max() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_table_holds_every_position_in_the_inputs_dtype(dtype):
    """`rope_table`: the fp32 frequencies of `_rope_cos_sin` first, then per position -8..7 cos and sin in the inputs'
    dtype, rounded from float64 angles (`reference.rope_cos_sin`), zero past head_dim // 2."""
    head_dim, block_d, base = 12, 16, 100.0
    buf = kernels_module.rope_table(head_dim, base, block_d, dtype, 8, torch.device("cpu"))
    freqs = kernels_module.rope_frequencies(head_dim, base, block_d, torch.device("cpu"))
    assert buf.dtype == torch.float32 and torch.equal(buf[:block_d], freqs.flatten())
    table = buf[block_d:].view(dtype).view(16, 2, block_d // 2)
    cos, sin = rope_cos_sin(torch.arange(-8, 8), head_dim, base)
    assert torch.equal(table[:, 0, : head_dim // 2], cos.to(dtype))
    assert torch.equal(table[:, 1, : head_dim // 2], sin.to(dtype))
    assert not table[:, :, head_dim // 2 :].any()


def test_block_kernel_with_longer_queries_or_keys_and_fp16():
    # bottom-right alignment: query blocks of positions that start inside a block, queries before the first key
    compare([100, 7], [70, 40], causal=True, seed=38, block=64, rope_base=10.0)
    compare([40, 70], [100, 7], op="silu", seed=39, block=64, window=10)
    compare([4], [70, 0, 64], seed=40, block=64, rope_base=10.0)  # shared seeds over key blocks
    compare([130], [130], causal=True, seed=41, block=128, rope_base=10.0)
    compare([70], [70], causal=True, dtype=torch.float16, tol=1e-2, seed=42, block=64, rope_base=10000.0)


@pytest.mark.parametrize("sub", [32, 64], ids=["half_block_slices", "whole_block_slices"])
def test_block_kernel_writes_every_gradient_row(sub, monkeypatch):
    """Keys before the first query's block and sequences without queries or without keys: their dK, dV (and dQ) rows
    come from the kernel, not from the allocation (its buffers are filled with NaN here). Slices of the whole block
    (RoPE: one cos/sin for K, the queries and dQ) or of half of it."""
    from gemrec.kernels import block_attention

    for kernel in block_attention.KERNELS.values():
        monkeypatch.setattr(kernel, "interpret_tiles", {"SUB_M": sub})
    empty, backward = torch.empty, block_attention.backward

    def nan_filled(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    def backward_into_nan(*args, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(torch, "empty", nan_filled)
            return backward(*args, **kwargs)

    monkeypatch.setattr(block_attention, "backward", backward_into_nan)
    compare([5, 0, 70, 64, 3], [200, 130, 0, 64, 3], causal=True, seed=43, block=64, rope_base=10.0)
    compare([100, 1], [70, 1], op="silu", seed=44, block=64, rope_base=10.0)


BASELINE = "f932c8c"  # main before window/block/rope_base existed: "today's" kernels


def _baseline_kernels(tmp_path):
    """The kernels module of BASELINE, from git, imported beside today's."""
    root = Path(__file__).resolve().parents[2]
    shown = subprocess.run(
        ["git", "-C", str(root), "show", f"{BASELINE}:kernels/triton_attention.py"], capture_output=True, text=True
    )
    if shown.returncode:
        pytest.skip(f"needs the git history holding {BASELINE}: {shown.stderr.strip()[:200]}")
    path = tmp_path / "baseline_triton_attention.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("resident,one_launch", [(False, False), (False, True), (True, True)])
def test_without_masks_or_rope_bit_identical_to_the_kernels_before_them(resident, one_launch, tmp_path, monkeypatch):
    """window=None, block=None, rope_base=None: outputs and gradients equal, bit for bit, to BASELINE's kernels (which
    read their options from environment variables)."""
    monkeypatch.setenv("GEMREC_KERNEL_RESIDENT", str(int(resident)))
    monkeypatch.setenv("GEMREC_KERNEL_ONE_LAUNCH", str(int(one_launch)))
    options = KernelOptions(resident=resident, one_launch=one_launch)
    baseline = _baseline_kernels(tmp_path)
    gen = torch.Generator().manual_seed(43)
    lens = [45, 0, 17, 1, 33]
    off = offsets_of(lens)
    q, k, v = (torch.randn(sum(lens), HEADS, DIM, generator=gen) for _ in range(3))
    bias = torch.randn(sum(lens), HEADS, 45, generator=gen)
    for mode, causal, attn_bias in [(0, True, None), (0, False, bias), (1, True, None), (3, False, bias)]:
        args = (
            q,
            k,
            v,
            off,
            off,
            45,
            45,
            mode,
            causal,
            0.3,
            1 if mode else 0,
            attn_bias,
            None,
            None,
            None,
            None,
            128,
            2,
        )
        today, before = kernels_module.Problem(*args, options), baseline.Problem(*args)
        out, lse = kernels_module.forward(today)
        out_before, lse_before = baseline.forward(before)
        grad = torch.randn(out.shape, generator=gen)
        results = [out, *kernels_module.backward(today, grad, out, lse)]
        results_before = [out_before, *baseline.backward(before, grad, out_before, lse_before)]
        assert torch.equal(lse, lse_before) or mode != 0
        for got, want in zip(results, results_before):
            assert (got is None and want is None) or torch.equal(got, want), (mode, causal)
