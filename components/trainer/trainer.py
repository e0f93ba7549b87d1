"""The training loop: data -> `Training.step` (the one train step) -> windows of metrics, with validation and early
stopping on the `valid` split and the final evaluation on `eval` (`evaluate.py`), atomic DCP checkpoints
(`checkpoint.py`), a NaN/Inf guard, MFU accounting and reporting to MLflow (`tracking.py`, rank 0 only).

Validation: every `train.eval_every` steps and at the last one; rank 0 computes the followed metric and every rank
counts it (`EarlyStopping`), so all ranks stop at the same step. A better value writes a checkpoint of that step and
marks it best; training stops after `train.patience` validations without one; the best weights are loaded back
before the final evaluation and the export (also when `--resume` finishes a run that already ended).

The guard: losses are checked at every log point, checkpoint and evaluation; parameters (finite, norm not grown
past `checkpoint.max_param_growth` since the previous checkpoint) before a checkpoint is written; and the step
right after a checkpoint marks it healthy when its loss is finite. A stop on a non-finite loss names the last
healthy checkpoint, which `--resume` then starts from."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.checkpoint import CheckpointError, CheckpointManager
from gemrec.components.trainer.config import TrainConfig
from gemrec.components.trainer.distributed import DistContext
from gemrec.components.trainer.evaluate import EarlyStopping, Evaluator
from gemrec.components.trainer.mfu import LayerMFU, device_peak, measure_local_mfu, total_flops
from gemrec.components.trainer.optim import WeightAverage
from gemrec.components.trainer.parallel.balance import RankBalance
from gemrec.components.trainer.parallel.pipeline import training_inputs
from gemrec.components.trainer.tracking import Tracker, run_summary, write_summary
from gemrec.components.trainer.training import peak_memory_gib, set_determinism, setup_training
from gemrec.provenance import git_commit
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from tqdm import tqdm

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, bad data); the message names the step."""


@dataclass
class RunOptions:
    run_dir: Path
    tracking_uri: str
    experiment: str = "gemrec"
    metrics_out: Path | None = None
    resume: bool = False
    progress: bool = True
    log_model: bool = True
    tracking: bool = True  # log to MLflow (rank 0); False: the summary goes to `metrics_out` only
    # Where an ensemble member writes what its coordinator (`ensemble.py`) reads back: `Trainer.handover`.
    member_out: Path | None = None


def total_steps_for(config: TrainConfig, batches_per_epoch: int) -> int:
    if config.train.steps > 0:
        return config.train.steps
    return max(1, math.ceil(config.train.epochs * batches_per_epoch))


class Window:
    """Training statistics between two log points."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.first_step: int | None = None
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.examples = 0
        self.tokens = 0
        self.flops = 0.0
        self.data_waits: list[float] = []  # seconds each step waited for its batch
        self.in_flight = 0  # batches read ahead, summed over the window's steps
        self.build_cpu_s = 0.0  # the data service's CPU seconds for the window's batches
        self.start = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave out time spent on work that is not training (checkpoints, evaluation)."""
        self.start += seconds


def parameter_norm(model: torch.nn.Module, ctx: DistContext) -> float:
    """L2 norm over every parameter of every rank (local shards of sharded ones; replicas count once per rank,
    the same at every checkpoint, so ratios of it are exact); inf or nan when any value is."""
    total = 0.0
    for p in model.parameters():
        local = p.detach()
        local = local.to_local() if hasattr(local, "to_local") else local
        total += float(torch.linalg.vector_norm(local, dtype=torch.float64)) ** 2 if local.numel() else 0.0
    return math.sqrt(ctx.all_reduce_sum(total))


def _losses(evaluation: dict) -> list[float]:
    """The eval log loss of every task."""
    return [v["log_loss"] for v in evaluation.values() if isinstance(v, dict) and "log_loss" in v]


