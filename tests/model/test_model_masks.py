"""The sequence tower's attention masks (`seq_attention_mask`: full, window, block) and rotary (`rope`: fused,
separate, none): config rules, the layer against the kernels' reference with the mask spelt out as a bias, the whole
model forward and backward, and the FLOP count of the pairs each mask lets through."""

import dataclasses

import gemrec.kernels.reference as attention_reference
import pytest
import torch
from gemrec.config import ConfigError
from gemrec.kernels import jagged_attention, triton_attention
from gemrec.kernels.reference import rotate_half
from gemrec.model import ModelConfig, build_model, loss, model_flops
from gemrec.model.layers import Rotary
from gemrec.model.synthetic import bench_schema, random_input
from kernel_harness import sees
from torch.utils.flop_counter import FlopCounterMode

SCHEMA = bench_schema(40, 80, 2)
SMALL = dict(embedding_backend="torch", embedding_dim=8, d_model=16, num_heads=2, moe_hidden=16, head_hidden=16)
MASKS = {"full": {}, "window": {"seq_window": 3}, "block": {"seq_block": 4}}
LENGTHS = [11, 0, 1, 7, 16, 4]


def config(mask="full", rope="separate", **overrides) -> ModelConfig:
    return ModelConfig(**{**SMALL, "seq_attention_mask": mask, **MASKS[mask], "rope": rope, **overrides})


def build(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(cfg, SCHEMA)


# -- config -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"seq_attention_mask": "window"},
            "model.seq_window = None: seq_attention_mask = 'window' needs model.seq_window",
        ),
        ({"seq_attention_mask": "block"}, "model.seq_block = None: seq_attention_mask = 'block' needs model.seq_block"),
        ({"seq_window": 0}, r"model.seq_window = 0: must be >= 1 \(or unset\)"),
        ({"seq_attention_mask": "block", "seq_block": -64}, "model.seq_block = -64: must be >= 1"),
        ({"seq_attention_mask": "sliding"}, "model.seq_attention_mask = 'sliding': must be one of 'full', 'window'"),
        ({"rope": "fused", "d_model": 18}, r"model.d_model = 18: rotary positions \(rope = 'fused'\) need an even"),
        ({"rope": "rotary"}, "model.rope = 'rotary': must be one of 'fused', 'separate', 'none'"),
        ({"rotary_base": 0.0}, "model.rotary_base = 0.0: must be > 0"),
    ],
)
def test_bad_mask_and_rope_settings_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**SMALL, **overrides})


def test_the_older_rotary_switch_reads_as_rope_and_contradictions_are_refused():
    assert ModelConfig.from_dict({}).rope == "separate"  # today's default: the model's separate rotary
    assert ModelConfig.from_dict({"rotary": True}).rope == "separate"
    assert ModelConfig.from_dict({"rotary": False}).rope == "none"
    assert ModelConfig.from_dict({"rotary": True, "rope": "fused"}).rope == "fused"
    with pytest.raises(ConfigError, match="model.rotary = false contradicts model.rope = 'fused'"):
        ModelConfig.from_dict({"rotary": False, "rope": "fused"})
    with pytest.raises(ConfigError, match="model.rotary = true contradicts model.rope = 'none'"):
        ModelConfig.from_dict({"rotary": True, "rope": "none"})
    with pytest.raises(ConfigError, match="model.rotary = 'yes': must be true or false"):
        ModelConfig.from_dict({"rotary": "yes"})
    # A sizes' mask reads only its own size: a recipe carries both and switches with one key.
    both = ModelConfig(seq_window=8, seq_block=64)
    assert both.seq_mask == (None, None)
    assert dataclasses.replace(both, seq_attention_mask="window").seq_mask == (8, None)
    assert dataclasses.replace(both, seq_attention_mask="block").seq_mask == (None, 64)


def test_recipes_check_the_separate_rotary_tables_only():
    from gemrec.components.trainer.config import load_recipe

    with pytest.raises(ConfigError, match="exceeds model.rotary_max_positions = 32768 .*model.rope = 'fused'"):
        load_recipe("tiny", ["data.max_seq_len=40000"])
    assert load_recipe("tiny", ["data.max_seq_len=40000", "model.rope=fused"]).model.fused_rope_base == 10000.0
    assert load_recipe("tiny", ["model.rotary=false"]).model.rope == "none"  # `--set` spells it the old way too
    with pytest.raises(ConfigError, match="model.rotary = false contradicts model.rope = 'separate'"):
        load_recipe("tiny", ["model.rotary=false", "model.rope=separate"])


# -- the layer against the kernels' reference ------------------------------------------------------------------


def spelt_out(lengths: list[int], heads: int, causal: bool, window, block) -> torch.Tensor:
    """The mask as an additive bias (rows, heads, max_len): 0 where a token sees a key, -1e4 elsewhere (softmax
    weight and SiLU both underflow to exactly 0 there)."""
    longest = max(lengths)
    rows = []
    for n in lengths:
        for p in range(n):
            rows.append([0.0 if j < n and sees(p, j, causal, window, block) else -1e4 for j in range(longest)])
    return torch.tensor(rows)[:, None, :].expand(-1, heads, -1).contiguous()


