"""The GPU training benchmark's code path, run on the CPU with the tiny recipe (the H200 runs it for real)."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from gemrec.components.trainer.gpu_bench import run

SMALL = [
    "--set",
    "bench.steps=2",
    "--set",
    "bench.warmup_steps=1",
    "--set",
    "data.batch_size=8",
    "--set",
    "bench.num_users=100",
    "--set",
    "bench.num_items=100",
]


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


def test_gpu_bench_stages_dataset_batches_and_checks_the_flop_count(synth_dataset, tmp_path):
    """--dataset: the dataset's schema and train batches, staged (the staged arm beside training through the
    services); the FLOP count is compared with FlopCounterMode on one batch (on the GPU within 1%; on the CPU the
    reference pads similar lengths into groups, so the counter reads more)."""
    result = run(
        ["--recipe", "tiny", "--device", "cpu", "--out", str(tmp_path), "--dataset", str(synth_dataset), *SMALL]
    )
    assert result["batches"] == f"dataset {synth_dataset}" and result["batch_size"] == 8
    check = result["flop_count"]
    assert check["model"] > 0 and 0.5 < check["model_over_counter"] <= 1.0
    assert result["mfu_local"] > 0 and result["local_mfu_compiled"] is False


def test_scaling_bench_splits_one_global_batch_by_attention_cost():
    from gemrec.components.data_service.balance import example_cost, imbalance
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.gpu_bench import synthetic_lengths, synthetic_schema
    from gemrec.components.trainer.parallel.scaling_bench import balanced_batches

    config = load_recipe("tiny", ["bench.num_users=100", "bench.num_items=100", "bench.distinct_batches=2"])
    schema, batch, max_len, world = synthetic_schema(config.bench), 16, 64, 4
    per_rank = [balanced_batches(schema, config.bench, batch, max_len, rank, world, 512.0) for rank in range(world)]
    pool = synthetic_lengths(config.bench, world * batch, max_len, torch.Generator().manual_seed(1000))
    lengths = [inp.seq_lengths() for inp, _ in (batches[0] for batches in per_rank)]
    assert all(len(x) == batch for x in lengths)
    assert sorted(torch.cat(lengths).tolist()) == sorted(pool.tolist())  # every example served, once
    costs = [float(example_cost(x.numpy(), 512.0).sum()) for x in lengths]
    naive = [float(example_cost(pool[r * batch : (r + 1) * batch].numpy(), 512.0).sum()) for r in range(world)]
    assert imbalance(np.array(costs)) < min(1.05, imbalance(np.array(naive)))
    # One rank: the global batch is the rank's batch, lengths in their drawn order.
    (single, _), _ = balanced_batches(schema, config.bench, batch, max_len, 0, 1, 512.0)
    assert (
        single.seq_lengths().tolist()
        == synthetic_lengths(config.bench, batch, max_len, torch.Generator().manual_seed(1000)).tolist()
    )


def test_scaling_bench_takes_its_layout_from_the_recipe(tmp_path, capsys):
    """One rank launched as torchrun launches it (gloo on the CPU): the recipe's `[parallel]`, changed by `--set`,
    reaches `parallelize` and names the result; a bad layout value is refused naming the key."""
    import os
    import subprocess
    import sys

    from gemrec.components.common.ports import free_port
    from gemrec.components.trainer.parallel import scaling_bench

    argv = ["--recipe", "tiny", "--out", str(tmp_path), *SMALL, "--set", "bench.distinct_batches=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    module = [sys.executable, "-m", scaling_bench.__name__]
    done = subprocess.run(
        [*module, *argv, "--set", "parallel.reshard_after_forward=false"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "scaling_w1_fsdp_zero2.json").read_text())
    assert result["reshard_after_forward"] is False and result["compile"] is False and result["ep"] == 1
    assert result["layout"].startswith("world 1 = dp_replicate 1 x dp_shard 1") and result["qps"] > 0
    with pytest.raises(SystemExit) as refused:
        scaling_bench.run([*argv, "--set", "parallel.param_dtype=int8"])
    assert refused.value.code == 2 and "parallel.param_dtype" in capsys.readouterr().err


def test_h200_bench_flop_count_matches_flop_counter_per_layer(monkeypatch):
    """The h200-bench model, narrowed (d_model 128, expert hidden 512), on a batch of the bench's own shape
    (lognormal lengths, mean 384, sigma 0.8, capped at 1024), fp32 on the CPU: every layer alone, forward and
    backward, within 1% of FlopCounterMode. Non-causal, because the CPU reference computes the masked half of
    causal attention (the causal count is the kernels' pair count, which their FLOP formula uses on the GPU)."""
    import gemrec.kernels.reference as attention_reference
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.gpu_bench import synthetic_batch, synthetic_schema
    from gemrec.components.trainer.mfu import _tensors
    from gemrec.model import build_model, model_flops
    from gemrec.model.capture import capture_layer_inputs
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(attention_reference, "MAX_PADDING", 0.0)  # the reference does the jagged work only
    torch.manual_seed(0)
    config = load_recipe("h200-bench", ["bench.num_users=100", "bench.num_items=100"])
    narrow = {"d_model": 128, "moe_hidden": 512, "head_hidden": 128, "seq_causal": False}
    model = build_model(dataclasses.replace(config.model, **narrow), synthetic_schema(config.bench))
    inp, _ = synthetic_batch(model.schema, config.bench, 4, config.data.max_seq_len, torch.Generator().manual_seed(0))
    counted = model_flops(model, inp)
    captured = capture_layer_inputs(model, list(counted), lambda: model(inp))
    assert set(captured) == set(counted)
    for name, (want_forward, want_backward) in counted.items():
        args, kwargs = captured[name]
        counter = FlopCounterMode(display=False)
        with counter:
            out = model.get_submodule(name)(*args, **kwargs)
            forward = counter.get_total_flops()
            outs = [t for t in _tensors(out) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        assert want_forward == pytest.approx(forward, rel=0.01), name
        assert want_backward == pytest.approx(counter.get_total_flops() - forward, rel=0.01), name


@pytest.mark.parametrize("recipe", ["h200-bench", "h200-long"])
def test_synth_bench_profiles_have_the_benchmark_schema(tmp_path, recipe):
    """`gemrec data synth --profile RECIPE` gives the features gpu_bench builds its batches with (names,
    table sizes, multi-valuedness, sources, history features, 16 dense, labels, actions); only the id tables
    follow the data."""
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.data_service.synth import SynthConfig, synthesize
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.gpu_bench import synthetic_schema
    from gemrec.model import FeatureSchema

    config = load_recipe(recipe)
    synth = SynthConfig.for_profile(recipe, events=50_000)
    assert (synth.mean_length, synth.length_sigma) == (config.bench.mean_seq_len, config.bench.length_sigma)
    assert synth.max_length == config.data.max_seq_len
    dataset = synthesize(tmp_path / "bench", synth, progress=False)
    got = FeatureSchema.from_manifest(Dataset.open(dataset).manifest)
    want = synthetic_schema(config.bench)

    def shape(schema, ids):
        return {f.name: (ids.get(f.name, f.num_embeddings), f.multi_valued, f.source) for f in schema.sparse_features}

    ids = {"user_id": "data", "item_id": "data"}
    assert shape(got, ids) == shape(want, ids)
    assert got.seq_item_features == want.seq_item_features and got.num_dense == want.num_dense == 16
    assert got.labels == want.labels and got.actions == want.actions


# What the H200 image lacks: the benchmark (setup_training, the one train step) must not import any of it.
MISSING_ON_THE_GPU_MACHINE = ("torchrec", "fbgemm_gpu", "mlflow", "kfp", "redis", "torchao", "kubernetes")
BLOCKED_RUN = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
from gemrec.components.trainer.gpu_bench import run

result = run({argv!r})
assert result["final_loss"] > 0 and result["sparse_optimizer"].startswith("gemrec RowWiseAdagrad")
assert not [m for m in sys.modules if m.split(".")[0] in {blocked!r}]
print("OK")
"""


def test_gpu_bench_runs_without_torchrec_mlflow_or_kfp(tmp_path):
    import os
    import subprocess
    import sys

    argv = ["--recipe", "tiny", "--device", "cpu", "--out", str(tmp_path), *SMALL]
    script = BLOCKED_RUN.format(blocked=MISSING_ON_THE_GPU_MACHINE, argv=argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK")


def test_gpu_bench_fp8_on_cpu_and_the_bf16_vs_fp8_overlay(tmp_path):
    from gemrec.components.trainer import fp8_bench

    runs = {}
    for precision in ("fp32", "fp8"):
        out = tmp_path / precision
        runs[precision] = run(
            ["--recipe", "tiny", "--device", "cpu", "--out", str(out), "--set", f"train.precision={precision}", *SMALL]
        )
    assert runs["fp32"]["fp8_modules"] == [] and runs["fp8"]["fp8_modules"] == ["seq_tower.0.mlp", "pma.mlp"]
    assert len(runs["fp8"]["losses"]) == 3 and runs["fp8"]["precision"] == "fp8 (fp32)"
    # the emulation tracks fp32 on the same batches (same seed, same initial weights)
    assert runs["fp8"]["losses"][0] == pytest.approx(runs["fp32"]["losses"][0], rel=0.02)
    summary = fp8_bench.run(
        ["--compare", str(tmp_path / "fp32" / "gpu_bench.json"), str(tmp_path / "fp8" / "gpu_bench.json")]
        + ["--out", str(tmp_path / "cmp"), "--tracking-uri", f"sqlite:///{tmp_path / 'mlruns.db'}"]
    )
    assert summary["qps_ratio"] > 0 and (tmp_path / "cmp" / "loss_bf16_vs_fp8.png").stat().st_size > 1000
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    (logged,) = client.search_runs([client.get_experiment_by_name("gemrec").experiment_id])
    assert logged.data.metrics["qps_ratio"] == pytest.approx(summary["qps_ratio"])
    assert "plots/loss_bf16_vs_fp8.png" in {a.path for a in client.list_artifacts(logged.info.run_id, "plots")}


def test_h200_long_is_the_h200_bench_model_on_long_histories():
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.gpu_bench import synthetic_lengths

    long, bench = load_recipe("h200-long"), load_recipe("h200-bench")
    masks = {"seq_attention_mask": "full", "seq_window": None, "seq_block": None, "rope": "separate"}
    assert dataclasses.replace(long.model, **masks) == bench.model  # only the mask and the rotary differ
    assert long.model.seq_mask == (1024, None) and long.model.fused_rope_base == 10000.0
    assert dataclasses.replace(long.model, seq_attention_mask="block").seq_mask == (None, 64)
    lengths = synthetic_lengths(long.bench, 100_000, long.data.max_seq_len, torch.Generator().manual_seed(0))
    assert lengths.max() == long.data.max_seq_len == 16384 and lengths.float().mean() >= 4096


def test_gpu_bench_reports_the_memory_plan_and_attention_of_h200_long(tmp_path):
    narrow = ["model.d_model=64", "model.num_heads=2", "model.moe_hidden=64", "model.head_hidden=32"]
    narrow += ["model.embedding_dim=16", "data.max_seq_len=64", "bench.mean_seq_len=40", "model.seq_block=16"]
    narrow += ["train.compile=false", "model.seq_attention_mask=block", "parallel.activation_checkpoint=selective"]
    narrow += ['parallel.activation_checkpoint_blocks=["seq_tower.*"]', "parallel.activation_checkpoint_every=2"]
    argv = ["--recipe", "h200-long", "--device", "cpu", "--out", str(tmp_path), *SMALL]
    result = run(argv + [arg for item in narrow for arg in ("--set", item)])
    assert result["activation_checkpointed"] == ["seq_tower.0", "seq_tower.2"]
    assert result["attention"] == {"mask": "block", "window": None, "block": 16, "rope": "fused"}
    assert result["mfu_local"] is not None and result["peak_memory_gib"] is None  # CPU: no allocator statistics
    assert len(result["losses"]) == 3 and all(np.isfinite(result["losses"]))
