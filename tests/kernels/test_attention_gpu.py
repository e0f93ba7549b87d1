"""GPU checks of the compiled Triton kernels: bf16 against an fp64 reference (relative L2 error < 1e-2)."""

import dataclasses

import pytest
import torch
from gemrec.kernels import KernelOptions, jagged_attention
from kernel_harness import GRADIENTS, make_case, offsets_of, rel_l2, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LENGTHS = [0, 1, 37, 300, 129, 1000, 64]


@pytest.fixture(
    params=[(False, False), (True, False), (False, True), (True, True)],
    ids=["pointers", "tma", "one_launch", "one_launch_tma"],
)
def options(request, monkeypatch) -> KernelOptions:
    """The first candidate tile of each kernel (no autotuning: one compile per specialization keeps this quick),
    through pointer loads or the tensor-descriptor (TMA) candidates, with the backward in separate launches or in one
    (`one_launch`; every problem here is small enough for it)."""
    tma, one_launch = request.param
    tma_first(monkeypatch, tma)
    return KernelOptions(tma=tma, one_launch=one_launch, autotune=False)


def tma_first(monkeypatch, tma: bool) -> None:
    """Every kernel's candidate list with the tensor-descriptor tiles first (`tma`) or last; no tile chosen yet."""
    from gemrec.kernels import triton_attention as kernels

    for table in ("CONFIGS", "LARGE_HEAD_DIM_CONFIGS"):
        configs = getattr(kernels, table)
        monkeypatch.setattr(
            kernels,
            table,
            {kind: sorted(c, key=lambda cfg: cfg.get("TMA", False) != tma) for kind, c in configs.items()},
        )
    for kernel in kernels._KERNELS.values():  # the chosen configs and compiled kernels of the other parameter
        monkeypatch.setattr(kernel, "tuned", {})


def poison_allocator(*shapes):
    """Fill freed allocator blocks of the outputs' sizes with NaN so unwritten elements show up."""
    blocks = [torch.full(s, float("nan"), device="cuda", dtype=torch.float32) for s in shapes]
    blocks += [torch.full(s, float("nan"), device="cuda", dtype=torch.bfloat16) for s in shapes]
    del blocks


def check(
    op,
    q_lens,
    kv_lens,
    options,
    heads=2,
    head_dim=128,
    causal=False,
    activation="silu",
    normalize="kv_len",
    bias=False,
    seed=0,
    **masks,
):
    """bf16 kernels twice (on NaN-poisoned memory) against the fp64 reference on the same bf16-rounded inputs;
    `masks`: window, block, rope_base."""
    case = make_case(
        q_lens,
        kv_lens,
        heads=heads,
        dim=head_dim,
        bias=bias,
        seed=seed,
        device="cuda",
        buckets=(16, 20),
        max_distance=512,
        time_log_base=2.0,
        log_uniform_timestamps=True,
    )
    activation = "softmax" if op == "jfa" else activation
    kw = dict(round_to=torch.bfloat16, causal=causal, normalize=normalize, **masks)
    ref = run(case, activation, backend="reference", dtype=torch.float64, **kw)
    for _ in range(2):
        poison_allocator((case.rows, heads, head_dim), (case.k.shape[0], heads, head_dim), (case.rows, heads))
        got = run(case, activation, backend="triton", dtype=torch.bfloat16, options=options, **kw)
        for name, g, r in zip(GRADIENTS, got, ref):
            assert torch.isfinite(g).all(), f"{name} has unwritten/NaN elements"
            assert rel_l2(g, r) < 1e-2, f"{name}: rel err {rel_l2(g, r):.2e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_self_attention_bf16(op, causal, options):
    check(op, LENGTHS, LENGTHS, options, causal=causal, seed=hash((op, causal)) % 1000)


@pytest.mark.parametrize("head_dim", [32, 64, 256])
def test_head_dims(head_dim, options):
    check("jfa", LENGTHS, LENGTHS, options, head_dim=head_dim, causal=True, seed=head_dim)
    check("gdpa", LENGTHS, LENGTHS, options, head_dim=head_dim, seed=head_dim + 1)


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_biases(op, options):
    check(op, LENGTHS, LENGTHS, options, causal=True, bias=True, seed=7)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "relu2"])