@pytest.mark.parametrize("mask", ["full", "window", "block"])
@pytest.mark.parametrize("rope", ["fused", "separate", "none"])
@pytest.mark.parametrize("kind, causal", [("softmax", True), ("silu", False)])
def test_sequence_layer_attention_is_the_reference_with_the_mask_spelt_out(mask, rope, kind, causal):
    cfg = config(mask, rope, seq_attention=kind, seq_causal=causal)
    model = build(cfg)
    attn = model.seq_tower[0].attn
    lengths, heads, hd = LENGTHS, cfg.num_heads, cfg.d_model // cfg.num_heads
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = torch.cat([torch.arange(n) for n in lengths])
    x = torch.randn(sum(lengths), cfg.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    tables = Rotary(hd, cfg.rotary_base, 32)(positions, max(lengths))
    got = attn(x, x, offsets, offsets, max(lengths), max(lengths), tables if rope == "separate" else None)
    grads = torch.autograd.grad(got.square().sum(), [x, attn.wq.weight, attn.wkv.weight])

    # The oracle: no mask or rotary keywords; q and k rotated here when any rotary is on, the mask as a bias.
    q = (x @ attn.wq.weight.t() + attn.wq.bias).view(-1, heads, hd)
    k, v = (x @ attn.wkv.weight.t() + attn.wkv.bias).view(-1, 2, heads, hd).unbind(1)
    if rope != "none":
        cos, sin = tables
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
    window, block = cfg.seq_mask
    bias = spelt_out(lengths, heads, causal, window, block)
    args = (q, k, v, offsets, offsets, max(lengths), max(lengths))
    if kind == "softmax":
        out = jagged_attention(*args, causal=causal, attn_bias=bias, backend="reference")
    else:
        from gemrec.kernels import gdpa

        out = gdpa(*args, causal=causal, attn_bias=bias, activation="silu", normalize="kv_len", backend="reference")
    want = attn.wo(out.reshape(-1, cfg.d_model))
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), [x, attn.wq.weight, attn.wkv.weight])):
        torch.testing.assert_close(g, w)
    if mask != "full":  # the mask cuts: without it the layer computes something else
        free = build(config("full", rope, seq_attention=kind, seq_causal=causal)).seq_tower[0].attn
        free.load_state_dict(attn.state_dict())
        separate = tables if rope == "separate" else None
        assert not torch.allclose(got, free(x, x, offsets, offsets, max(lengths), max(lengths), separate))


# -- the whole model -------------------------------------------------------------------------------------------


def forward_backward(model, inp):
    model.zero_grad(set_to_none=True)
    out = model(inp)
    loss(out, torch.ones_like(out.logits)).backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mask", ["full", "window", "block"])
@pytest.mark.parametrize("rope", ["fused", "separate", "none"])
def test_model_forward_and_backward_for_every_mask_and_rope(mask, rope):
    model = build(config(mask, rope))
    assert model.rotary is None or rope == "separate"
    for layer in model.seq_tower:
        assert (layer.attn.window, layer.attn.block) == model.config.seq_mask
        assert layer.attn.rope_base == (10000.0 if rope == "fused" else None)
    for name, module in model.named_modules():  # PMA, cross- and token attention stay unmasked, unrotated
        if hasattr(module, "window") and not name.startswith("seq_tower"):
            assert (module.window, module.block, module.rope_base) == (None, None, None), name
    logits, grads = forward_backward(model, random_input(SCHEMA, len(LENGTHS), 16, lengths=LENGTHS, seed=3))
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
    assert grads["seq_tower.0.attn.wq.weight"].abs().sum() > 0


def test_masks_that_cover_every_history_and_fused_rope_are_bit_identical_to_today():
    """Defaults are today's model (full attention, separate rotary: no mask or rope keyword reaches the kernels); a
    window or block at least as long as every history, and the fused rotary on the reference path, change nothing."""
    inp = random_input(SCHEMA, len(LENGTHS), 16, lengths=LENGTHS, seed=4)
    today = build(ModelConfig(**SMALL))
    assert [(a.attn.window, a.attn.block, a.attn.rope_base) for a in today.seq_tower] == [(None, None, None)] * 2
    logits, grads = forward_backward(today, inp)
    for mask, sizes in (("window", {"seq_window": 16}), ("block", {"seq_block": 16})):
        same_logits, same_grads = forward_backward(build(config(mask, **sizes)), inp)
        assert torch.equal(same_logits, logits), mask
        assert all(torch.equal(same_grads[n], g) for n, g in grads.items()), mask
    fused_logits, fused_grads = forward_backward(build(config("full", "fused")), inp)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-5, atol=1e-6)


