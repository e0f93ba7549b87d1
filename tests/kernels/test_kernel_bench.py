"""`gemrec bench kernels`' host-time measurements (`host_us`, the host table, `host_timeline`) on CPU tensors."""

import json

import torch
from gemrec.kernels import KernelOptions, bench, jagged_attention


def _case_fn():
    lens = [5, 0, 9]
    off = bench.offsets_of(lens, "cpu")
    leaves = [torch.randn(sum(lens), 2, 16, requires_grad=True) for _ in range(3)]
    return (lambda q, k, v: jagged_attention(q, k, v, off, off, 9, 9, causal=True, backend="reference")), leaves


def test_host_time_of_forward_and_backward_on_either_thread():
    fn, leaves = _case_fn()
    fwd = bench.host_us(fn, leaves, False, calls=3)
    both = bench.host_us(fn, leaves, True, calls=3)
    calling = bench.host_us(fn, leaves, True, calling_thread=True, calls=3)
    assert 0 < fwd < both and calling > 0
    assert torch.autograd.is_multithreading_enabled()  # restored after the calling-thread samples


def test_host_table_sets_eager_beside_graph():
    row = {
        "config": "B",
        "variant": "jfa",
        "impl": "ours (triton)",
        "fwd_ms": 0.1,
        "fwd_tflops": 190.0,
        "fwd+bwd_ms": 0.52,
        "graph fwd+bwd_ms": 0.4,
        "host_fwd_us": 80.0,
        "host_fwd+bwd_us": 400.0,
        "host_fwd+bwd_calling_thread_us": 300.0,
        "fwd+bwd_calling_thread_ms": 0.44,
    }
    meta = {"date": "d", "commit": "c", "device": "H200", "torch": "t", "checks": {}}
    assert "| B | jfa | ours (triton) | 80 | 400 | 300 | 0.520 | 0.440 | 0.400 | 1.30 | 1.10 |" in bench.markdown(
        meta, [row]
    )
    assert "host fwd 80 us, fwd+bwd 400 us (calling thread 300 us, eager 0.440 ms)" in bench.format_row(row)


def test_host_timeline_lists_the_calls_host_events_in_order():
    fn, leaves = _case_fn()
    lines = bench.host_timeline(bench.profile_call(fn, leaves).events()).splitlines()
    starts = [float(line.split()[0]) for line in lines[1:]]
    assert lines[0].split() == ["start", "us", "us", "thread", "event"]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert any("aten::" in line for line in lines[1:])


def test_host_only_reports_every_variant_and_its_timeline(tmp_path, monkeypatch):
    tiny = bench.Config(
        "tiny", 3, 2, 16, "uniform:1:9", "self", (bench.Variant("jfa", True), bench.Variant("gdpa", False)), ""
    )
    monkeypatch.setitem(bench.CONFIGS, "tiny", tiny)
    monkeypatch.setattr(bench, "HOST_ONLY_CALLS", 2)
    rows = bench.host_benchmark(
        ["tiny"], tmp_path, KernelOptions(autotune=False), progress=lambda _: None, device="cpu"
    )
    assert [(r["config"], r["variant"]) for r in rows] == [("tiny", "jfa-causal"), ("tiny", "gdpa")]
    for row in rows:  # no order between them asserted: these are CPU timings of a shared machine
        assert min(row[label] for label in ("host_fwd_us", "host_fwd+bwd_us", "host_fwd+bwd_calling_thread_us")) > 0
    saved = json.loads((tmp_path / "kernels_host.json").read_text())
    assert saved["rows"] == rows and saved["meta"]["calls_per_sample"] == 2
    timeline = (tmp_path / "kernels_host_timeline.txt").read_text()
    assert "tiny/jfa-causal" in timeline and "tiny/gdpa" in timeline