def first_nonfinite(losses: list[torch.Tensor], first_step: int) -> tuple[int, float] | None:
    if not losses:
        return None
    values = torch.stack(losses).float()
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    index = int(bad.nonzero()[0, 0])
    return first_step + index, float(values[index])


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        options: RunOptions,
        stream,
        eval_source,
        schema,
        dataset_info: dict,
        valid_source=None,
    ):
        """`stream` yields training `Batch`es and has `state()/load_state()`; `eval_source()` and `valid_source()`
        give this rank's eval and valid batches (`valid_source` None: the dataset has no valid split);
        `dataset_info` carries name, checksum and the training label base rates."""
        self.config = config
        self.ctx = ctx
        self.options = options
        self.stream = stream
        self.schema = schema
        self.dataset_info = dataset_info
        self.task_names = list(schema.labels)
        self.device = ctx.device

        set_determinism(config.train.seed, config.train.deterministic)
        if self.device.type == "cpu":
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            threads = config.train.threads or max(1, (os.cpu_count() or 1) // local_ranks)
            torch.set_num_threads(threads)
        self.total_steps = total_steps_for(config, dataset_info["batches_per_epoch"])
        self.training = setup_training(
            config, schema, self.device, self.total_steps, ctx.world_size if ctx.distributed else None
        )
        if self.training.parallel is not None:
            log.info("parallel: %s", self.training.parallel.report.as_params())
        self.balance = RankBalance(self.device, profile_every=config.train.log_every)
        self.checkpoints = CheckpointManager(
            options.run_dir / "checkpoints", config.checkpoint.keep, ctx.rank, ctx.barrier, config.checkpoint.every
        )
        self.evaluator = Evaluator(eval_source, self.task_names, self.to_input, self.training.autocast, ctx)
        self.validator = (
            Evaluator(valid_source, self.task_names, self.to_input, self.training.autocast, ctx, split="valid")
            if valid_source is not None
            else None
        )
        self.early = EarlyStopping.for_run(config.train, self.task_names, has_valid=valid_source is not None)
        if config.train.eval_every and valid_source is None:
            log.warning(
                "train.eval_every = %d but the dataset has no valid split: no validation, no early stopping; the "
                "weights of the last step are evaluated (prepare the dataset with --valid-fraction > 0)",
                config.train.eval_every,
            )
        self.step = 0
        self.stream_state: dict | None = None  # the data stream's state after the last trained batch
        self.seen_label_sums = torch.zeros(len(self.task_names), dtype=torch.float64)
        self.seen_examples = 0
        self.seen_lengths: list[np.ndarray] = []
        self.last_checkpoint: Path | None = None
        self.unconfirmed: Path | None = None  # a checkpoint whose next step has not run yet
        self.param_norm: float | None = None  # at the last checkpoint (or the start): the growth reference
        self.resumed_run_id: str | None = None
        self.validated_step: int | None = None  # the step of the last validation's weights
        self.logit_offsets: dict[str, float] | None = None  # what `calibrate` added to the task heads
        self.tracker = Tracker(False, options.tracking_uri, options.experiment, run_name="")  # replaced by `run`
        self.num_params = sum(p.numel() for p in self.training.model.parameters())

    # -- checkpoint state ------------------------------------------------------------------------------

    def state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        average = self.training.average
        return {
            "model": get_model_state_dict(self.training.train_model),
            **({"average": average.state_dict()} if average is not None else {}),
            "optim": self.training.optimizers.state_dict(),
            "data": {f"rank{self.ctx.rank}": self.stream_state or self.stream.state()},
            "rng": {f"rank{self.ctx.rank}": rng},
            "progress": {"step": self.step, "valid": self.early.state_dict()},
        }

    def load_latest(self) -> bool:
        path = self.checkpoints.resume_point()
        diverged = self.checkpoints.diverged()
        if diverged:
            log.warning(
                "--resume: the last run stopped at step %s (%s); resuming from the last healthy checkpoint %s",
                diverged["step"],
                diverged["why"],
                path,
            )
        if path is None:
            log.info("--resume: no checkpoint in %s, starting from step 0", self.checkpoints.dir)
            return False
        template = self.state()
        template["optim"] = self.training.optimizers.empty_state_template()
        if "average" in template and "average" not in self.checkpoints.sections(path):
            del template["average"]
            log.info("--resume: %s has no weight average (optim.weight_average was 0): it starts here", path)
        meta = self.checkpoints.load(template, path)
        if meta.get("dataset_checksum") not in (None, self.dataset_info.get("checksum")):
            raise TrainingError(
                f"checkpoint {path} was written for dataset {meta.get('dataset_checksum')}, "
                f"not {self.dataset_info.get('checksum')}"
            )
        set_model_state_dict(self.training.train_model, template["model"])
        if self.training.average is not None:
            if "average" in template:
                self.training.average.load_state_dict(template["average"])
            else:
                self.training.average = WeightAverage(self.training.model, self.config.optim.weight_average)
        self.training.optimizers.load_state_dict(template["optim"])
        self.stream.load_state(template["data"][f"rank{self.ctx.rank}"])
        rng = template["rng"][f"rank{self.ctx.rank}"]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = int(template["progress"]["step"])
        self.early.load_state_dict(template["progress"]["valid"])
        self.last_checkpoint = path
        self.param_norm = meta.get("param_norm")
        self.resumed_run_id = meta.get("mlflow_run_id")
        log.info("resumed from %s at step %d", path, self.step)
        return True

    def save_checkpoint(self) -> Path:
        """Write a checkpoint unless the parameters are non-finite or exploded (then stop, naming the step)."""
        norm = parameter_norm(self.training.model, self.ctx)
        if not math.isfinite(norm):
            self.diverged(f"parameters are non-finite after step {self.step}")
        growth = norm / self.param_norm if self.param_norm else 1.0
        if growth > self.config.checkpoint.max_param_growth:
            self.diverged(
                f"the parameter norm grew {growth:.3g}x (from {self.param_norm:.4g} to {norm:.4g}) by step "
                f"{self.step}, past checkpoint.max_param_growth = {self.config.checkpoint.max_param_growth:g}"
            )
        meta = {
            "dataset_checksum": self.dataset_info.get("checksum"),
            "recipe": self.config.recipe,
            "mlflow_run_id": self.tracker.run_id,
            "param_norm": norm,
        }
        self.last_checkpoint = self.checkpoints.save(self.step, self.state(), meta)
        self.unconfirmed, self.param_norm = self.last_checkpoint, norm
        return self.last_checkpoint

    def confirm_checkpoint(self, loss: torch.Tensor) -> None:
        """The step after a checkpoint: a finite loss (on every rank) marks it healthy."""
        if self.unconfirmed is None:
            return
        bad = self.ctx.all_reduce_sum(0.0 if bool(torch.isfinite(loss)) else 1.0)
        if bad:
            self.diverged(f"loss is {float(loss)} at step {self.step}, the step after checkpoint {self.unconfirmed}")
        self.checkpoints.mark_healthy(self.unconfirmed)
        self.unconfirmed = None

    def diverged(self, why: str):
        """Stop: record the divergence (`--resume` then starts from the last healthy checkpoint) and raise."""
        self.checkpoints.mark_diverged(self.step, why)
        healthy = self.checkpoints.healthy()
        where = (
            f"the last healthy checkpoint is {healthy} (--resume starts from it)"
            if healthy
            else "no healthy checkpoint was written before it"
        )
        raise TrainingError(f"{why}: training stopped; {where}")

    def check_finite(self, window: Window) -> None:
        if window.first_step is None:
            return
        bad = first_nonfinite(window.losses, window.first_step)
        if bad is None:
            return
        step, value = bad
        self.diverged(f"loss is {value} at step {step}")

    # -- evaluation and export -------------------------------------------------------------------------

    def evaluate(self, evaluator: Evaluator) -> dict | None:
        """NE, AUC and calibration per task on the evaluator's split (a collective); the result on rank 0."""
        return evaluator.evaluate(
            self.training.model, lambda: self.dataset_info.get("train_base_rates") or self.observed_train_rates()
        )

    def validate(self, validator: Evaluator) -> bool:
        """Validate (a collective), log `valid/*`, count the followed metric on every rank; True when it improved.
        With `optim.weight_average` the averaged weights are validated (and kept when better: they are checkpointed)."""
        average = self.training.average
        with average.applied() if average is not None else contextlib.nullcontext():
            result = self.evaluate(validator)
        self.tracker.log_eval(self.step, result, split="valid")
        self.validated_step = self.step  # the validator's predictions are of this step's weights
        value = self.ctx.broadcast_from_main(self.early.value(result) if result is not None else 0.0)
        improved = self.early.update(self.step, value)
        log.info(
            "valid %s %.4f at step %d in %.1f s (best %.4f at step %d%s)",
            self.early.metric,
            value,
            self.step,
            validator.seconds,
            self.early.best,
            self.early.best_step,
            f", stopping: {self.early.stale} validations without a better one" if self.early.stop else "",
        )
        return improved

    def restore_best(self) -> int:
        """Load the best validated weights (model only) unless they are the current ones; the step of the weights.
        With `optim.weight_average` the model holds those weights' average afterwards (what was validated)."""
        best, average = self.checkpoints.best(), self.training.average
        if not self.early.active or best is None or self.early.best_step == self.step:
            if average is not None:
                average.copy_to_model()
            return self.step
        template = {"model": get_model_state_dict(self.training.train_model)}
        if average is not None:
            template["average"] = average.state_dict()
        self.checkpoints.load(template, best)
        set_model_state_dict(self.training.train_model, template["model"])
        if average is not None:
            average.load_state_dict(template["average"])
            average.copy_to_model()
        self.last_checkpoint = best
        log.info(
            "restored the best weights of step %d (valid %s %.4f) from %s",
            self.early.best_step,
            self.early.metric,
            self.early.best,
            best,
        )
        return self.early.best_step

    def calibrate(self, weights_step: int) -> dict[str, float] | None:
        """Fit one logit offset per task on the valid split (never eval) with the weights to be evaluated and add it
        to the task heads' `logit_offset` buffer, so the evaluation, the export and what serves it use it. Reuses
        the last validation's predictions when they are of these weights. None without validation or with
        `train.calibrate = false`; else the offsets added, by task (a collective)."""
        if self.validator is None or not (self.config.train.calibrate and self.early.active):
            return None
        offset = self.training.model.get_buffer("heads.logit_offset")  # gem and dlrm: `TaskHeads`
        if self.validated_step != weights_step:
            self.validator.predict(self.training.model)
        predictions = self.validator.predictions
        fitted = qm.logit_offsets(*predictions) if self.ctx.is_main and predictions is not None else None
        offsets = [
            self.ctx.broadcast_from_main(float(fitted[j]) if fitted is not None else 0.0)
            for j in range(len(self.task_names))
        ]
        with torch.no_grad():
            offset += torch.tensor(offsets, dtype=offset.dtype, device=offset.device)
        if predictions is not None:  # the validator's predictions stay those of the model as it now is
            labels, logits = predictions
            self.validator.predictions = (labels, logits + np.asarray(offsets, dtype=logits.dtype))
        self.validated_step = weights_step
        added = dict(zip(self.task_names, offsets))
        self.tracker.log_metrics(
            {f"valid/logit_offset_{name}": value for name, value in added.items()}, step=weights_step
        )
        log.info(
            "calibrated on the valid split: logit offsets %s",
            ", ".join(f"{name} {value:+.4f}" for name, value in added.items()),
        )
        self.logit_offsets = added
        return added

    def export_model(self):
        """A clean CPU copy of the trained model (no optimizer hooks, no wrappers) for MLflow, on rank 0.

        A collective: every rank takes part in gathering sharded parameters (FSDP2 DTensors, torchrec
        ShardedTensors) into full tensors; the other ranks get None.
        """
        from gemrec.model import build_model

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.training.model, options=options)
        if not self.ctx.is_main:
            return None
        model = build_model(self.config.model, self.schema, self.config.kernels)
        model.load_state_dict(state)
        return model.eval()

    def handover(self, exported: torch.nn.Module, weights_step: int) -> dict:
        """What an ensemble member (one process) gives its coordinator: the evaluated weights, their (labels, logits)
        on the valid split (None without one) and on eval, the training label rates, the training windows and the
        dataset."""
        valid = None
        if self.validator is not None:
            if self.validated_step != weights_step:
                self.validator.predict(self.training.model)
            valid = self.validator.predictions
        return {
            "model": exported,
            "valid": valid,
            "eval": self.evaluator.predictions,
            "train_rates": self.dataset_info.get("train_base_rates") or self.observed_train_rates(),
            "history": self.tracker.history,
            "dataset": {key: self.dataset_info.get(key) for key in ("name", "checksum", "train_seq_lengths")},
        }

    def observed_train_rates(self) -> dict[str, float]:
        """Positive rate per label over the training batches this run consumed (all ranks)."""
        examples = self.ctx.all_reduce_sum(float(self.seen_examples))
        sums = [self.ctx.all_reduce_sum(float(v)) for v in self.seen_label_sums]
        return {n: sums[i] / examples for i, n in enumerate(self.task_names)} if examples else {}

    def valid_summary(self) -> dict | None:
        """What validation decided (None without validation): the followed metric, its best value and step."""
        if not self.early.active:
            return None
        best = self.checkpoints.best()
        return {
            "metric": self.early.metric,
            "best": self.early.best,
            "best_step": self.early.best_step,
            "validations": self.early.validations,
            "stopped_early": self.early.stop,
            "max_steps": self.total_steps,
            "best_checkpoint": str(best) if best else None,
            "logit_offsets": self.logit_offsets,
        }

    def to_input(self, batch):
        from gemrec.components.trainer.data import to_model_input

        return to_model_input(batch).to(self.device, non_blocking=True)

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, ctx = self.config, self.ctx
        if cfg.checkpoint.every or self.early.active:  # the best validated weights are a checkpoint too
            try:
                self.checkpoints.check_writable()
            except CheckpointError as err:
                raise TrainingError(str(err)) from None
        if self.options.resume:
            self.load_latest()
        else:
            self.checkpoints.clear()
        if self.param_norm is None:
            self.param_norm = parameter_norm(self.training.model, ctx)
        self.peak = device_peak(self.device, self.training.bf16)
        self.tracker = Tracker(
            ctx.is_main and self.options.tracking,
            self.options.tracking_uri,
            self.options.experiment,
            run_name=f"{cfg.recipe}-{cfg.model.arch}",
            resume_run_id=self.resumed_run_id,
        )
        try:
            if self.tracker.resumed:
                self.tracker.set_tags({f"resumed_at_step_{self.step}": str(self.last_checkpoint)})
            else:
                self._log_start()
            totals, last_input = self.train()
            weights_step = self.restore_best()
            self.calibrate(weights_step)
            final_eval = self.evaluate(self.evaluator)
            self.tracker.log_eval(weights_step, final_eval)  # at the step of the weights it evaluated
            if self.unconfirmed is not None and final_eval and all(map(math.isfinite, _losses(final_eval))):
                self.checkpoints.mark_healthy(self.unconfirmed)  # the last one: no next step, the eval vouches
            result = self._finish(final_eval, totals, last_input, weights_step)
        except BaseException:
            self.tracker.finish("FAILED")
            raise
        self.tracker.finish()
        return result

    def _log_start(self) -> None:
        cfg, peak = self.config, self.peak
        self.tracker.log_start(
            cfg.to_dict(),
            {
                **cfg.flat(),
                "world_size": self.ctx.world_size,
                "num_params": self.num_params,
                "total_steps": self.total_steps,
                "sparse_optimizer": self.training.sparse_optimizer,
                "fp8_modules": len(self.training.fp8_modules),
                "activation_checkpointed": ",".join(self.training.checkpointed) or "none",
            },
            {
                "git_commit": git_commit(),
                "dataset_checksum": self.dataset_info.get("checksum"),
                "dataset": self.dataset_info.get("name"),
                "device": peak.device,
                "world_size": self.ctx.world_size,
                "recipe": cfg.recipe,
                "arch": cfg.model.arch,
                "peak_flops": f"{peak.flops:.4g} ({peak.source})",
            },
            self.dataset_info.get("train_seq_lengths"),
            cfg.data.max_seq_len,
        )

    def train(self) -> tuple[dict[str, float], object]:
        """Train from `self.step` to the last step; returns the totals over the timed windows (all ranks; windows
        ending by `train.untimed_steps` left out) and the last device input (for the local MFU)."""
        cfg, ctx, training, peak = self.config, self.ctx, self.training, self.peak
        log.info(
            "training %s (%s, %.2fM params) for %d steps from step %d on %s x%d; peak %.3g FLOP/s (%s)",
            cfg.recipe,
            cfg.model.arch,
            self.num_params / 1e6,
            self.total_steps,
            self.step,
            peak.device,
            ctx.world_size,
            peak.flops,
            peak.source,
        )
        if self.early.stop:
            log.info("early stopping ended this run at step %d: nothing left to train", self.step)
        window = Window()
        totals = {"examples": 0.0, "tokens": 0.0, "flops": 0.0, "seconds": 0.0, "data_wait_s": 0.0}
        totals.update({"steps": 0.0, "in_flight": 0.0, "build_cpu_s": 0.0, "peak_memory_gib": 0.0})
        self.data_waits: list[float] = []  # every timed step's wait for data (this rank)
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (ctx.is_main and self.options.progress),
            desc=f"train {cfg.model.arch}",
            unit="step",
            mininterval=1.0,
            dynamic_ncols=True,
        )
        # read ahead, pinned and copied to the device on a side stream; pipelined when the tables are sharded
        batches = training_inputs(training.parallel, self.stream, self.device, cfg.data.device_prefetch)
        training.train_model.train()
        try:
            last_input = self._train_steps(batches, window, totals, bar)
        finally:
            batches.close()  # stop reading ahead
        bar.close()
        return totals, last_input

    def _train_steps(self, batches, window: Window, totals: dict[str, float], bar):
        from gemrec.model import model_flops

        cfg, training, last_input = self.config, self.training, None
        while self.step < self.total_steps and not self.early.stop:
            waiting = time.perf_counter()
            item = next(batches)
            window.data_waits.append(time.perf_counter() - waiting)
            window.in_flight += item.in_flight
            window.build_cpu_s += item.build_cpu_s
            batch, labels, device_input, self.stream_state = item.batch, item.labels, item.device, item.state
            # FLOPs from the host-side lengths: no device sync.
            window.flops += total_flops(model_flops(training.model, item.host))
            with self.balance.step():  # per-rank compute time; every log_every-th step profiled
                result = training.step(device_input, labels)
            self.step += 1
            self.confirm_checkpoint(result.loss)
            if training.parallel is not None:
                training.parallel.after_step(self.step)
            if window.first_step is None:
                window.first_step = self.step
            window.losses.append(result.loss)
            if result.output is not None:  # the trainer's steps always run the model's multi-task loss
                window.logits.append(result.output.logits.detach().float())
            window.labels.append(labels)
            self.seen_label_sums += batch.labels.sum(0).double()
            self.seen_examples += batch.batch_size
            if self.dataset_info.get("train_seq_lengths") is None and len(self.seen_lengths) < 200:
                self.seen_lengths.append(batch.seq_lengths().numpy())
            window.examples += batch.batch_size
            window.tokens += batch.num_tokens
            last_input = device_input
            bar.update(1)

            last, improved = self.step == self.total_steps, False
            if self.validator is not None and self.early.due(self.step, last):
                self.check_finite(window)
                improved = self.validate(self.validator)
                window.exclude(self.validator.seconds)
                last = last or self.early.stop
            if last:
                batches.close()  # stop reading ahead before evaluation
            if self.step % cfg.train.log_every == 0 or last:
                self.check_finite(window)
                self._log_window(window, totals, bar)
                window.reset()
            if (self.step + 1) % cfg.train.log_every == 0:
                training.fp8_counters(collect_next=True)  # FP8 overflow/underflow: count the logging steps
            if self.checkpoints.due(self.step, last) or improved:
                self.check_finite(window)
                saved = self.save_checkpoint()
                window.exclude(self.checkpoints.seconds)
                if improved:  # validated: best, and healthy without waiting for the next step
                    self.checkpoints.mark_best(saved)
                    self.unconfirmed = None
        return last_input

    def _log_window(self, window: Window, totals: dict[str, float], bar) -> None:
        ctx = self.ctx
        seconds = ctx.all_reduce_max(time.perf_counter() - window.start)
        examples = ctx.all_reduce_sum(float(window.examples))
        tokens = ctx.all_reduce_sum(float(window.tokens))
        flops = ctx.all_reduce_sum(window.flops)
        steps = len(window.data_waits)
        waited = ctx.all_reduce_max(sum(window.data_waits))  # the slowest-fed rank holds the others at the step
        build_cpu_s = ctx.all_reduce_sum(window.build_cpu_s) / ctx.world_size
        peak_memory = peak_memory_gib(self.device)  # of this window's steps (CUDA only)
        if peak_memory is not None:
            peak_memory = ctx.all_reduce_max(peak_memory)  # the fullest rank's
            totals["peak_memory_gib"] = max(totals["peak_memory_gib"], peak_memory)
        if self.step > self.config.train.untimed_steps:
            for key, value in (("examples", examples), ("tokens", tokens), ("flops", flops), ("seconds", seconds)):
                totals[key] += value
            totals["data_wait_s"] += waited
            totals["steps"] += steps
            totals["in_flight"] += window.in_flight
            totals["build_cpu_s"] += build_cpu_s
            self.data_waits += window.data_waits
        loss = float(torch.stack(window.losses).float().mean())
        logits = torch.cat(window.logits).cpu().numpy()
        labels = torch.cat(window.labels).float().cpu().numpy()
        record = {
            "step": self.step,
            "loss": loss,
            "qps": examples / seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": flops / seconds / (self.peak.flops * ctx.world_size),
            "lr": self.training.optimizers.dense.param_groups[0]["lr"],
            "data_wait_ms_p50": 1000 * float(np.percentile(window.data_waits, 50)),
            "data_wait_ms_p99": 1000 * float(np.percentile(window.data_waits, 99)),
            "data_wait_share": waited / seconds,
            "batches_in_flight": window.in_flight / steps,
            "data_service_cpu_ms": 1000 * build_cpu_s / steps,
        }
        if peak_memory is not None:
            record["peak_memory_gib"] = peak_memory
        preds = qm.sigmoid(logits)
        for j, name in enumerate(self.task_names):
            record[f"ne_{name}"] = qm.normalized_entropy(labels[:, j], preds[:, j])
        record.update(self.balance.window())  # rank_imbalance, exposed_comm_s, ... (a collective)
        record.update(self.training.fp8_counters(collect_next=False))  # this rank's fp8/* counters
        self.tracker.log_train(record)
        bar.set_postfix(loss=f"{loss:.4f}", qps=f"{record['qps']:.0f}", mfu=f"{100 * record['mfu']:.2f}%")
        if bar.disable:  # no bar to show the window: one log line, so a run stopped early still shows its progress
            log.info(
                "step %d: loss %.4f, %.0f QPS, MFU %.2f%%, data wait p50 %.2f ms (%.1f%% of the window)",
                self.step,
                loss,
                record["qps"],
                100 * record["mfu"],
                record["data_wait_ms_p50"],
                100 * record["data_wait_share"],
            )

    def _finish(self, final_eval: dict | None, totals: dict[str, float], last_input, weights_step: int) -> dict:
        """Local MFU, the exported model and the report (all ranks take part; the summary on rank 0)."""
        from gemrec.model import build_model, model_flops

        cfg, ctx, peak = self.config, self.ctx, self.peak
        local, layers = float("nan"), list[LayerMFU]()
        if cfg.train.local_mfu and last_input is not None:
            model = self.training.model
            if self.training.parallel is not None:
                # Sharded layers cannot run alone on one rank: time them on an unsharded single-device replica.
                model = build_model(cfg.model, self.schema, cfg.kernels).to(self.device)
            local, layers = measure_local_mfu(
                model,
                model_flops(model, last_input),
                lambda: model(last_input),
                peak.flops,
                self.device,
                self.training.autocast,
                cfg.train.local_mfu_repeats,
                compile=cfg.train.compile,
            )
        exported = self.export_model() if self.options.log_model or self.options.member_out else None
        if self.options.member_out is not None and exported is not None:
            torch.save(self.handover(exported, weights_step), self.options.member_out)
        if not ctx.is_main or final_eval is None:
            return {}
        layer_rows = [{"name": r.name, "flops": r.flops, "seconds": r.seconds, "mfu": r.mfu} for r in layers]
        summary = run_summary(
            recipe=cfg.recipe,
            arch=cfg.model.arch,
            steps=self.step,
            world_size=ctx.world_size,
            final_eval=final_eval,
            totals=totals,
            data_waits=self.data_waits,
            data_source=self.stream.kind,
            peak=peak.as_dict(),
            local_mfu=local,
            layer_rows=layer_rows,
            train_loss=self.tracker.history[-1]["loss"] if self.tracker.history else float("nan"),
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            valid=self.valid_summary(),
            mlflow={
                "tracking_uri": self.options.tracking_uri,
                "experiment": self.options.experiment,
                "run_id": self.tracker.run_id,
            },
            dataset={"name": self.dataset_info.get("name"), "checksum": self.dataset_info.get("checksum")},
        )
        seen = np.concatenate(self.seen_lengths) if self.seen_lengths else None
        logged = exported if self.options.log_model else None
        self.tracker.log_final(summary, layer_rows, peak.as_dict(), seen, cfg.data.max_seq_len, logged)
        if self.options.metrics_out:
            write_summary(Path(self.options.metrics_out), summary)
        return summary
