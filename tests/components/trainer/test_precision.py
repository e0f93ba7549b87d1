"""The FP8 conversion on the real GEM model, run through the CPU emulation: what is converted, what stays, the
state dict, overrides, counters, delayed scaling, and the converted model's loss and gradients against fp32."""

import copy

import pytest
import torch
from gemrec.components.trainer import precision
from gemrec.components.trainer.config import BenchConfig, Fp8Config
from gemrec.components.trainer.gpu_bench import synthetic_batch, synthetic_schema
from gemrec.config import ConfigError
from gemrec.model import ModelConfig, build_model
from gemrec.model import loss as model_loss

CPU = torch.device("cpu")
SMALL = dict(
    embedding_backend="torch",
    embedding_dim=16,
    d_model=64,
    num_heads=2,
    seq_layers=2,
    nonseq_layers=1,
    interaction_layers=2,
    moe_every=2,
    moe_num_experts=4,
    moe_top_k=2,
    moe_hidden=128,
    head_hidden=32,
    pma_seeds=2,
)


@pytest.fixture(scope="module")
def setup():
    bench = BenchConfig(num_users=1000, num_items=1000, num_dense=4, mean_seq_len=12.0)
    schema = synthetic_schema(bench)
    torch.manual_seed(0)
    model = build_model(ModelConfig(**SMALL), schema)
    gen = torch.Generator().manual_seed(0)
    inp, labels = synthetic_batch(schema, bench, 24, 32, gen)
    return model, inp, labels


