"""The Triton kernels compile for Hopper (sm_90) without a GPU: every kernel a call launches, with the arguments
the real call builds, goes through triton.compile down to a cubin with the bundled ptxas. Catches what the CPU
interpreter cannot: type errors in lowering, constexpr misuse, inline PTX (tanh.approx), shared-memory limits."""

import functools

import pytest
import torch
from gemrec.kernels import KernelOptions, RelativeBias, gdpa, jagged_attention
from gemrec.kernels import triton_attention as kernels
from kernel_harness import offsets_of

pytestmark = pytest.mark.skipif(kernels.INTERPRET, reason="needs triton's compiler, not its interpreter")

SHARED_MEMORY_LIMIT = 232448  # bytes per block on an H100/H200
DEFAULT = KernelOptions()


def tensors(rows, heads, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, heads, dim, generator=gen).to(dtype).requires_grad_() for _ in range(3)]


def jfa_causal_fused_dq(options=DEFAULT):  # long keys: dQ folded into the dK/dV kernel
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    jagged_attention(q, k, v, off, off, 700, 700, causal=True, backend="triton", options=options).sum().backward()


def gdpa_cross_short_keys_fp16(options=DEFAULT):  # long queries over a few keys: the separate dQ kernel
    q = tensors(900, 4, 64, torch.float16)[0]
    k, v = tensors(60, 4, 64, torch.float16, seed=1)[1:]
    q_off, kv_off = offsets_of([400, 500]), offsets_of([20, 40])
    gdpa(q, k, v, q_off, kv_off, 500, 40, activation="gelu_tanh", backend="triton", options=options).sum().backward()


def jfa_with_biases_head_dim_256(options=DEFAULT):
    q, k, v = tensors(300, 2, 256, torch.bfloat16)
    off = offsets_of([100, 200])
    rel = RelativeBias(
        position=torch.zeros(2, 32, requires_grad=True),
        time=torch.zeros(2, 16, requires_grad=True),
        q_timestamps=torch.arange(300),
        kv_timestamps=torch.arange(300),
    )
    jagged_attention(
        q, k, v, off, off, 200, 200, causal=True, rel_bias=rel, backend="triton", options=options
    ).sum().backward()


def pma_shared_seeds_with_attn_bias(options=DEFAULT):
    q = tensors(16, 2, 64, torch.bfloat16)[0]
    k, v = tensors(500, 2, 64, torch.bfloat16, seed=2)[1:]
    bias = torch.zeros(3 * 16, 2, 300, requires_grad=True)
    gdpa(
        q,
        k,
        v,
        offsets_of([16]),
        offsets_of([100, 100, 300]),
        16,
        300,
        activation="relu2",
        attn_bias=bias,
        normalize="max_len",
        backend="triton",
        options=options,
    ).sum().backward()


RESIDENT_OFF = KernelOptions(resident=False)
ONE_LAUNCH = KernelOptions(one_launch=True, resident=False)


@pytest.mark.parametrize(
    "call,options,kinds",
    [
        (jfa_causal_fused_dq, DEFAULT, ["fwd", "delta", "dkdv"]),
        (gdpa_cross_short_keys_fp16, DEFAULT, ["fwd_rkv", "bwd_rkv"]),  # keys resident: the whole backward in one
        (gdpa_cross_short_keys_fp16, RESIDENT_OFF, ["fwd", "dkdv", "dq"]),
        (jfa_with_biases_head_dim_256, DEFAULT, ["fwd", "delta", "dkdv", "dq"]),
        (pma_shared_seeds_with_attn_bias, DEFAULT, ["fwd", "bwd_rq"]),  # seeds resident
        (pma_shared_seeds_with_attn_bias, RESIDENT_OFF, ["fwd", "dkdv", "dq"]),
        (jfa_causal_fused_dq, ONE_LAUNCH, ["fwd", "bwd1"]),  # the whole fwd+bwd in two launches, biases included
        (gdpa_cross_short_keys_fp16, ONE_LAUNCH, ["fwd", "bwd1"]),
        (pma_shared_seeds_with_attn_bias, ONE_LAUNCH, ["fwd", "bwd1"]),
    ],
    ids=lambda x: (
        x.__name__
        if callable(x)
        else ("-".join(f"{k}={v}" for k, v in x.to_dict().items() if v != getattr(DEFAULT, k)) or "default")
        if isinstance(x, KernelOptions)
        else None
    ),
)
def test_every_launched_kernel_compiles_for_sm90(call, options, kinds):
    from gemrec.kernels.aot import compile_launch, record_launches

    launches = record_launches(functools.partial(call, options))
    assert [launch.kind for launch in launches] == kinds
    for launch in launches:
        # the default tile, and the first tensor-descriptor (TMA) candidate where the layout allows one
        tma = [c for c in launch.candidates() if c.get("TMA")][:1]
        assert bool(tma) == (launch.kind != "delta"), launch.kind  # every test tensor here is TMA-aligned
        for config in [launch.candidates()[0], *tma]:
            compiled = compile_launch(launch, config)
            assert compiled.asm["cubin"], (launch.kind, config)
            assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, (launch.kind, config, compiled.metadata.shared)


