"""The FP8 attention forward (`KernelOptions.fp8`) under the CPU interpreter (TRITON_INTERPRET=1, fp32 carriers on
the e4m3 grid): the k/v quantization bit-exact against the emulation's, the forward and the bf16 backward through
it against exact fp64 within FP8's error (`kernel_harness.FP8_TOL`). Run in a subprocess by
test_attention_interpreter_subprocess.py when this process imported triton without the interpreter."""

import pytest
import torch
from gemrec.kernels import KernelOptions, fp8_attention
from gemrec.kernels import triton_attention as kernels_module
from kernel_harness import check_fp8, fp8_errors, make_case, offsets_of

pytestmark = pytest.mark.skipif(
    not kernels_module.INTERPRET, reason="triton was imported without TRITON_INTERPRET=1 (run in a subprocess)"
)
FP8 = KernelOptions(fp8=True)


def test_quantize_kv_matches_the_emulation():
    lengths = [300, 0, 1, 129]
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(sum(lengths), 2, 24, generator=gen) * torch.logspace(-3, 3, sum(lengths))[:, None, None]
    v = torch.randn(sum(lengths), 2, 24, generator=gen)
    v[300:301] = 0.0  # an all-zero tile: scale 1
    off = offsets_of(lengths)
    k8, vt8, ks, vs, tiles = fp8_attention.quantize_kv(k, v, off, max(lengths))
    assert tiles == 3 and vt8.shape == (2, 24, 4 * 3 * 128)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    pos = torch.arange(sum(lengths)) - off[:-1][rows]
    index = rows * tiles + pos // fp8_attention.SCALE_ROWS
    assert torch.equal(k8 * ks[index][:, :, None], fp8_attention.quantize_tiles_reference(k, off.tolist()))
    columns = index * fp8_attention.SCALE_ROWS + pos % fp8_attention.SCALE_ROWS
    v_got = vt8[:, :, columns].permute(2, 0, 1) * vs[index][:, :, None]
    assert torch.equal(v_got, fp8_attention.quantize_tiles_reference(v, off.tolist()))
    assert vs[2 * tiles].eq(1.0).all()  # sequence 2, whose one row is zero


@pytest.mark.parametrize(
    "activation,kw",
    [
        ("softmax", {}),
        ("softmax", {"causal": True}),
        ("silu", {"causal": True}),
        ("relu2", {"normalize": "max_len"}),
        ("softmax", {"window": 40, "causal": True}),
        ("gelu", {"block": 32}),
    ],
    ids=["jfa", "jfa-causal", "gdpa-silu-causal", "gdpa-relu2", "jfa-window", "gdpa-block"],
)
def test_forward_and_backward_within_fp8_error(activation, kw):
    case = make_case([150, 0, 1, 70], [150, 3, 1, 90], heads=2, dim=16, seed=1)
    check_fp8(*fp8_errors(case, activation, backend="triton", options=FP8, **kw))


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_tiles_of_very_different_scales(activation):
    """v tiles 2^18 apart and q rows spanning 2^4 (query tiles of different scales): the accumulator's running scale
    (softmax: the weights' exponent offset) keeps every tile's contribution."""
    case = make_case([260], [260], heads=2, dim=16, seed=2)
    case.v[128:256] *= 4096.0
    case.v[256:] *= 1 / 64
    case.q *= torch.logspace(-2, 2, 260, base=2.0)[:, None, None]  # scores up to 4x: FP8's error grows with them
    check_fp8(*fp8_errors(case, activation, backend="triton", options=FP8), tol=0.12, grad_tol=0.2)


@pytest.mark.parametrize("tma", [True, False])
def test_descriptor_and_pointer_tiles(tma):
    """Head dim 32 (whole heads): the descriptor tiles read k past a sequence's end from the next one, masked."""
    case = make_case([150, 0, 1, 70], [150, 3, 1, 90], heads=2, dim=32, seed=6)
    options = KernelOptions(fp8=True, tma=tma)
    check_fp8(*fp8_errors(case, "softmax", backend="triton", options=options, causal=True, backward=False))
    check_fp8(*fp8_errors(case, "silu", backend="triton", options=options, backward=False))


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_biases_shared_sides_and_odd_head_dims(activation):
    case = make_case([40, 33, 70], [50, 17, 90], heads=2, dim=24, bias=True, seed=3)
    check_fp8(*fp8_errors(case, activation, backend="triton", options=FP8, causal=True), grad_tol=0.15)
    seeds = make_case([8], [50, 1, 90], heads=2, dim=16, seed=4)  # one query sequence shared (PMA seeds)
    check_fp8(*fp8_errors(seeds, activation, backend="triton", options=FP8))
    context = make_case([50, 1, 90], [40], heads=2, dim=16, seed=5)  # one key sequence shared
    check_fp8(*fp8_errors(context, activation, backend="triton", options=FP8))
