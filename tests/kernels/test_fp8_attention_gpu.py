"""The FP8 attention forward (`KernelOptions.fp8`) on the GPU: real e4m3 operands on the tensor cores, bf16 inputs,
against exact fp64 within FP8's error (`kernel_harness.FP8_TOL`, justified there) and within 1.25x (+1%) of the
emulation's error on the same inputs; the bf16 backward through it; the k/v quantization against the emulation's.
Untuned (the first tile that fits, pointer or descriptor: one compile per variant), forward only but where a test
says otherwise."""

import pytest
import torch
from gemrec.kernels import KernelOptions, fp8_attention
from kernel_harness import check_fp8, fp8_errors, make_case, offsets_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
    ),
]
LENGTHS = [0, 1, 37, 300, 129, 1000, 64]
POINTERS = KernelOptions(fp8=True, autotune=False, tma=False)
TMA = KernelOptions(fp8=True, autotune=False)


@pytest.fixture(autouse=True)
def descriptor_tiles_first(monkeypatch):
    """Untuned calls run the first tile that fits: with `tma` on, a descriptor (TMA) tile; off, a pointer tile."""
    from gemrec.kernels import triton_attention as kernels

    tiles = sorted(kernels.CONFIGS["fwd_fp8"], key=lambda c: not c.get("TMA"))
    monkeypatch.setitem(kernels.CONFIGS, "fwd_fp8", tiles)
    for kernel in kernels._KERNELS.values():
        monkeypatch.setattr(kernel, "tuned", {})


def check(case, activation, options=POINTERS, backward=False, grad_tol=0.12, **kw):
    got, emulated = fp8_errors(
        case, activation, backend="triton", options=options, dtype=torch.bfloat16, backward=backward, **kw
    )
    check_fp8(got, emulated, grad_tol=grad_tol)


@pytest.mark.parametrize(
    "activation,kw,options",
    [
        ("softmax", {}, POINTERS),
        ("softmax", {}, TMA),
        ("silu", {"causal": True}, POINTERS),
        ("silu", {"causal": True}, TMA),
        ("relu2", {"normalize": "max_len"}, POINTERS),
    ],
    ids=["jfa", "jfa-tma", "gdpa-causal", "gdpa-causal-tma", "gdpa-relu2"],
)
def test_forward(activation, kw, options):
    check(make_case(LENGTHS, LENGTHS, heads=4, dim=128, seed=0, device="cuda"), activation, options, **kw)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_causal_forward_and_bf16_backward(head_dim):
    case = make_case(LENGTHS, LENGTHS, heads=4, dim=head_dim, seed=1, device="cuda")
    check(case, "softmax", backward=True, causal=True)


def test_masks_biases_and_tile_scales():
    case = make_case([300, 1, 700], [300, 1, 700], heads=2, dim=128, bias=True, seed=2, device="cuda")
    case.v[128:256] *= 4096.0  # v tiles 2^12 apart: the accumulator's running scale
    for kw in ({"causal": True, "window": 100}, {"block": 64}):
        check(case, "softmax", **kw)


def test_shared_sides():
    seeds = make_case([32], [300, 1, 1000], heads=4, dim=128, seed=3, device="cuda")
    context = make_case([300, 1, 1000], [64], heads=4, dim=128, seed=4, device="cuda")
    for case in (seeds, context):
        check(case, "softmax")


def test_quantize_kv_matches_the_emulation():
    k = torch.randn(sum(LENGTHS), 4, 128, device="cuda").bfloat16()
    v = torch.randn(sum(LENGTHS), 4, 128, device="cuda").bfloat16() * 100
    off = offsets_of(LENGTHS, "cuda")
    k8, vt8, ks, vs, tiles = fp8_attention.quantize_kv(k, v, off, max(LENGTHS))
    assert k8.dtype == vt8.dtype == torch.float8_e4m3fn
    rows = torch.repeat_interleave(torch.arange(len(LENGTHS), device="cuda"), torch.tensor(LENGTHS, device="cuda"))
    pos = torch.arange(sum(LENGTHS), device="cuda") - off[:-1][rows]
    index = rows * tiles + pos // fp8_attention.SCALE_ROWS
    columns = index * fp8_attention.SCALE_ROWS + pos % fp8_attention.SCALE_ROWS
    want_k = fp8_attention.quantize_tiles_reference(k, off.tolist())
    want_v = fp8_attention.quantize_tiles_reference(v, off.tolist())
    assert torch.equal(k8.float() * ks[index][:, :, None], want_k)
    assert torch.equal(vt8[:, :, columns].float().permute(2, 0, 1) * vs[index][:, :, None], want_v)