def test_launches_are_restored_and_resources_read():
    from gemrec.kernels.aot import compile_launch, record_launches, resource_usage, sass_counts

    launches = record_launches(jfa_causal_fused_dq)
    assert kernels._Kernel.__call__.__name__ == "__call__"  # the real launcher is back
    compiled = compile_launch(launches[0])
    usage = resource_usage(compiled)
    assert 16 <= usage["registers"] <= 255 and usage["stack_bytes"] >= 0 and usage["shared_bytes"] > 0
    sass = sass_counts(compiled)  # the softmax forward: exp2 on the MUFU unit, fp32 math, addresses
    assert (
        sass["total"] > sass["fp32"] + sass["int"] + sass["mufu"] and min(sass["fp32"], sass["int"], sass["mufu"]) > 0
    )


def test_launch_specialized_like_the_gpu_launcher():
    # 16-byte aligned pointers and strides divisible by 16, as triton's launcher marks them on a GPU: the tiles
    # stream through cp.async (LDGSTS), not scalar loads; without it every head-dim-128 tile used to spill
    from gemrec.kernels.aot import _cuobjdump, compile_launch, record_launches, resource_usage

    compiled = compile_launch(record_launches(jfa_causal_fused_dq)[0])
    assert "LDGSTS" in _cuobjdump(compiled, "--dump-sass")
    assert resource_usage(compiled)["stack_bytes"] == 0


def gdpa_causal_silu():
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    gdpa(q, k, v, off, off, 700, 700, causal=True, backend="triton")


def jfa_causal_window():
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    jagged_attention(q, k, v, off, off, 700, 700, causal=True, window=256, backend="triton").sum().backward()


