"""Trainer pieces without a training run: metrics, recipes, LR schedule, checkpoints, data order."""

import copy
import math

import numpy as np
import pytest
import torch
from gemrec.components.data_service.balance import DEFAULT_LINEAR_WEIGHT
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.checkpoint import CheckpointError, CheckpointManager
from gemrec.components.trainer.config import (
    RecipeError,
    available_recipes,
    balance_linear_weight,
    load_recipe,
)
from gemrec.components.trainer.data import eval_row_chunks
from gemrec.components.trainer.mfu import measure_local_mfu
from gemrec.components.trainer.optim import Optimizers, apply_sparse_optimizer
from gemrec.components.trainer.parallel import ParallelConfig
from gemrec.config import ConfigError
from gemrec.kernels import KernelOptions
from gemrec.model import ModelConfig


def test_ne_matches_hand_computation():
    labels = np.array([1, 0, 0, 1])
    preds = np.array([0.8, 0.3, 0.1, 0.6])
    log_loss = -(math.log(0.8) + math.log(0.7) + math.log(0.9) + math.log(0.6)) / 4
    entropy = -(0.5 * math.log(0.5) + 0.5 * math.log(0.5))
    assert qm.normalized_entropy(labels, preds) == pytest.approx(log_loss / entropy, rel=1e-12)
    # Predicting the base rate itself scores exactly 1.
    assert qm.normalized_entropy(labels, np.full(4, 0.5)) == pytest.approx(1.0, rel=1e-12)
    # An explicit base rate (e.g. from the training labels) changes only the denominator.
    rate = 0.25
    h = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert qm.normalized_entropy(labels, preds, base_rate=rate) == pytest.approx(log_loss / h, rel=1e-12)
    assert math.isnan(qm.normalized_entropy(np.ones(3), np.full(3, 0.9)))


def test_auc_matches_hand_computation_with_ties():
    # Positives 0.35, 0.8; negatives 0.1, 0.4: pairs (pos > neg) = 0.8>0.1, 0.8>0.4, 0.35>0.1 -> 3 of 4.
    assert qm.roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    # A tie between a positive and a negative counts one half: pairs 1 + 0.5 + 1 + 1 = 3.5 of 4.
    assert qm.roc_auc(np.array([1, 0, 1, 0]), np.array([0.5, 0.5, 0.9, 0.2])) == pytest.approx(0.875)
    assert qm.roc_auc(np.array([1, 1, 0]), np.array([0.9, 0.8, 0.1])) == 1.0
    assert math.isnan(qm.roc_auc(np.zeros(4), np.arange(4.0)))


def test_calibration_and_task_metrics():
    labels = np.array([[1, 0], [0, 0], [1, 1], [0, 0]], dtype=np.float32)
    logits = np.zeros((4, 2))  # every prediction 0.5
    out = qm.task_metrics(labels, logits, ["like", "love"])
    assert out["like"]["calibration"] == pytest.approx(1.0)  # 0.5 / 0.5
    assert out["love"]["calibration"] == pytest.approx(2.0)  # 0.5 / 0.25
    assert out["like"]["ne"] == pytest.approx(1.0)
    assert out["love"]["base_rate"] == 0.25 and out["love"]["count"] == 4


def test_logit_offsets_make_the_mean_prediction_the_observed_rate():
    # Constant logits 0 and a rate of 1/4: the offset is logit(1/4) exactly.
    labels = np.array([[1, 0, 1], [0, 0, 1], [0, 0, 1], [0, 0, 1]], dtype=np.float32)
    offsets = qm.logit_offsets(labels, np.zeros((4, 3)))
    assert offsets[0] == pytest.approx(math.log(0.25 / 0.75), abs=1e-9)
    assert offsets[1] == offsets[2] == 0.0  # one class only: no finite optimum, left alone
    # Labels drawn from sigmoid(z), the model's logits z - 1.5 (under-predicting): the fit undoes the shift, and at the
    # optimum the mean prediction is the observed rate, which a shifted or unfitted offset is not.
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 2.0, size=(20000, 2))
    labels = (rng.random(z.shape) < qm.sigmoid(z)).astype(np.float32)
    logits = z - np.array([1.5, -0.5])
    offsets = qm.logit_offsets(labels, logits)
    assert offsets == pytest.approx([1.5, -0.5], abs=0.06)
    calibrated = qm.task_metrics(labels, logits + offsets, ["a", "b"])
    assert [calibrated[t]["calibration"] for t in "ab"] == pytest.approx([1.0, 1.0], abs=1e-6)
    before = qm.task_metrics(labels, logits, ["a", "b"])
    assert all(calibrated[t]["log_loss"] < before[t]["log_loss"] for t in "ab")
    assert qm.logit_offsets(np.zeros((0, 2)), np.zeros((0, 2))).tolist() == [0.0, 0.0]


