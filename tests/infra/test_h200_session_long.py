"""infra/bench/h200_session.sh part `long` on the CPU: the script the H200 runs (recipe h200-long with full, window and
block attention, each its own gpu_bench process, then their comparison), with the model and batch shrunk by the
script's extra gpu_bench arguments."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SMALL = {
    "model.embedding_dim": 16,
    "model.d_model": 64,
    "model.num_heads": 2,
    "model.seq_layers": 2,
    "model.nonseq_layers": 1,
    "model.interaction_layers": 2,
    "model.moe_num_experts": 2,
    "model.moe_hidden": 64,
    "model.head_hidden": 32,
    "model.pma_seeds": 2,
    "model.seq_window": 8,
    "model.seq_block": 8,
    "data.batch_size": 3,
    "data.max_seq_len": 96,
    "bench.mean_seq_len": 48,
    "bench.num_users": 100,
    "bench.num_items": 100,
    "bench.steps": 2,
    "bench.warmup_steps": 1,
    "train.compile": "false",
}


@pytest.mark.slow
def test_part_long_runs_the_three_masks_and_compares_them(tmp_path):
    out = tmp_path / "out"
    extra = ["--device", "cpu"] + [arg for key, value in SMALL.items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run(
        ["bash", str(ROOT / "infra" / "bench" / "h200_session.sh"), str(out), "300", "long", *extra],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status = (out / "status.txt").read_text().splitlines()
    assert status == ["long_full: exit 0", "long_window: exit 0", "long_block: exit 0"], status
    runs = {
        mask: json.loads((out / f"long_{mask}" / "gpu_bench.json").read_text()) for mask in ("full", "window", "block")
    }
    for mask, run in runs.items():
        assert run["recipe"] == "h200-long" and run["compile"] is False
        assert run["attention"] == {
            "mask": mask,
            "window": 8 if mask == "window" else None,
            "block": 8 if mask == "block" else None,
            "rope": "fused",
        }
        assert run["batch_size"] == 3 and run["mfu_local"] is None and run["peak_memory_gib"] is None  # CPU
        assert run["activation_checkpointed"] == []
    assert runs["full"]["mean_tokens_per_batch"] == runs["window"]["mean_tokens_per_batch"]  # the same batch
    compare = json.loads((out / "long" / "compare.json").read_text())
    rows = compare["rows"]
    assert [r["attention"] for r in rows] == ["full, rope fused", "window 8, rope fused", "block 8, rope fused"]
    full_flops = runs["full"]["model_tflop_per_step"]
    for row, mask in zip(rows, ("full", "window", "block")):
        assert row["flop_ratio"] == pytest.approx(full_flops / runs[mask]["model_tflop_per_step"])
        assert row["tokens_per_s_gain"] == pytest.approx(runs[mask]["tokens_per_s"] / runs["full"]["tokens_per_s"])
        assert row["gain_over_flop_ratio"] == pytest.approx(row["tokens_per_s_gain"] / row["flop_ratio"])
    assert rows[0]["flop_ratio"] == 1.0 and rows[1]["flop_ratio"] > 1.0 and rows[2]["flop_ratio"] > 1.0
    assert (out / "long" / "compare.md").read_text().count("| ") > 3 * 9
    with tarfile.open(out / "all.tgz") as archive:
        assert "./long/compare.md" in archive.getnames()