def test_activations(activation, options):
    check("gdpa", LENGTHS, LENGTHS, options, activation=activation, normalize="max_len", seed=11)


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_asymmetric(op, options):
    check(op, [32], [700, 1, 0, 2000, 65], options, seed=3)  # PMA: shared seeds
    check(op, [700, 1, 0, 2000, 65], [16, 64, 5, 33, 17], options, causal=True, seed=4)  # cross-attention, few keys
    check(op, [1, 500, 3], [1000, 17, 3], options, causal=True, bias=True, seed=5)


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_resident_side_kernels(op, options):
    # resident keys with every bias; queries up to 300 rows keep relative positions within the table's 512 (far
    # beyond, every pair of a row lands in the last bucket, whose softmax gradient then cancels to a residual that
    # bf16 cannot resolve)
    check(op, [300, 1, 0, 280, 65], [16, 64, 5, 33, 17], options, bias=True, seed=12)
    check(op, [3000, 5, 0], [100, 128, 7], options, head_dim=64, causal=True, seed=13)  # a 128-row resident key tile
    check(op, [32], [700, 1, 0, 2000, 65], options, head_dim=256, bias=True, seed=14)  # resident seeds, widest head dim
    check(op, [20, 0, 7], [1500, 3, 0], options, causal=True, seed=15)  # resident queries of their own per sequence


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_asymmetric_tiled(op, options):
    options = dataclasses.replace(options, resident=False)  # the same shapes through the tiled kernels
    check(op, [32], [700, 1, 0, 2000, 65], options, seed=3)
    check(op, [700, 1, 0, 2000, 65], [16, 64, 5, 33, 17], options, causal=True, seed=4)