def test_metric_keys_are_names_mlflow_accepts():
    from gemrec.components.trainer.tracking import metric_key

    assert metric_key("ndcg@10") == "ndcg_at_10"
    assert metric_key("window (seed 1)") == "window seed 1"
    assert metric_key("ne_click/gem-2.0:a b") == "ne_click/gem-2.0:a b"


def test_recipes_load_and_overrides_are_checked():
    assert {"tiny", "movielens", "synth", "h200-bench"} <= set(available_recipes())
    config = load_recipe("tiny", ["train.steps=7", "optim.dense_lr=0.5", "model.d_model=16"], arch="dlrm")
    assert (config.train.steps, config.optim.dense_lr, config.model.arch, config.model.d_model) == (7, 0.5, "dlrm", 16)
    assert isinstance(config.model, ModelConfig) and isinstance(config.parallel, ParallelConfig)
    assert load_recipe("h200-bench").parallel.param_dtype == "bfloat16"
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    with pytest.raises(ConfigError, match=r"unknown setting train.stepz = 3; \[train\] takes .*steps"):
        load_recipe("tiny", ["train.stepz=3"])
    with pytest.raises(ConfigError, match="train.steps = 'many': must be an integer"):
        load_recipe("tiny", ["train.steps=many"])
    with pytest.raises(ConfigError, match="section.key"):
        load_recipe("tiny", ["steps=3"])
    with pytest.raises(ConfigError, match="data.max_seq_len = 40000 exceeds model.rotary_max_positions = 32768"):
        load_recipe("tiny", ["data.max_seq_len=40000"])
    assert load_recipe("tiny", ["data.max_seq_len=40000", "model.rotary_max_positions=40000"]).data.max_seq_len == 40000
    with pytest.raises(ConfigError, match=r"unknown setting model.bogus = 1; \[model\] takes .*arch"):
        load_recipe("tiny", ["model.bogus=1"])
    with pytest.raises(ConfigError, match=r"unknown setting parallel.bogus = 1; \[parallel\] takes .*dp_shard"):
        load_recipe("tiny", ["parallel.bogus=1"])
    with pytest.raises(ConfigError, match="model.arch = 'bert': must be one of 'gem', 'dlrm'"):
        load_recipe("tiny", ['model.arch="bert"'])
    with pytest.raises(ConfigError, match="parallel.activation_checkpoint = 'some': must be one of 'none', 'full'"):
        load_recipe("tiny", ["parallel.activation_checkpoint=some"])
    with pytest.raises(ConfigError, match="train.precision = 'fp16': must be one of 'auto', 'bf16', 'fp32'"):
        load_recipe("tiny", ["train.precision=fp16"])
    with pytest.raises(ConfigError, match="data.batch_size = 0: must be > 0"):
        load_recipe("tiny", ["data.batch_size=0"])
    with pytest.raises(ConfigError, match="unknown section.*trian; this takes model, kernels, parallel, data"):
        load_recipe("tiny", ["trian.steps=3"])
    kernels = load_recipe("tiny", ["kernels.tma=false"]).kernels
    assert isinstance(kernels, KernelOptions) and kernels == KernelOptions(tma=False)
    with pytest.raises(ConfigError, match="kernels.gluon = 'no': must be true or false"):
        load_recipe("tiny", ["kernels.gluon=no"])
    flat = load_recipe("tiny", ["kernels.autotune=false"]).flat()  # the MLflow params: every section, every key
    assert flat["kernels.autotune"] is False and flat["model.arch"] == "gem" and flat["seqrec.gem_loss"] == "softmax"
    # The data service's balancing weight follows the model: causal, 4x MLP -> 12 x d_model; no sequence -> default.
    assert balance_linear_weight(load_recipe("h200-bench")) == 12 * 1024
    assert balance_linear_weight(load_recipe("tiny", ["model.seq_causal=false"])) == 6 * 32
    assert balance_linear_weight(load_recipe("movielens", arch="dlrm")) == DEFAULT_LINEAR_WEIGHT


