"""The GPU training benchmark's code path, run on the CPU with the tiny recipe (the H200 runs it for real)."""

import json

from gemrec.components.trainer.gpu_bench import run

SMALL = ["--set", "bench.steps=2", "--set", "bench.warmup_steps=1", "--set", "data.batch_size=8",
         "--set", "bench.num_users=100", "--set", "bench.num_items=100"]


def test_gpu_bench_reports_mfu_layers_and_profile_on_cpu(tmp_path):
    result = run(["--recipe", "tiny", "--device", "cpu", "--out", str(tmp_path), "--trace", *SMALL])
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert saved["qps"] > 0 and 0 < saved["mfu_e2e"] and 0 < saved["mfu_local"]
    assert saved["model_tflop_per_step"] == result["model_tflop_per_step"] > 0
    assert {r["name"] for r in saved["layers"]} >= {"seq_tower.0", "pma", "heads"}
    assert saved["host_syncs_per_step"] == 0  # counted on CUDA only
    assert saved["compiled_graphs_per_step"] == 0  # eager
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    assert "Self CPU" in (tmp_path / "profile.txt").read_text()
