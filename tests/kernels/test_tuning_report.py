"""The autotuner's report: the tile kept is the fastest of the warmed-up finalists, not of the 25 ms bursts."""

import torch
from gemrec.kernels import triton_attention as kernels


def test_report_keeps_the_fastest_warmed_finalist(monkeypatch):
    burst_best, sustained_best = kernels.CONFIGS["fwd"][0], kernels.CONFIGS["fwd"][1]
    entry = {
        "key": (("consts",), torch.bfloat16, (4096, 4096, 131072, 131072), True, 0),
        "consts": {"MODE": 0},
        "started": 0.0,
        "seconds": 2.0,
        "timings": [(1.60, burst_best), (1.65, sustained_best)],
        "finals": [(1.90, burst_best), (1.84, sustained_best)],
        "failures": [],
    }
    monkeypatch.setattr(kernels._KERNELS["fwd"], "tuning_log", [entry])
    (report,) = [r for r in kernels.tuned_configs() if r["constexprs"] is entry["consts"]]
    assert report["config"] == sustained_best and report["ms"] == 1.84
    names = [kernels._config_name(c) for c in (burst_best, sustained_best)]
    assert list(report["candidates_ms"]) == names
    assert list(report["finalists_ms"]) == names[::-1]


def test_single_candidate_has_no_finalists(monkeypatch):
    only = kernels.CONFIGS["delta"][0]
    entry = {
        "key": (("consts",), torch.float32, 0, False, 0),
        "consts": {"MODE": 1},
        "started": 0.0,
        "seconds": 0.1,
        "timings": [(0.01, only)],
        "finals": [],
        "failures": [],
    }
    monkeypatch.setattr(kernels._KERNELS["delta"], "tuning_log", [entry])
    (report,) = [r for r in kernels.tuned_configs() if r["constexprs"] is entry["consts"]]
    assert report["config"] == only and report["finalists_ms"] == {}