def _toy_model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"table": torch.nn.Embedding(10, 4), "dense": torch.nn.Linear(4, 1)})


def test_lr_schedule_and_fused_sparse_optimizer():
    config = load_recipe("tiny", ["optim.warmup_steps=4", "optim.min_lr_ratio=0.1", 'optim.decay="cosine"']).optim
    model = _toy_model()
    apply_sparse_optimizer(model, config)
    opts = Optimizers(model, config, total_steps=20)
    assert set(opts.sparse_params) == {"table.weight"}
    assert [round(opts.lr_factor(s), 6) for s in (0, 3, 4)] == [0.25, 1.0, 1.0]
    assert opts.lr_factor(20) == pytest.approx(0.1)
    before = model["table"].weight.detach().clone()
    out = model["dense"](model["table"](torch.tensor([1, 2]))).sum()
    out.backward()
    # The table was updated in backward (rows 1 and 2 only) and its gradient freed.
    assert model["table"].weight.grad is None
    changed = (model["table"].weight.detach() != before).any(1)
    assert changed.tolist() == [i in (1, 2) for i in range(10)]
    opts.clip_and_step()
    assert opts.scheduler.last_epoch == 1


def test_checkpoint_is_atomic_and_restores_state(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    state = {"w": torch.arange(4.0), "cursor": {"position": 3}}
    manager.save(5, state)
    manager.save(10, {"w": torch.arange(4.0) * 2, "cursor": {"position": 7}})
    # A crash mid-save leaves a partial temporary folder: `latest` still names the last complete one.
    (tmp_path / "ckpt" / ".step_00000015.tmp").mkdir()
    assert manager.latest().name == "step_00000010"
    template = {"w": torch.zeros(4), "cursor": {"position": 0}}
    meta = manager.load(template)
    assert (
        meta["step"] == 10 and template["cursor"]["position"] == 7 and torch.equal(template["w"], torch.arange(4.0) * 2)
    )
    manager.save(15, state)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000010", "step_00000015"]


def test_checkpoint_before_the_logit_offset_loads_and_another_model_is_refused(tmp_path):
    """A checkpoint written before `heads.logit_offset` existed resumes with the offset at 0; a checkpoint missing any
    other model entry is refused by name."""
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    manager.save(5, {"model": {"heads.trunk.weight": torch.ones(2, 2)}, "progress": {"step": 5}})
    template = {
        "model": {"heads.trunk.weight": torch.zeros(2, 2), "heads.logit_offset": torch.zeros(2)},
        "progress": {"step": 0},
    }
    assert manager.load(template)["step"] == 5
    assert torch.equal(template["model"]["heads.trunk.weight"], torch.ones(2, 2))
    assert torch.equal(template["model"]["heads.logit_offset"], torch.zeros(2))
    template["model"]["seq_tower.0.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match=r"lacks model entries \['seq_tower.0.weight'\]"):
        manager.load(template)
    assert set(template["model"]) == {"heads.trunk.weight", "heads.logit_offset", "seq_tower.0.weight"}


def test_eval_chunks_cover_rows_once_with_equal_batch_counts():
    chunks = [eval_row_chunks(103, 0, 10, rank, 3) for rank in range(3)]
    assert len({len(c) for c in chunks}) == 1
    rows = np.concatenate([np.concatenate(c) for c in chunks])
    assert sorted(rows.tolist()) == list(range(103))
    subset = np.concatenate(eval_row_chunks(1000, 100, 32, 0, 1))
    assert len(subset) == 100 and len(set(subset.tolist())) == 100


def test_local_mfu_measures_each_layer_without_touching_the_model():
    model = _toy_model()
    apply_sparse_optimizer(model, load_recipe("tiny").optim)
    ids = torch.tensor([1, 2, 3])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flops = {"dense": (2 * 3 * 4, 4 * 3 * 4), "table": (0, 0)}
    local, rows = measure_local_mfu(
        model, flops, lambda: model["dense"](model["table"](ids)), 1e9, torch.device("cpu"), repeats=2
    )
    assert [r.name for r in rows] == ["dense"] and rows[0].seconds > 0
    assert local == pytest.approx(rows[0].mfu)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rowwise_adagrad_without_torchrec_matches_torchrec():
    from gemrec.components.trainer.optim import RowWiseAdagrad
    from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad

    gen = torch.Generator().manual_seed(0)
    start = torch.randn(50, 8, generator=gen)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_ours, opt_theirs = RowWiseAdagrad([ours], lr=0.1, eps=1e-8), TorchrecRowWiseAdagrad([theirs], lr=0.1, eps=1e-8)
    for _ in range(4):
        grad = torch.randn(50, 8, generator=gen) * (torch.rand(50, 1, generator=gen) < 0.3)  # most rows untouched
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    torch.testing.assert_close(ours.detach(), theirs.detach())
    assert opt_ours.state[ours]["sum"].shape == (50, 1)
    with pytest.raises(ValueError, match="lr must be > 0"):
        RowWiseAdagrad([ours], lr=0.0)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_folded_into_fused_adamw_matches_clip_then_step(max_norm):
    overrides = [f"optim.grad_clip={max_norm}", "optim.warmup_steps=0", 'optim.decay="constant"']
    config = load_recipe("tiny", overrides).optim
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    reference = copy.deepcopy(model)
    opts = Optimizers(model, config, total_steps=4)
    assert opts.dense.defaults["fused"]
    plain = torch.optim.AdamW(
        [
            {"params": [p for p in reference.parameters() if p.ndim >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=config.dense_lr,
        betas=config.betas,
        eps=config.eps,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 6, generator=gen) * 5
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        norm = opts.clip_and_step()
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        plain.step()
        plain.zero_grad()
        torch.testing.assert_close(norm, expected)
    assert (norm > max_norm) == (max_norm < 1)  # the small limit clips, the large one does not
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_weight_average_follows_the_weights_and_is_applied_only_inside_its_block():
    from gemrec.components.trainer.optim import WeightAverage

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model.register_buffer("edges", torch.tensor([-math.inf, 0.0, math.inf]))  # PLE bins' open ends
    start = {k: v.clone() for k, v in model.state_dict().items()}
    average = WeightAverage(model, decay=0.5)
    expected = start["0.weight"].clone()
    for n in range(3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        average.update()
        decay = min(0.5, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * model[0].weight.detach()
    live = model[0].weight.detach().clone()
    torch.testing.assert_close(live, start["0.weight"] + 3.0)
    with average.applied():
        torch.testing.assert_close(model[0].weight.detach(), expected)
        assert torch.equal(model[1].num_batches_tracked, start["1.num_batches_tracked"])  # buffers untouched
        assert torch.equal(model.edges, start["edges"])
    assert torch.equal(model[0].weight.detach(), live)
    # A checkpoint round trip restores the average and its ramp; copy_to_model leaves the average in the model.
    restored = WeightAverage(model, decay=0.5)
    restored.load_state_dict(average.state_dict())
    # Parameters only: the running statistics (and constant buffers) stay the live ones.
    assert restored.updates == 3 and restored.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    restored.copy_to_model()
    torch.testing.assert_close(model[0].weight.detach(), expected)
    with pytest.raises(ValueError, match="decay must be in"):
        WeightAverage(model, decay=1.0)


def test_local_mfu_of_compiled_layers_compiles_each_layer_once():
    """A compiled step's layers are measured compiled (local MFU must bound the compiled step's E2E MFU)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _toy_model()
    ids = torch.tensor([1, 2, 3])
    flops = {"dense": (2 * 3 * 4, 4 * 3 * 4)}
    _, rows = measure_local_mfu(
        model, flops, lambda: model["dense"](model["table"](ids)), 1e9, torch.device("cpu"), repeats=2, compile=True
    )
    assert [r.name for r in rows] == ["dense"] and rows[0].seconds > 0
    assert counters["stats"]["unique_graphs"] == 1  # one compiled graph, reused by the warm-up and the timing
