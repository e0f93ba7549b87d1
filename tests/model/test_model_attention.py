"""The model's attention layers call the kernels' ops: compared against the one reference (`gemrec.kernels.reference`),
whose own semantics tests/kernels/test_attention_reference.py checks."""

import pytest
import torch
from gemrec.kernels import KernelOptions
from gemrec.kernels import triton_attention as kernels
from gemrec.kernels.reference import attention_reference
from gemrec.model import FeatureSchema, ModelConfig, build_model, loss
from gemrec.model.layers import PMA, Jagged, JaggedAttention
from gemrec.model.synthetic import random_input


def offsets_of(lengths):
    return torch.tensor(Jagged(lengths).offsets)


def projected_reference(layer: JaggedAttention, xq, xkv, q_offsets, kv_offsets, max_q, max_kv):
    """The layer's projections by hand around the reference: softmax, or SiLU normalised by the key count."""
    heads, hd = layer.heads, layer.dim // layer.heads
    q = layer.wq(xq).view(-1, heads, hd)
    k, v = layer.wkv(xkv).view(-1, 2, heads, hd).unbind(1)
    kind = dict(activation="softmax") if layer.kind == "softmax" else dict(activation="silu", normalize="kv_len")
    out = attention_reference(q, k, v, q_offsets, kv_offsets, max_q, max_kv, causal=layer.causal, **kind)
    return layer.wo(out.reshape(-1, layer.dim))


@pytest.mark.parametrize("kind", ["softmax", "silu"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_and_cross_attention_match_the_reference(kind, causal):
    torch.manual_seed(0)
    layer = JaggedAttention(16, 2, kind, causal).double()
    lengths, kv_lengths = [5, 0, 1, 17, 9], [3, 4, 0, 20, 1]
    x = torch.randn(sum(lengths), 16, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(sum(kv_lengths), 16, dtype=torch.float64)
    off, kv_off = offsets_of(lengths), offsets_of(kv_lengths)
    got = layer(x, x, off, off, 17, 17)
    torch.testing.assert_close(got, projected_reference(layer, x, x, off, off, 17, 17))
    grad = torch.autograd.grad(got.sum(), x)[0]
    want = torch.autograd.grad(projected_reference(layer, x, x, off, off, 17, 17).sum(), x)[0]
    torch.testing.assert_close(grad, want)
    got = layer(x, kv, off, kv_off, 17, 20)
    torch.testing.assert_close(got, projected_reference(layer, x, kv, off, kv_off, 17, 20))


def test_pma_seeds_are_shared_by_every_sequence():
    torch.manual_seed(1)
    pma = PMA(16, 2, 32, 3, "softmax", 0.02).double()
    lengths = [4, 0, 9]
    seq = torch.randn(sum(lengths), 16, dtype=torch.float64)
    out = pma(seq, offsets_of(lengths), 9, 3)
    attn = projected_reference(
        pma.attn, pma.seeds, pma.norm_kv(seq), torch.tensor([0, 3]), offsets_of(lengths), 3, 9
    ).view(3, 3, 16)
    x = pma.seeds + attn
    torch.testing.assert_close(out, x + pma.mlp(pma.norm_out(x)))


def test_bad_kind_is_named():
    with pytest.raises(ValueError, match="attention kind must be 'softmax' or 'silu'"):
        JaggedAttention(16, 2, "relu")


@pytest.mark.skipif(kernels.INTERPRET, reason="records launches through triton's compiler path")
def test_kernel_options_reach_every_attention_launch():
    """build_model's kernel_options go to every attention call's kernels, forward and backward (launches recorded on
    the CPU, not executed: the outputs are garbage)."""
    from gemrec.kernels.aot import record_launches

    schema = FeatureSchema.from_manifest(
        {
            "labels": ["like"],
            "actions": ["like"],
            "sparse_features": [
                {"name": "user_id", "num_embeddings": 10},
                {"name": "item_id", "source": "item", "num_embeddings": 20},
            ],
            "seq_item_features": [],
            "dense_features": [],
        }
    )
    options = KernelOptions(resident=False, tma=False, autotune=False)
    config = ModelConfig(embedding_backend="torch", d_model=32, num_heads=2, embedding_dim=8, moe_every=0)
    model = build_model(config, schema, kernel_options=options)
    layers = [m for m in model.modules() if isinstance(m, JaggedAttention)]
    for layer in layers:
        layer.backend = "triton"  # the kernels' launch path on CPU tensors
    inp = random_input(schema, 3, 9, seed=1)
    launches = record_launches(lambda: loss(model(inp), torch.ones(3, 1)).backward())
    assert {launch.options for launch in launches} == {options}
    assert sum(launch.kind == "fwd" for launch in launches) == len(layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["softmax", "silu"])
def test_triton_and_reference_backends_agree_on_gpu(kind):
    torch.manual_seed(2)
    layer = JaggedAttention(128, 2, kind, causal=True).cuda()
    lengths = [0, 1, 70, 300]
    x = torch.randn(sum(lengths), 128, device="cuda")
    off = offsets_of(lengths).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = layer(x, x, off, off, 300, 300).double()
        layer.backend = "reference"
        ref = layer(x, x, off, off, 300, 300).double()
    assert (fast - ref).norm() / ref.norm() < 1e-2