def test_compile_fullgraph_and_flops(options):
    from gemrec.kernels import attention_flops
    from torch.utils.flop_counter import FlopCounterMode

    lens = [5, 300, 77]
    off = offsets_of(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn = torch.compile(
        lambda q, k, v: jagged_attention(q, k, v, off, off, 300, 300, causal=True, options=options), fullgraph=True
    )
    out = fn(q, k, v)
    eager = jagged_attention(q, k, v, off, off, 300, 300, causal=True, options=options)
    assert rel_l2(out.float(), eager) < 1e-3
    with FlopCounterMode(display=False) as counter:
        jagged_attention(q, k, v, off, off, 300, 300, causal=True, options=options).sum().backward()
    fwd, bwd = attention_flops(off, off, 4, 64, causal=True)
    assert counter.get_total_flops() >= fwd + bwd


def _gluon_configs():
    from gemrec.kernels import triton_attention as kernels

    return kernels.GLUON_CONFIGS["fwd"]


@pytest.mark.parametrize("config", _gluon_configs(), ids=lambda c: f"bn{c['BLOCK_N']}s{c['num_stages']}")
@pytest.mark.parametrize(
    "op,causal,activation,head_dim,normalize,window",
    [
        ("jfa", True, None, 128, None, None),
        ("jfa", False, None, 128, None, None),
        ("jfa", True, None, 64, None, None),
        ("jfa", False, None, 64, None, None),
        ("gdpa", True, "silu", 128, "kv_len", None),
        ("gdpa", False, "silu", 64, "none", None),
        ("gdpa", True, "gelu_tanh", 64, "max_len", None),
        ("gdpa", False, "gelu", 128, "kv_len", None),
        ("gdpa", True, "relu2", 128, "none", None),
        ("gdpa", False, "relu", 64, "max_len", None),
        ("jfa", True, None, 128, None, 256),
        ("jfa", False, None, 64, None, 100),
        ("jfa", True, None, 128, None, 5000),  # longer than every sequence
        ("gdpa", True, "silu", 128, "kv_len", 300),
        ("gdpa", False, "relu2", 64, "none", 64),
    ],
)
def test_gluon_forward(config, op, causal, activation, head_dim, normalize, window, options, monkeypatch):
    """Each Gluon forward tile forced as the only candidate (once, in the tma fixture variant); the backward
    checks the softmax forward's logsumexp."""
    from gemrec.kernels import triton_attention as kernels

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels need Hopper (sm_90)")
    if not options.tma or options.one_launch:
        pytest.skip("one fixture variant is enough: the Gluon tile replaces the forward's")
    monkeypatch.setitem(kernels.CONFIGS, "fwd", [config])
    options = dataclasses.replace(options, resident=False)  # short keys through the tiled forward too
    kw = dict(head_dim=head_dim, causal=causal, window=window)
    if op == "gdpa":
        kw.update(activation=activation, normalize=normalize)
    check(op, LENGTHS, LENGTHS, options, seed=21, **kw)
    check(op, [32], [700, 1, 0, 2000, 65], options, seed=22, **kw)  # PMA: shared seeds
    check(op, [700, 1, 0, 2000, 65], [16, 64, 5, 333, 17], options, seed=23, **kw)  # longer queries than keys
    check(op, [3, 129, 1], [1000, 130, 0], options, seed=24, **kw)  # longer keys than queries
    if window:
        check(op, [4100, 2900], [4100, 2900], options, seed=25, **kw)  # many key blocks below the window
    assert {c.get("GLUON") for c in kernels._KERNELS["fwd"].best.values()} == {True}


MASKED = [
    ("jfa", True, dict(window=256)),
    ("jfa", False, dict(window=100, rope_base=10000.0)),
    ("gdpa", True, dict(window=300, rope_base=10000.0)),
    ("jfa", True, dict(block=64, rope_base=10000.0)),  # the block kernels
    ("gdpa", False, dict(block=64)),
    ("jfa", False, dict(block=128, rope_base=500.0)),
    ("jfa", True, dict(block=32, window=20)),  # a block mask of the tiled kernels
    ("jfa", True, dict(rope_base=10000.0)),  # RoPE in the full causal kernels
]
UNTUNED = KernelOptions(autotune=False)  # the GPU's default path, first tiles (pointer loads)


@pytest.mark.parametrize("op,causal,masks", MASKED, ids=lambda x: "-".join(x) if isinstance(x, dict) else str(x))
def test_masks_and_rope_bf16(op, causal, masks):
    check(op, [*LENGTHS, 4100], [*LENGTHS, 4100], UNTUNED, causal=causal, seed=51, **masks)
    check(op, [300, 2000, 5], [700, 2100, 1], UNTUNED, causal=causal, seed=52, **masks)  # longer keys than queries


def _block_tiles() -> list[dict]:
    from gemrec.kernels import triton_attention as kernels

    return kernels.CONFIGS["block_bwd"]


@pytest.mark.parametrize("tile", _block_tiles(), ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_block_kernels_on_every_tile(tile, monkeypatch):
    """Each block-kernel tile the tuner may pick (register-capped ones included) in both directions, with RoPE:
    self-attention with empty and short sequences, longer keys (blocks no query sees) and longer queries."""
    from gemrec.kernels import block_attention
    from gemrec.kernels import triton_attention as kernels

    for kind in block_attention.KERNELS:
        monkeypatch.setitem(kernels.CONFIGS, kind, [tile])
        monkeypatch.setattr(kernels._KERNELS[kind], "tuned", {})
    block = max(64, tile["SUB_M"])
    check("jfa", [*LENGTHS, 4100], [*LENGTHS, 4100], UNTUNED, causal=True, seed=56, block=block, rope_base=1e4)
    check("gdpa", [300, 2000, 5], [700, 2100, 1], UNTUNED, seed=57, block=block, rope_base=1e4)
    check("jfa", [700, 2100, 1], [300, 2000, 5], UNTUNED, causal=True, seed=58, block=block, rope_base=1e4)


def test_rope_through_tensor_descriptors_bf16(monkeypatch):
    # the forward's keys and the dK/dV kernel's queries in half-row boxes, rotated as they load
    tma_first(monkeypatch, True)
    check("jfa", [*LENGTHS, 4100], [*LENGTHS, 4100], UNTUNED, causal=True, seed=59, window=256, rope_base=1e4)
    check("gdpa", [300, 2000, 5], [700, 2100, 1], UNTUNED, seed=60, window=300, rope_base=1e4)


def test_masks_and_rope_with_biases_bf16():
    check("jfa", LENGTHS, LENGTHS, UNTUNED, causal=True, bias=True, seed=53, window=128, rope_base=10000.0)
    check("gdpa", LENGTHS, LENGTHS, UNTUNED, causal=True, bias=True, seed=54, block=64, rope_base=10000.0)


@pytest.mark.parametrize("autotune", [True, False], ids=["tuned", "untuned"])
def test_fp32_at_16k_runs_on_tiles_that_fit(autotune):
    """The local-MFU pass's eager fp32 forward at 16k lengths once crashed: a tile tuned for bf16 was reused for fp32
    (459,776 bytes of shared memory; a Gluon tile that does not compile for fp32). Tiles are tuned per dtype and only
    those that fit the device are offered; untuned, the first that fits runs."""
    options = KernelOptions(autotune=autotune)
    gen = torch.Generator(device="cuda").manual_seed(55)
    lens = [16384, 3000]
    off = offsets_of(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 2, 128, device="cuda", generator=gen) for _ in range(3))
    backward = not autotune  # tuning every backward kernel too would take minutes; the crash was in the forward
    for dtype in (torch.bfloat16, torch.float32):  # bf16 tunes first, as in the training step before the MFU pass
        leaves = [t.to(dtype).requires_grad_(backward) for t in (q, k, v)]
        out = jagged_attention(*leaves, off, off, 16384, 16384, causal=True, options=options)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out)) if backward else []
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    ref = jagged_attention(q.double(), k.double(), v.double(), off, off, 16384, 16384, causal=True, backend="reference")
    assert rel_l2(out, ref) < 1e-2


@pytest.mark.parametrize("name", ["k", "v", "q_offsets", "kv_offsets", "rel_bias position"])
def test_a_tensor_off_q_device_is_refused_by_name(name):
    """The launches pass addresses (the launcher no longer checks each tensor): a CPU tensor beside CUDA ones is refused
    before any launch, naming it."""
    lens = [5, 9]
    off = offsets_of(lens, "cuda")
    q, k, v = (torch.randn(sum(lens), 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    args = {"k": k, "v": v, "q_offsets": off, "kv_offsets": off.clone()}
    table = torch.zeros(2, 8, device="cuda")
    if name == "rel_bias position":
        table = table.cpu()
    else:
        args[name] = args[name].cpu()
    with pytest.raises(ValueError, match=f"{name} must be on q's device"):
        jagged_attention(q, args["k"], args["v"], args["q_offsets"], args["kv_offsets"], 9, 9, rel_bias=table)