# -- FLOPs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask, causal", [("window", False), ("block", False), ("window", True), ("block", True)])
def test_flops_count_only_the_pairs_each_mask_lets_through(monkeypatch, mask, causal):
    """FlopCounterMode on the reference path (exact-length groups) counts every (query, key) pair of each sequence;
    the model counts the pairs its mask lets through. They differ in the sequence layers by exactly the pairs a
    brute-force walk over the API's rule leaves out, 4 FLOPs per pair, head and head dim forward (8 backward)."""
    monkeypatch.setattr(attention_reference, "MAX_PADDING", 0.0)
    lengths = [40, 0, 1, 7, 33, 12, 19, 3]  # more than MAX_PADDING apart: the reference does the jagged work only
    cfg = config(mask, "fused", seq_causal=causal, time_encoding="continuous", seq_window=5, seq_block=8)
    model = build(cfg)
    inp = random_input(SCHEMA, len(lengths), 40, lengths=lengths, seed=5)
    counter = FlopCounterMode(display=False, depth=None)
    with counter:
        out = model(inp)
        forward = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        loss(out, torch.zeros_like(out.logits)).backward()
    total = counter.get_total_flops()
    counted = model_flops(model, inp)
    window, block = cfg.seq_mask
    seen = sum(sees(p, j, causal, window, block) for n in lengths for p in range(n) for j in range(n))
    computed = sum(n * n for n in lengths)  # what the reference multiplies, masked or not
    assert 0 < seen < computed
    per_pair = 4 * cfg.d_model  # 2 matmuls x 2 FLOPs, over heads x head dim = d_model
    for i in range(cfg.seq_layers):
        name = f"seq_tower.{i}"
        assert counted[name][0] == pytest.approx(forward[f"GEMModel.{name}"] - per_pair * (computed - seen), rel=1e-3)
    others = {n: f for n, (f, _) in counted.items() if not n.startswith("seq_tower")}
    for name, fwd in others.items():
        assert fwd == pytest.approx(forward.get(f"GEMModel.{name}", 0), rel=0.01), name
    skipped = cfg.seq_layers * 3 * per_pair * (computed - seen)  # forward 4, backward 8 FLOPs per pair and unit
    assert sum(f + b for f, b in counted.values()) == pytest.approx(total - skipped, rel=0.01)


# -- the Triton path -------------------------------------------------------------------------------------------


@pytest.mark.skipif(not triton_attention.INTERPRET, reason="runs in the interpreter (the subprocess test below)")
def test_sequence_tower_on_the_triton_kernels_matches_the_reference():
    """fp32 in triton's interpreter: the masks and the fused rotary reach the Triton kernels, forward and backward."""
    inp = random_input(SCHEMA, 4, 20, lengths=[20, 0, 1, 9], seed=6)
    for mask in MASKS:
        for rope in ("fused", "separate", "none"):
            model = build(config(mask, rope, seq_block=8, d_model=32))
            want = forward_backward(model, inp)
            for layer in model.seq_tower:
                layer.attn.backend = "triton"
            got = forward_backward(model, inp)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
            for name, grad in want[1].items():
                torch.testing.assert_close(got[1][name], grad, rtol=1e-3, atol=1e-5, msg=f"{mask} {rope} {name}")
        # Compiled in one graph: the custom ops' fake impls take the masks and the rotary base.
        attn = build(config(mask, "fused", seq_block=8, d_model=32)).seq_tower[0].attn
        attn.backend = "triton"
        offsets, x = inp.seq_offsets, torch.randn(inp.num_tokens, 32, requires_grad=True)
        eager = attn(x, x, offsets, offsets, 20, 20)
        compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)(x, x, offsets, offsets, 20, 20)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*(torch.autograd.grad(y.square().sum(), x)[0] for y in (compiled, eager)))


@pytest.mark.skipif(triton_attention.INTERPRET, reason="the interpreter is active here: the test above ran")
def test_sequence_tower_on_the_triton_kernels_in_a_subprocess():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    here = Path(__file__)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(here.parent.parent.parent)]
        + [f"{here}::test_sequence_tower_on_the_triton_kernels_matches_the_reference"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mask", ["full", "window", "block"])
@pytest.mark.parametrize("rope", ["fused", "separate"])
def test_long_histories_on_the_gpu_match_the_reference(mask, rope):
    """bf16 on the Triton kernels (block 64: the dedicated block kernel) against the reference, histories to 2,000."""
    cfg = config(mask, rope, d_model=256, num_heads=2, seq_window=128, seq_block=64)
    model = build(cfg).cuda()
    inp = random_input(SCHEMA, 4, 2000, lengths=[2000, 0, 1, 700], seed=7).to("cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fast = model(inp).logits.double()
        for layer in model.seq_tower:
            layer.attn.backend = "reference"
        ref = model(inp).logits.double()
    assert (fast - ref).norm() / ref.norm() < 2e-2
