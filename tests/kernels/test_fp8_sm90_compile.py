"""The FP8 kernels compiled for Hopper (sm_90) without a GPU, as triton's launcher specializes them on one: a weight
gradient's reduction over an arbitrary token count streams its whole 128-deep blocks through cp.async; a GEMM with a
weight's tile scales loads one scale per K block and scales with one multiply-add a value, unspilled; quantization
at an arbitrary token count loads and stores 16 bytes at a time (the transposed copy too), unspilled, with no fp32
copy of its fp8 values."""

import re

import pytest
import torch
import triton
from gemrec.kernels import fp8
from gemrec.kernels.triton_attention import INTERPRET

pytestmark = pytest.mark.skipif(INTERPRET, reason="needs triton's compiler, not its interpreter")

CONSTS = {"HAS_BIAS": False, "GROUP_M": False, "GROUP_K": False, "TILE_B": False}
CONSTS |= {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}


def weight_gradient_sass(tokens: int) -> str:
    """SASS of `_gemm_kernel` for dW (1024 x 4096) = dY^T X over `tokens`, its operands allocated as `quantize`'s
    "qt"."""
    from gemrec.kernels.aot import _cuobjdump, compile_jit

    a, b = (fp8.aligned_rows((n, tokens), "cpu", torch.float8_e4m3fn) for n in (1024, 4096))
    c = torch.empty(1024, 4096)
    sa, sb = (torch.empty(-(-tokens // 128), n).mT for n in (1024, 4096))
    dummy = torch.empty(1, dtype=torch.int32)
    args = [a, b, c, sa, sb, dummy, dummy, dummy, 1024, 4096, tokens, *a.stride(), 0, *b.stride(), 0, *c.stride()]
    args += [*sa.stride(), 0, *sb.stride(), 4096, triton.next_power_of_2(tokens), *[dummy] * 9, *[0] * 11]
    consts = {**CONSTS, "EVEN_K": tokens % 128 == 0, "GROUP_SIZE_M": 8}
    compiled = compile_jit(fp8._gemm_kernel.fn, args, consts, {"num_warps": 8, "num_stages": 3})
    return _cuobjdump(compiled, "--dump-sass")


def test_weight_gradient_gemm_pipelines_whole_blocks_at_any_token_count():
    ragged = weight_gradient_sass(191_237)
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128", ragged)) >= 16  # A and B tiles by cp.async, 16 bytes at a time
    assert len(re.findall(r"LDG\.E\.U8", ragged)) <= 128  # byte loads in the masked last block only


def test_weight_gemm_reads_one_tile_scale_per_block_unspilled():
    """fc1 at the step's shapes (191,237 tokens x 1024 -> 4096) with w1's 128x128 tile scales as they are."""
    from gemrec.kernels.aot import _cuobjdump, compile_jit, resource_usage

    m, n, k = 191_237, 4096, 1024
    a, b = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(n, k, dtype=torch.float8_e4m3fn)
    c, bias = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(n)
    sa, sb = torch.empty(k // 128, m).mT, torch.empty(n // 128, k // 128)
    dummy = torch.empty(1, dtype=torch.int32)
    args = [a, b, c, sa, sb, bias, dummy, dummy, m, n, k, *a.stride(), 0, *b.stride(), 0, *c.stride()]
    args += [*sa.stride(), 0, *sb.stride(), n, k, *[dummy] * 9, *[0] * 11]  # no GELU_Q epilogue
    consts = {**CONSTS, "HAS_BIAS": True, "EVEN_K": True, "TILE_B": True, "GROUP_SIZE_M": 8}
    compiled = compile_jit(fp8._gemm_kernel.fn, args, consts, {"num_warps": 8, "num_stages": 3})
    sass = _cuobjdump(compiled, "--dump-sass")
    assert resource_usage(compiled)["stack_bytes"] == 0  # per-row b scales: 255 registers and a spill
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) >= 4
    # per K block: a's row scales and one tile scale (per-row b scales: 34 loads and 64 FMULs a thread)
    assert len(re.findall(r"LDG\.E\s", sass)) <= 4 and len(re.findall(r"\bFMUL\b", sass)) <= 4


TOKENS = 191_237  # a jagged token count: no multiple of 16
BF16 = torch.bfloat16


@pytest.mark.parametrize("act", ["gelu", "gelu_bwd"])
def test_quantizing_epilogue_compiles_unspilled(act):
    """fc1 (gelu; 191,237 tokens x 1024 -> 4096, bias) and fc2's dgrad (gelu_bwd; x 1024 -> 4096 times gelu'(h), e5m2,
    bias gradient) with their epilogues (`gemm_quantize`), compiled as the launcher launches them on CUDA tensors
    (recorded on CPU ones with the GPU's float8 carriers): activation and both quantizations in registers, fp8
    straight from the saturating cast, 16-byte stores of q and the transposed qt."""
    from gemrec.kernels.aot import _cuobjdump, resource_usage

    compiled = epilogue_build(act)
    sass = _cuobjdump(compiled, "--dump-sass")
    # gelu_bwd: 200 bytes spilled in the epilogue (the x tile kept in two layouts, for the transposed copy) at 4, 8
    # or 16 warps and 1-4 stages; gelu: none
    assert resource_usage(compiled)["stack_bytes"] <= (0 if act == "gelu" else 200)
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E[45]M[23]\.E4M3", sass)) >= 4
    assert re.search(r"F2FP\.SATFINITE\.E[45]M[23]", sass) and not re.search(r"F2FP\.F16\.E[45]M[23]\.UNPACK", sass)
    assert len(re.findall(r"STG\.E\.128", sass)) >= 8 and not re.search(r"STG\.E\.(U8|U16)\b", sass)


def epilogue_build(act: str):
    """`_gemm_kernel` with its quantizing epilogue as `gemm_quantize` launches it at the step's shapes."""
    from gemrec.kernels.aot import compile_jit

    m, n, k = TOKENS, 4096, 1024
    fmt = fp8.E4M3 if act == "gelu" else fp8.E5M2
    a, b = torch.empty(m, k, dtype=fmt.dtype), torch.empty(n, k, dtype=torch.float8_e4m3fn)
    sa, sb = torch.empty(k // 128, m).mT, torch.empty(n // 128, k // 128)
    kwargs = {"bias": torch.empty(n)} if act == "gelu" else {"gate": torch.empty(m, n, dtype=BF16), "colsum": True}
    launches = []

    class Recorder:
        fn = property(lambda self: self)

        def __getitem__(self, grid):
            return lambda *args, **consts: launches.append((args, consts))

    kernel = fp8._gemm_kernel.fn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_gemm_kernel", Recorder())
        patch.setattr(fp8, "_carrier", lambda fmt, device: fmt.dtype)
        fp8.gemm_quantize(a, sa, b, sb, BF16, fmt, act=act, b_tiles=True, **kwargs)
    ((args, consts),) = launches
    options = {key: consts.pop(key) for key in ("num_warps", "num_stages")}
    assert consts["QUANT_ACT"] == fp8.ACTIVATIONS[act] and consts["FMA"] and consts["BLOCK_N"] == 128
    return compile_jit(kernel, args, consts, options)


QUANTIZE_MODES = {
    "x": lambda: ((torch.empty(TOKENS, 1024, dtype=BF16), fp8.E4M3), {"cols": True}),
    "gelu": lambda: ((torch.empty(TOKENS, 4096, dtype=BF16), fp8.E4M3), {"cols": True, "act": "gelu"}),
    "gelu_bwd": lambda: (
        (torch.empty(TOKENS, 4096, dtype=BF16), fp8.E5M2),
        {"cols": True, "act": "gelu_bwd", "gate": torch.empty(TOKENS, 4096, dtype=BF16), "colsum": True},
    ),
    "swiglu_bwd": lambda: (
        (torch.empty(TOKENS, 2048, dtype=BF16), fp8.E4M3),
        {"cols": True, "act": "swiglu_bwd", "gate": torch.empty(TOKENS, 4096, dtype=BF16)},
    ),
    "weight_tiles": lambda: ((torch.empty(4096, 1024), fp8.E4M3), {"tile": True, "cols": True}),
}


def quantize_build(mode: str):
    """`_quantize_kernel` compiled as `quantize` launches it on CUDA tensors shaped like the mode's: the launch is
    recorded (on CPU tensors, with the GPU's float8 carriers), not run."""
    from gemrec.kernels.aot import compile_jit

    (x, fmt), kwargs = QUANTIZE_MODES[mode]()
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **consts: launches.append((args, consts))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_quantize_kernel", Recorder())
        patch.setattr(fp8, "_carrier", lambda fmt, device: fmt.dtype)
        fp8.quantize(x, fmt, **kwargs)
    (args, consts), *_ = launches
    options = {"num_warps": consts.pop("num_warps")}
    return compile_jit(fp8._quantize_kernel, args, consts, options)


@pytest.mark.parametrize("mode", list(QUANTIZE_MODES))
def test_quantize_moves_16_bytes_at_a_time_unspilled(mode):
    from gemrec.kernels.aot import _cuobjdump, resource_usage

    compiled = quantize_build(mode)
    sass = _cuobjdump(compiled, "--dump-sass")
    assert resource_usage(compiled)["stack_bytes"] == 0  # no spills
    assert re.search(r"LDG\.E\.128", sass) and not re.search(r"LDG\.E\.(U8|U16|S16)\b", sass)
    # q and the transposed qt: 16-byte stores at a token count that is no multiple of 16 (byte stores before)
    assert len(re.findall(r"STG\.E\.128", sass)) >= 4 and not re.search(r"STG\.E\.(U8|U16)\b", sass)
    # the saturating cast straight to fp8 and no fp8 -> fp32 copy back (it cost ~7 instructions a value)
    assert re.search(r"F2FP\.SATFINITE\.E[45]M[23]", sass) and not re.search(r"F2FP\.F16\.E[45]M[23]\.UNPACK", sass)


def sweep_operands_on_cpu(tokens: int, jagged: int, dim: int, hidden: int) -> dict:
    """`fp8_bench.sweep_operands`' layout, allocated only, with the GPU's float8 carriers (`_carrier` patched)."""
    bf = {n: torch.empty(tokens, c, dtype=BF16) for n, c in (("x", dim), ("h", hidden), ("dy", dim), ("dh", hidden))}
    ops = {"bf16": bf, "b1": torch.empty(hidden), "b2": torch.empty(dim)}
    ops["w1_bf16"], ops["w2_bf16"] = torch.empty(hidden, dim, dtype=BF16), torch.empty(dim, hidden, dtype=BF16)

    def buffers(r, c, tile=False):
        out = fp8._quantize_buffers((1, r, c), fp8.E4M3, "cpu", rows=True, cols=True, tile=tile, colsum=False)
        out = {key: v[0] for key, v in out.items()}
        return {**out, "st": out["s"].transpose(-1, -2)} if tile else out

    ops["w1"], ops["w2"] = buffers(hidden, dim, True), buffers(dim, hidden, True)
    for rows, suffix in ((tokens, ""), (jagged, "_j")):
        for name, width in (("x", dim), ("g", hidden), ("dy", dim), ("dh", hidden)):
            ops[name + suffix] = buffers(rows, width)
    return ops


@pytest.mark.parametrize("site_name", ["fc1_dgrad", "dw1 K=191237", "fc1_fwd+gelu"])
def test_sweep_candidates_compile_unspilled_within_shared_memory(site_name):
    """`fp8_bench.sweep_configs` at 3 stages (registers do not depend on the stages; the shared memory of the
    plain loop is what `sweep_configs` computes) and every TMA config, at the step's shapes: none spills, all fit
    (the weight gradients' masked last block is the tightest: a weight's fp32 output is fc1's dgrad)."""
    from gemrec.components.trainer import fp8_bench
    from gemrec.kernels.aot import compile_jit, resource_usage

    launches = []

    class Recorder:
        fn = property(lambda self: self)

        def __getitem__(self, grid):
            return lambda *args, **consts: launches.append((args, consts))

    kernel = fp8._gemm_kernel.fn
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_gemm_kernel", Recorder())
        patch.setattr(fp8, "_carrier", lambda fmt, device: fmt.dtype)
        ops = sweep_operands_on_cpu(196_608, TOKENS, 1024, 4096)
        (site,) = [s for s in fp8_bench.sweep_sites(ops, 196_608, TOKENS) if s.name == site_name]
        configs = [c for c in fp8_bench.sweep_configs(site.kind) if c["num_stages"] == 3 or c.get("TMA")]
        for config in configs:
            if "GROUP_SIZE_M" not in config:
                site.ours(config)
    usage = {}
    for args, consts in launches:
        config = {key: consts[key] for key in fp8.GEMM_CONFIG_KEYS if key in consts}
        options = {key: consts.pop(key) for key in ("num_warps", "num_stages")}
        usage[str(config)] = resource_usage(compile_jit(kernel, args, consts, options))
    assert len(usage) >= (2 if site.kind == "epilogue" else 10)
    spilled = {c: u for c, u in usage.items() if u["stack_bytes"] or u["shared_bytes"] > fp8_bench.SHARED_MEMORY}
    assert not spilled
