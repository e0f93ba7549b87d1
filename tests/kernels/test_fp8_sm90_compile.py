"""The FP8 kernels compiled for Hopper (sm_90) without a GPU, as triton's launcher specializes them on one: a weight
gradient's reduction over an arbitrary token count streams its whole 128-deep blocks through cp.async; a GEMM with a
weight's tile scales loads one scale per K block and scales with one multiply-add a value, unspilled; quantization
at an arbitrary token count loads and stores 16 bytes at a time (the transposed copy too), unspilled, with no fp32
copy of its fp8 values; every autotuner candidate of the step's GEMMs unspilled."""

import re

import pytest
import torch
import triton
from gemrec.kernels import fp8
from gemrec.kernels.aot import HOPPER_SHARED_MEMORY
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
    args += [*sa.stride(), 0, *sb.stride(), 4096, triton.next_power_of_2(tokens), 0]
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
    args += [*sa.stride(), 0, *sb.stride(), n, k, 0]
    consts = {**CONSTS, "HAS_BIAS": True, "EVEN_K": True, "TILE_B": True, "GROUP_SIZE_M": 8}
    compiled = compile_jit(fp8._gemm_kernel.fn, args, consts, {"num_warps": 8, "num_stages": 3})
    sass = _cuobjdump(compiled, "--dump-sass")
    assert resource_usage(compiled)["stack_bytes"] == 0  # per-row b scales: 255 registers and a spill
    assert len(re.findall(r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", sass)) >= 4
    # per K block: a's row scales and one tile scale (per-row b scales: 34 loads and 64 FMULs a thread)
    assert len(re.findall(r"LDG\.E\s", sass)) <= 4 and len(re.findall(r"\bFMUL\b", sass)) <= 4


TOKENS = 191_237  # a jagged token count: no multiple of 16
BF16 = torch.bfloat16


class Recorder:
    """Stands in for `fp8._gemm_kernel` (and its `.fn`): records each launch instead of running it."""

    def __init__(self):
        self.launches = []

    fn = property(lambda self: self)

    def __getitem__(self, grid):
        return lambda *args, **consts: self.launches.append((args, consts))


def compile_launches(launches) -> dict[str, dict]:
    """str(config) -> `aot.resource_usage` of `_gemm_kernel` compiled for sm_90 as each recorded launch had it."""
    from gemrec.kernels.aot import compile_jit, resource_usage

    usage = {}
    for args, consts in launches:
        consts = dict(consts)
        config = {key: consts[key] for key in fp8.GEMM_CONFIG_KEYS if key in consts}
        options = {key: consts.pop(key) for key in ("num_warps", "num_stages")}
        usage[str(config)] = resource_usage(compile_jit(fp8._gemm_kernel.fn, args, consts, options))
    return usage


def tuned_launch(name: str):
    """(gemm's positional args, keywords, `fp8._config_fits`' launch) of the step's GEMMs, on CPU tensors with the
    GPU's layouts and float8 dtypes: fc1 (bias, bf16 out), fc1's dgrad (fp32 out), a weight gradient over the jagged
    token count ("qt" operands), the experts' GEMMs by M tile and by K range (h200-bench: 13,312 tokens, top-2 of
    8)."""
    f8 = torch.float8_e4m3fn
    if name in ("fc1", "fc1_dgrad"):
        k, n = (1024, 4096) if name == "fc1" else (4096, 1024)
        a, sa = torch.empty(TOKENS, k, dtype=f8), torch.empty(k // 128, TOKENS).mT
        w, sw = torch.empty(n, k, dtype=f8), torch.empty(n // 128, k // 128)
        out = BF16 if name == "fc1" else torch.float32
        kw = {"bias": torch.empty(n)} if name == "fc1" else {}
        return (a, sa, w, sw, out), {**kw, "b_tiles": True}, (False, True)
    rows = -(-(13_312 * 2 + 8 * 127) // 128) * 128  # `group_layout`'s capacity
    if name == "experts_m":
        a, sa = torch.empty(rows, 1024, dtype=f8), torch.empty(8, rows).mT
        w, sw = torch.empty(8, 8192, 1024, dtype=f8), torch.empty(8, 64, 8)
        kw = {"tile_group": torch.zeros(rows // 128, dtype=torch.int32), "b_tiles": True}
        return (a, sa, w, sw, BF16), kw, (True, True)
    k = TOKENS if name == "weight_gradient" else rows
    a, b = (fp8.aligned_rows((n, k), "cpu", f8) for n in (1024, 4096))
    sa, sb = (torch.empty(-(-k // 128), n).mT for n in (1024, 4096))
    kw = {"k_bounds": torch.zeros(9, dtype=torch.int32)} if name == "experts_k" else {}
    return (a, sa, b, sb, torch.float32), kw, (False, False)


@pytest.mark.parametrize("name", ["fc1", "fc1_dgrad", "weight_gradient", "experts_m", "experts_k"])
def test_tuned_configs_compile_unspilled_within_shared_memory(name):
    """Every autotuner candidate (`fp8.GEMM_TUNED`) that a launch of the step may take (`fp8._config_fits`), compiled
    for sm_90 as the launcher launches it: none spills, all fit the shared memory."""

    args, kw, (grouped_m, tile_b) = tuned_launch(name)
    tma_ok = fp8._tma_ok(args[0], args[2])
    fits = [c for c in fp8.GEMM_TUNED if fp8._config_fits(c, grouped_m=grouped_m, tile_b=tile_b, tma_ok=tma_ok)]
    assert fits and (tma_ok or grouped_m)
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_gemm_kernel", recorder)
        for config in fits:
            fp8.gemm(*args, **kw, config=config)
    usage = compile_launches(recorder.launches)
    assert len(usage) == len(fits)
    assert all(u["shared_bytes"] <= HOPPER_SHARED_MEMORY for u in usage.values())
    spilled = {c: u["stack_bytes"] for c, u in usage.items() if u["stack_bytes"]}
    if name == "experts_k":
        # the experts' weight gradients without TMA (their only candidates before TMA: 07c0008) spill 400 bytes, their
        # K loop over runtime group bounds unpipelined (64 KiB of shared memory); the TMA candidates do not spill
        assert list(spilled.values()) == [400] and all("TMA" not in c for c in spilled)
    else:
        assert not spilled


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
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_quantize_kernel", recorder)
        patch.setattr(fp8, "_carrier", lambda fmt, device: fmt.dtype)
        fp8.quantize(x, fmt, **kwargs)
    (args, consts), *_ = recorder.launches
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


@pytest.mark.parametrize("site_name", ["fc1_dgrad", "dw1 K=191237"])
def test_sweep_candidates_compile_unspilled_within_shared_memory(site_name):
    """`fp8_bench.sweep_configs` at 3 stages (registers do not depend on the stages; the shared memory of the
    plain loop is what `sweep_configs` computes) and every TMA config, at the step's shapes: none spills, all fit
    (the weight gradients' masked last block is the tightest: a weight's fp32 output is fc1's dgrad)."""
    from gemrec.components.trainer import fp8_bench

    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8, "_gemm_kernel", recorder)
        patch.setattr(fp8, "_carrier", lambda fmt, device: fmt.dtype)
        ops = sweep_operands_on_cpu(196_608, TOKENS, 1024, 4096)
        (site,) = [s for s in fp8_bench.sweep_sites(ops, 196_608, TOKENS) if s.name == site_name]
        configs = [c for c in fp8_bench.sweep_configs(site.kind) if c["num_stages"] == 3 or c.get("TMA")]
        for config in configs:
            if "GROUP_SIZE_M" not in config:
                site.ours(config)
    usage = compile_launches(recorder.launches)
    assert len(usage) >= 8
    spilled = {c: u for c, u in usage.items() if u["stack_bytes"] or u["shared_bytes"] > HOPPER_SHARED_MEMORY}
    assert not spilled
