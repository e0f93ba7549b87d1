import json
import warnings

from gemrec.model.bench import SYNC_WARNING, main, sync_sites


def test_bench_model_runs_on_cpu_and_writes_its_report(tmp_path):
    report = main(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--batch-size",
            "4",
            "--mean-len",
            "6",
            "--max-len",
            "12",
            "--num-users",
            "50",
            "--distinct-batches",
            "1",
            "--steps",
            "1",
            "--layer-repeats",
            "1",
            "--set",
            "model.d_model=32",
            "--set",
            "model.embedding_dim=8",
            "--set",
            "model.moe_hidden=32",
            "--set",
            "model.head_hidden=16",
            "--set",
            "model.seq_layers=1",
            "--set",
            "model.interaction_layers=2",
            "--set",
            "model.nonseq_layers=1",
        ]
    )
    written = json.loads((tmp_path / "model_bench.json").read_text())
    assert written["batch_size"] == 4 and written["config"]["d_model"] == 32
    assert [row["layer"] for row in written["layers"]][:2] == ["seq_input", "seq_tower.0"]
    assert all(row["fwd_bwd_ms"] > 0 for row in written["layers"])
    # On the CPU both sides of each check are the same reference, up to bf16 input rounding.
    assert max(report["check_attention_rel_error"].values()) < 2e-2
    assert report["check_moe_grouped_rel_error"] < 1e-5


def test_sync_sites_count_syncs_not_the_debug_modes_own_notice():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations",
            stacklevel=1,
        )
        warnings.warn(f"{SYNC_WARNING} (Triggered internally at CUDAFunctions.cpp:170.)", stacklevel=1)
        warnings.warn(SYNC_WARNING, stacklevel=1)
    count, sites = sync_sites(caught)
    assert count == 2
    assert sites == [f"test_model_bench.py:{caught[1].lineno}", f"test_model_bench.py:{caught[2].lineno}"]