def gdpa_window_relu2_head_dim_64():
    q, k, v = tensors(1000, 2, 64, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    gdpa(q, k, v, off, off, 700, 700, window=100, activation="relu2", backend="triton").sum().backward()


@pytest.mark.parametrize(
    "call",
    [gdpa_causal_silu, jfa_causal_fused_dq, jfa_causal_window, gdpa_window_relu2_head_dim_64],
    ids=lambda f: f.__name__,
)
def test_gluon_forward_compiles_for_sm90_with_async_wgmma(call):
    from gemrec.kernels.aot import _cuobjdump, compile_launch, record_launches, resource_usage

    launch = record_launches(call)[0]
    gluon = [c for c in launch.candidates() if c.get("GLUON")]
    assert gluon == kernels.GLUON_CONFIGS["fwd"]
    for config in gluon:
        compiled = compile_launch(launch, config)
        usage = resource_usage(compiled)
        assert usage["stack_bytes"] == 0 and usage["shared_bytes"] <= SHARED_MEMORY_LIMIT, (config, usage)
        sass = _cuobjdump(compiled, "--dump-sass")
        # one wait per product (QK^T, PV), not one per 16-deep k-step, as ptxas does when registers run short
        assert 2 * sass.count("WARPGROUP.DEPBAR") < sass.count("HGMMA."), config


@pytest.mark.parametrize(
    "change",
    [
        {"HAS_AB": True},
        {"HAS_POS": True},
        {"HAS_TIME": True},
        {"HEAD_DIM": 96},
        {"HEAD_DIM": 256},
        {"FAST": False},
        {"dtype": torch.float32},
        {"tma": False},
        {"options": KernelOptions(gluon=False)},
        {"kind": "dkdv"},
        {"MASK_BLOCK": 64},
        {"ROPE": True},
    ],
)
def test_gluon_candidates_only_where_covered(change):
    consts = {
        "MODE": 0,
        "HAS_AB": False,
        "HAS_POS": False,
        "HAS_TIME": False,
        "HEAD_DIM": 128,
        "FAST": True,
        "WINDOW": 1024,
    }
    args = {"kind": "fwd", "dtype": torch.bfloat16, "tma": True, "options": DEFAULT}
    assert kernels.gluon_candidates(consts=consts, **args) == kernels.GLUON_CONFIGS["fwd"]
    args.update({k: change.pop(k) for k in list(change) if k in args})
    assert kernels.gluon_candidates(consts={**consts, **change}, **args) == []


def gdpa_block64_rope_with_position_bias(options=DEFAULT):  # the block kernels, RoPE and a bucket table
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    table = torch.zeros(2, 16, requires_grad=True)
    gdpa(q, k, v, off, off, 700, 700, block=64, rope_base=1e4, rel_bias=table, backend="triton").sum().backward()


def jfa_window_rope_fused_dq(options=DEFAULT):  # dQ added up rotated by the dK/dV kernel, rotated back after
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    jagged_attention(
        q, k, v, off, off, 700, 700, causal=True, window=256, rope_base=1e4, backend="triton", options=options
    ).sum().backward()


def jfa_causal_fp32(options=DEFAULT):  # the local-MFU pass's dtype: every tile twice the bytes of bf16's
    q, k, v = tensors(1000, 2, 128, torch.float32)
    off = offsets_of([300, 0, 700])
    jagged_attention(q, k, v, off, off, 700, 700, causal=True, backend="triton", options=options).sum().backward()


@pytest.mark.parametrize(
    "call,kinds",
    [
        (gdpa_block64_rope_with_position_bias, ["block_fwd", "block_bwd"]),
        (jfa_window_rope_fused_dq, ["fwd", "delta", "dkdv", "rope_dq"]),
        (jfa_causal_fp32, ["fwd", "delta", "dkdv"]),
    ],
    ids=lambda x: x.__name__ if callable(x) else None,
)
def test_masks_rope_and_fp32_run_on_a_tile_that_fits(call, kinds):
    """What runs untuned (`first_fitting`: candidates in order, compiled, until one fits the device) compiles for
    sm_90 within its shared memory; with RoPE, tensor-descriptor tiles only where the rotated side loads in halves
    (forward, dK/dV), and the first of them compiles too."""
    from gemrec.kernels.aot import compile_launch, record_launches

    launches = record_launches(call)
    assert [launch.kind for launch in launches] == kinds
    for launch in launches:
        candidates = launch.candidates()
        tma = [c for c in candidates if c.get("TMA")]
        assert candidates and (not launch.consts.get("ROPE") or bool(tma) == (launch.kind in ("fwd", "dkdv")))
        if launch.consts.get("ROPE") and tma:
            assert compile_launch(launch, tma[0]).metadata.shared <= SHARED_MEMORY_LIMIT
        compiled = {}

        def shared(config, launch=launch, compiled=compiled):
            compiled[kernels._config_name(config)] = compile_launch(launch, config)
            return compiled[kernels._config_name(config)].metadata.shared

        config = kernels.first_fitting(launch.kind, candidates, shared, SHARED_MEMORY_LIMIT, "sm_90")
        assert compiled[kernels._config_name(config)].asm["cubin"], launch.kind


def jfa_block64_rope(options=DEFAULT):
    q, k, v = tensors(1000, 2, 128, torch.bfloat16)
    off = offsets_of([300, 0, 700])
    jagged_attention(
        q, k, v, off, off, 700, 700, causal=True, block=64, rope_base=1e4, backend="triton"
    ).sum().backward()


def test_block_backward_offers_a_tile_of_two_programs_per_sm():
    # a memory-bound kernel that loads, computes, then stores: a second program per SM overlaps one's loads with the
    # other's math; 8 warps of at most 128 registers (and the shared memory of two) allow it, without spills
    from gemrec.kernels.aot import compile_launch, record_launches, resource_usage

    launch = record_launches(jfa_block64_rope)[1]
    capped = [c for c in launch.candidates() if c.get("maxnreg") == 128 and c["num_warps"] == 8]
    assert launch.kind == "block_bwd" and capped
    usage = resource_usage(compile_launch(launch, capped[0]))
    assert usage["registers"] <= 128 and usage["stack_bytes"] == 0 and 2 * usage["shared_bytes"] <= SHARED_MEMORY_LIMIT


def test_only_tiles_that_fit_the_dtype_are_offered():
    # the issue's crash: A's 128x128 forward tile, tuned for bf16, needs 459,776 bytes in fp32
    consts = {"HEAD_DIM": 128, "BLOCK_D": 128}
    issue_tile = kernels._cfg(128, 128, 8, 3, True)
    assert kernels.shared_estimate("fwd", issue_tile, consts, 4) > SHARED_MEMORY_LIMIT
    assert issue_tile in kernels._candidates("fwd", consts, torch.bfloat16, True, SHARED_MEMORY_LIMIT)
    assert issue_tile not in kernels._candidates("fwd", consts, torch.float32, True, SHARED_MEMORY_LIMIT)
    # every kernel keeps tiles for every dtype the API takes and every head dim, and fp32 keeps a subset of bf16's
    for kind in kernels.CONFIGS:
        for head_dim in (16, 64, 128, 256):
            block_d = max(16, head_dim)
            resident = kernels.RESIDENT_MAX_TILE // block_d  # the resident side's rows where those kernels run
            consts = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": resident, "BLOCK_N": resident}
            consts["MASK_BLOCK"] = 64
            offered = {
                dtype: kernels._candidates(kind, consts, dtype, True, SHARED_MEMORY_LIMIT)
                for dtype in (torch.float32, torch.float16, torch.bfloat16)
            }
            assert all(offered.values()), (kind, head_dim, {d: len(c) for d, c in offered.items()})
            assert all(c in offered[torch.bfloat16] for c in offered[torch.float32]), (kind, head_dim)


def fp8_forward(op: str):
    def call(options=DEFAULT):
        q, k, v = tensors(1000, 2, 128, torch.bfloat16)
        off = offsets_of([300, 0, 700])
        fn = jagged_attention if op == "jfa" else gdpa
        fn(q, k, v, off, off, 700, 700, causal=True, backend="triton", options=KernelOptions(fp8=True)).sum().backward()

    return call


@pytest.mark.parametrize("op", ["jfa", "gdpa"])
def test_fp8_forward_compiles_for_sm90_on_fp8_tensor_cores(op):
    """`KernelOptions.fp8`: the k/v quantization and every FP8 forward tile compile, the products on FP8 wgmma
    (QGMMA); the backward is the bf16 kernels'."""
    from gemrec.kernels.aot import _cuobjdump, compile_launch, record_launches, resource_usage

    launches = record_launches(fp8_forward(op))
    assert [launch.kind for launch in launches] == ["fp8_kv", "fwd_fp8", *(["delta"] if op == "jfa" else []), "dkdv"]
    quantize, forward = launches[:2]
    assert resource_usage(compile_launch(quantize))["stack_bytes"] == 0
    for config in forward.candidates():
        compiled = compile_launch(forward, config)
        assert compiled.metadata.shared <= SHARED_MEMORY_LIMIT, config
        assert resource_usage(compiled)["stack_bytes"] <= 64, config  # a few registers' spill at most
        assert _cuobjdump(compiled, "--dump-sass").count("QGMMA") >= 2, config
