"""`gemrec bench quality`: model arms and named variants, every one per seed, on the same data in one invocation."""

import json

import pytest
from gemrec.components.trainer.bench import Arm, parse_variant, run_quality_bench
from gemrec.config import ConfigError


def test_variants_are_parsed_and_bad_ones_named():
    arm = parse_variant("window: model.seq_attention_mask=window model.seq_window=32")
    assert arm == Arm("window", None, ("model.seq_attention_mask=window", "model.seq_window=32"))
    assert parse_variant("""b: model.rope='fused'""").overrides == ("model.rope=fused",)
    for text, message in [
        ("model.seq_window=32", "expected 'NAME: section.key=value ...'"),
        ("my arm: model.seq_window=32", "expected 'NAME: section.key=value ...'"),
        ("window:", "no section.key=value override after 'window'"),
        ("window: seq_window=32", "override key 'seq_window' must be section.key"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_variant(text)


def test_variants_and_seeds_train_in_one_run(synth_dataset, tmp_path):
    out = tmp_path / "quality.json"
    table = run_quality_bench(
        synth_dataset,
        "tiny",
        [Arm("gem", "gem"), parse_variant("window: model.seq_attention_mask=window model.seq_window=2")],
        ["train.steps=3", "train.local_mfu=false", "data.eval_max_examples=128"],
        f"sqlite:///{tmp_path / 'mlruns.db'}",
        "quality-test",
        "cpu",
        out,
        seeds=[0, 1],
    )
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["gem (seed 0)", "window (seed 0)", "gem (seed 1)", "window (seed 1)"]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines() if line.startswith("|")}
    tasks = arms["gem (seed 0)"]["tasks"]
    for seed in (0, 1):
        base, window = arms[f"gem (seed {seed})"], arms[f"window (seed {seed})"]
        assert base["ne"] != window["ne"]  # the mask reached the model: a window of 2 changes what it learns
        relative = 100 * (window["ne"][tasks[0]] / base["ne"][tasks[0]] - 1)
        assert rows[f"window (seed {seed})"][1 + len(tasks)] == f"{relative:+.2f}%"
        assert rows[f"gem (seed {seed})"][1 + len(tasks)] == "+0.00%"
    assert arms["gem (seed 0)"]["ne"] != arms["gem (seed 1)"]["ne"]  # the seed reached the run
    assert "variants window: model.seq_attention_mask=window model.seq_window=2" in table
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    (comparison,) = mlflow.search_runs(
        experiment_names=["quality-test"], filter_string="tags.mlflow.runName = 'quality-tiny'"
    ).run_id
    logged = mlflow.get_run(comparison).data.metrics
    assert logged[f"ne_{tasks[0]}/window seed 1"] == arms["window (seed 1)"]["ne"][tasks[0]]


def test_cli_refuses_bad_arms_and_seeds(capsys, tmp_path):
    from gemrec.cli import main

    for argv, message in [
        (["--arms", ""], "--arms takes gem and/or dlrm (or --variant)"),
        (["--seeds", "0,a"], "--seeds '0,a'"),
        (["--variant", "w"], "--variant 'w': expected"),
    ]:
        assert main(["bench", "quality", "--dataset", str(tmp_path), *argv]) == 2
        assert message in capsys.readouterr().err
