"""The FP8 attention forward's CPU path: `KernelOptions.fp8` on the reference backend runs the emulation
(`fp8_attention`'s rounding of q, k, v and the weights to e4m3, fp32 compute). Its numerics against exact fp64, the
block scales, and the option's plumbing and refusals. The Triton kernel itself: test_fp8_attention_interpreter.py
(CPU interpreter) and test_fp8_attention_gpu.py."""

import pytest
import torch
from gemrec.kernels import KernelOptions, fp8_attention, gdpa, jagged_attention
from kernel_harness import check_fp8, fp8_errors, make_case, offsets_of, rel_l2

FP8 = KernelOptions(fp8=True)


@pytest.mark.parametrize(
    "activation,kw",
    [
        ("softmax", {}),
        ("softmax", {"causal": True, "window": 50}),
        ("silu", {"causal": True}),
        ("gelu_tanh", {"block": 64}),
        ("relu2", {"normalize": "none"}),
    ],
)
def test_emulation_within_fp8_error_of_exact(activation, kw):
    case = make_case([300, 1, 0, 140], [300, 1, 5, 140], heads=2, dim=32, bias=True, seed=0)
    got, emulated = fp8_errors(case, activation, backend="reference", options=FP8, **kw)
    assert got == emulated  # backend "reference" with the option is the emulation
    check_fp8(got, emulated)  # gradients: straight through the emulated forward's rounding
    assert got[0] > 5e-3  # it does round: exact fp32 would be ~1e-7


def test_auto_backend_on_cpu_runs_the_emulation():
    case = make_case([100, 60], [100, 60], heads=2, dim=16, seed=1)
    q_off, kv_off = case.offsets()
    args = (case.q, case.k, case.v, q_off, kv_off, 100, 100)
    auto = jagged_attention(*args, options=FP8)
    assert torch.equal(auto, jagged_attention(*args, backend="reference", options=FP8))
    assert rel_l2(auto, jagged_attention(*args)) > 5e-3
    assert torch.equal(gdpa(*args, options=FP8), gdpa(*args, backend="reference", options=FP8))


def test_tile_scales_keep_outliers_local():
    """One scale per 128-row tile of each sequence and head: an outlier coarsens only its own tile and head."""
    lengths = [200, 100]
    x = torch.randn(300, 2, 16, generator=torch.Generator().manual_seed(2))
    spiked = x.clone()
    spiked[10, 0, 3] = 1e4  # sequence 0, tile 0, head 0
    off = offsets_of(lengths).tolist()
    base, out = fp8_attention.quantize_tiles_reference(x, off), fp8_attention.quantize_tiles_reference(spiked, off)
    changed = (base != out).any(-1)
    assert changed[:128, 0].sum() > 100 and not changed[128:, 0].any() and not changed[:, 1].any()
    assert out[10, 0, 3] == 1e4  # the amax maps to 448 exactly
    assert (rel_l2(base, x)) < 0.04  # e4m3: 3 mantissa bits
    zeros = fp8_attention.quantize_tiles_reference(torch.zeros(5, 1, 16), [0, 5])
    assert torch.equal(zeros, torch.zeros(5, 1, 16))
    x[3, 1, 0] = float("nan")
    assert fp8_attention.quantize_tiles_reference(x, off)[:128, 1].isnan().all()  # NaN spreads to its tile


def test_softmax_weights_are_rounded_against_the_row_max():
    w = torch.tensor([[0.5, 0.25, 0.2, 0.05, 1e-4, 0.0]])
    q = fp8_attention.quantize_weights_reference(w, softmax=True)
    assert torch.equal(q[:, :3], torch.tensor([[0.5, 0.25, 0.203125]]))  # 256 * w / 0.5 on the e4m3 grid
    assert q[0, 4] > 0  # 2^-9 * 0.5 / 256 is e4m3's smallest step there: 1e-4 survives
    a = torch.tensor([[3.0, -1000.0, 0.1]])
    qa = fp8_attention.quantize_weights_reference(a, softmax=False)
    assert qa[0, 1] == -1000.0 and (qa - a).abs().max() < 64  # one scale per row and 128-key block


def test_refusals_are_named():
    case = make_case([20], [20], heads=2, dim=16, seed=3)
    q_off, kv_off = case.offsets()
    for backend in ("reference", "auto"):
        with pytest.raises(ValueError, match="FP8 attention forward does not support rope_base"):
            jagged_attention(case.q, case.k, case.v, q_off, kv_off, 20, 20, rope_base=1e4, backend=backend, options=FP8)
    assert KernelOptions.from_dict({"fp8": True}) == FP8
    with pytest.raises(ValueError, match="kernels.fp8 = 'yes': must be true or false"):
        KernelOptions.from_dict({"fp8": "yes"})


def test_bench_flag_adds_the_fp8_rows():
    import argparse

    from gemrec.kernels import cli

    root = argparse.ArgumentParser()
    cli.register({"bench": root.add_subparsers()})
    args = root.parse_args(["kernels", "--fp8-vs-bf16", "--fwd-only"])
    assert args.fp8_vs_bf16 and args.fwd_only and not cli.kernel_options(args).fp8


def test_bench_rows_report_the_fp8_speedup():
    from gemrec.kernels import bench

    base = {"config": "A", "variant": "jfa", "impl": "ours (triton)", "fwd_ms": 1.5, "fwd_tflops": 500.0}
    fp8 = {**base, "impl": bench.FP8_IMPL, "fwd_ms": 1.0, "fwd_tflops": 750.0, "fwd+bwd_error": "not timed"}
    rows = [base, fp8]
    bench._speedups(rows)
    assert fp8["fwd_vs_ours"] == 1.5 and "fwd_vs_ours" not in base and "fwd+bwd_vs_ours" not in fp8
    assert "1.000 ms 750 TF/s 1.50x" in bench.format_row(fp8)
    meta = {"date": "d", "commit": "c", "device": "H200", "torch": "t", "checks": {}}
    assert "| A | jfa | ours (triton, fp8 fwd) | 1.000 | 750 (1.50x ours) |" in bench.markdown(meta, rows)


def test_bench_times_the_quantization_alone(monkeypatch):
    from gemrec.kernels import bench

    monkeypatch.setattr(bench, "_time", lambda fn, leaves, backward, graph=False: 0.5)
    case = bench.make_case(bench.CONFIGS["B"], 0, "cpu", num_seqs=4)
    jobs: list = []
    row = bench._quantization_row("B", case, jobs)
    assert row["fwd_ms"] == 0.5 and row["fwd_tbps"] == 6 * case.k.numel() / 0.5e-3 / 1e12
    assert row["fwd+bwd_error"] == "forward only" and [job[1] for job in jobs] == ["graph fwd"]