def grads_of(model, inp, labels):
    model.zero_grad(set_to_none=True)
    loss = model_loss(model(inp), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_converts_mlps_and_experts_only_and_keeps_the_state_dict(setup):
    model, _, _ = setup
    fp8_model = copy.deepcopy(model)
    assert precision.convert_to_fp8(copy.deepcopy(model), Fp8Config(), CPU) == [
        "seq_tower.0.mlp",
        "seq_tower.1.mlp",
        "pma.mlp",
    ]  # by default the towers feeding the heads stay bf16
    names = precision.convert_to_fp8(fp8_model, Fp8Config(top_layers_bf16=False), CPU)
    assert names == [
        "seq_tower.0.mlp",
        "seq_tower.1.mlp",
        "pma.mlp",
        "nonseq_tower.0.ffn",
        "interaction.0.ffn",
        "interaction.1.ffn.experts",
    ]
    # embedding projections, the router and the task heads keep nn.Linear
    assert type(fp8_model.seq_input.token_proj) is torch.nn.Linear
    assert type(fp8_model.interaction[1].ffn.router) is torch.nn.Linear
    assert type(fp8_model.heads.trunk) is torch.nn.Linear
    before, after = model.state_dict(), fp8_model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_overrides_keep_matching_modules_in_bf16_and_unknown_patterns_are_refused(setup):
    model, _, _ = setup
    options = Fp8Config(overrides={"interaction.*": "bf16", "interaction.1.*": "fp8"}, top_layers_bf16=False)
    names = precision.convert_to_fp8(copy.deepcopy(model), options, CPU)
    assert "interaction.0.ffn" not in names and "interaction.1.ffn.experts" in names
    with pytest.raises(ValueError, match=r"\['tower.\*'\] match no module"):
        precision.convert_to_fp8(copy.deepcopy(model), Fp8Config(overrides={"tower.*": "bf16"}), CPU)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"grad_format": "e4m4"}, "fp8.grad_format = 'e4m4'"),
        ({"scaling": "lazy"}, "fp8.scaling"),
        ({"amax_history": 0}, "fp8.amax_history = 0: must be >= 1"),
        ({"overrides": {"pma.*": "fp16"}}, "fp8.overrides"),
        ({"gemm": "cutlass"}, "fp8.gemm"),
    ],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        Fp8Config(**options)


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_emulated_fp8_model_tracks_fp32(setup, grad_format):
    model, inp, labels = setup
    ref_loss, ref_grads = grads_of(model, inp, labels)
    fp8_model = copy.deepcopy(model)
    precision.convert_to_fp8(fp8_model, Fp8Config(grad_format=grad_format, top_layers_bf16=False), CPU)
    loss, grads = grads_of(fp8_model, inp, labels)
    assert float(loss) == pytest.approx(float(ref_loss), rel=0.01)
    for name in ("seq_tower.0.mlp.fc1.weight", "interaction.1.ffn.experts.w1", "heads.trunk.weight"):
        rel = float((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm())
        assert rel < (0.15 if grad_format == "e4m3" else 0.25), (name, rel)


def test_fp8_attention_converts_by_option_and_overrides_and_tracks_fp32(setup):
    model, inp, labels = setup
    ref_loss, ref_grads = grads_of(model, inp, labels)
    fp8_model = copy.deepcopy(model)
    names = precision.convert_to_fp8(fp8_model, Fp8Config(attention=True), CPU)
    assert [n for n in names if n.endswith("attn")] == ["seq_tower.0.attn", "seq_tower.1.attn", "pma.attn"]
    assert fp8_model.pma.attn.kernel_options.fp8 and model.pma.attn.kernel_options is None
    assert fp8_model.interaction[0].self_attn.kernel_options is None  # the top layers stay bf16
    loss, grads = grads_of(fp8_model, inp, labels)  # the CPU path: the reference's emulation of the FP8 forward
    assert float(loss) == pytest.approx(float(ref_loss), rel=0.01) and float(loss) != float(ref_loss)
    for name in ("seq_tower.0.attn.wq.weight", "pma.attn.wkv.weight", "heads.trunk.weight"):
        rel = float((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm())
        assert rel < 0.15, (name, rel)
    kept = precision.convert_to_fp8(
        copy.deepcopy(model), Fp8Config(attention=True, overrides={"pma.attn": "bf16"}), CPU
    )
    assert "pma.attn" not in kept and "seq_tower.0.attn" in kept
    rotary = copy.deepcopy(model)
    rotary.seq_tower[0].attn.rope_base = 1e4
    with pytest.raises(
        ValueError, match=r"seq_tower.0.attn fuses RoPE .*fp8.overrides = \{'seq_tower.0.attn' = 'bf16'\}"
    ):
        precision.convert_to_fp8(rotary, Fp8Config(attention=True), CPU)


def test_counters_and_delayed_scaling_over_steps(setup):
    model, inp, labels = setup
    fp8_model = copy.deepcopy(model)
    precision.convert_to_fp8(fp8_model, Fp8Config(scaling="delayed", amax_history=2, top_layers_bf16=False), CPU)
    precision.collect_counters(fp8_model, True)
    for _ in range(2):
        grads_of(fp8_model, inp, labels)
        precision.after_step(fp8_model)
    counters = precision.counters(fp8_model)
    assert counters["fp8/nonfinite"] == 0
    assert set(counters) >= {"fp8/x_overflow", "fp8/grad_out_underflow", "fp8/w13_overflow"}
    assert all(0.0 <= v <= 1.0 for k, v in counters.items() if k != "fp8/nonfinite")
    stats = dict(precision.fp8_stats(fp8_model))["seq_tower.0.mlp"]
    assert bool((stats.history[:, 0] > 0).all()) and bool((stats.history[:, 1] > 0).all())
    assert precision.counters(fp8_model) == {"fp8/nonfinite": 0.0}  # the read reset them
    amax = stats.amax.clone()
    fp8_model.eval()
    with torch.no_grad():
        fp8_model(inp)  # evaluation: dynamic scales, nothing recorded
    fp8_model.train()
    assert torch.equal(stats.amax, amax) and precision.counters(fp8_model) == {"fp8/nonfinite": 0.0}


def test_emulated_fp8_training_tracks_fp32_on_the_tiny_recipe(movielens_dataset, tmp_path):
    """`train.precision = fp8` end to end on the CPU (the emulation): the same 20 steps as fp32 land within 1%
    relative eval NE per task; the fp8 settings and counters reach MLflow."""
    import mlflow
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.run import run_training

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    summaries = {}
    for precision_name in ("fp32", "fp8"):
        summaries[precision_name] = run_training(
            load_recipe("tiny", [f"train.precision={precision_name}", "checkpoint.every=0", "train.local_mfu=false"]),
            dataset=movielens_dataset,
            data_addr=None,
            run_dir=tmp_path / precision_name,
            tracking_uri=uri,
            experiment="fp8-test",
            metrics_out=None,
            resume=False,
            progress=False,
            log_model=False,
        )
    for task, ne in summaries["fp32"]["ne"].items():
        assert summaries["fp8"]["ne"][task] == pytest.approx(ne, rel=0.01), task
    run = mlflow.MlflowClient(uri).get_run(summaries["fp8"]["mlflow"]["run_id"])
    assert run.data.params["train.precision"] == "fp8" and run.data.params["fp8.grad_format"] == "e4m3"
    assert run.data.params["fp8_modules"] == "2"  # seq_tower.0.mlp, pma.mlp: the top layers stay bf16
    assert run.data.metrics["train/fp8/nonfinite"] == 0 and "train/fp8/grad_out_underflow" in run.data.metrics
