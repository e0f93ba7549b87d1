"""The training loop: data -> model -> fused sparse + dense optimizers, with evaluation, MFU accounting,
atomic DCP checkpoints, a NaN/Inf guard and MLflow logging (rank 0 only)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.checkpoint import CheckpointManager
from gemrec.components.trainer.config import TrainConfig
from gemrec.components.trainer.distributed import DistContext, parallelize_model, unwrap
from gemrec.components.trainer.mfu import Peak, device_peak, measure_local_mfu, total_flops
from gemrec.components.trainer.optim import Optimizers, apply_sparse_optimizer
from gemrec.components.trainer.parallel.balance import RankBalance
from gemrec.components.trainer.parallel.integration import after_step, training_inputs
from gemrec.components.trainer.tracking import (
    Tracker,
    git_commit,
    plot_curves,
    plot_layer_mfu,
    plot_seq_lengths,
)
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


def set_determinism(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def autocast_for(config: TrainConfig, device: torch.device):
    """A factory of the forward's autocast context: bf16 on GPU by default, fp32 on CPU."""
    precision = config.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if bf16:
        return True, lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return False, contextlib.nullcontext


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
        self.first_step = None
        self.logits: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.examples = 0
        self.tokens = 0
        self.flops = 0.0
        self.start = time.perf_counter()

    def pause(self) -> float:
        """Mark the start of work that is not training (eval, checkpoints); `resume` drops it."""
        return time.perf_counter()

    def resume(self, paused_at: float) -> None:
        self.start += time.perf_counter() - paused_at


def first_nonfinite(losses: list[torch.Tensor], first_step: int) -> tuple[int, float] | None:
    if not losses:
        return None
    values = torch.stack(losses).float()
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return None
    index = int(bad.nonzero()[0, 0])
    return first_step + index, float(values[index])


def finite_or_none(value):
    """JSON-safe copy: NaN/Inf (undefined metrics) become null."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


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
    ):
        """`stream` yields training `Batch`es and has `state()/load_state()`; `eval_source(rows_fn)` gives
        eval batches; `dataset_info` carries name, checksum and the training label base rates."""
        from gemrec.model import build_model

        self.config = config
        self.ctx = ctx
        self.options = options
        self.stream = stream
        self.eval_source = eval_source
        self.schema = schema
        self.dataset_info = dataset_info
        self.task_names = list(schema.labels)
        self.device = ctx.device

        set_determinism(config.train.seed, config.train.deterministic)
        if self.device.type == "cpu":
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            threads = config.train.threads or max(1, (os.cpu_count() or 1) // local_ranks)
            torch.set_num_threads(threads)
        self.model = build_model(config.model, schema).to(self.device)
        self.sparse_kind = apply_sparse_optimizer(self.model, config.optim)
        self.train_model = parallelize_model(self.model, ctx, config.parallel)
        self.balance = RankBalance(self.device, profile_every=config.train.log_every)
        if config.train.compile:
            self.train_model = torch.compile(self.train_model)
        self.total_steps = total_steps_for(config, dataset_info["batches_per_epoch"])
        self.optimizers = Optimizers(unwrap(self.train_model), config.optim, self.total_steps)
        self.bf16, self.autocast = autocast_for(config, self.device)
        self.checkpoints = CheckpointManager(
            options.run_dir / "checkpoints", config.checkpoint.keep, ctx.rank, ctx.barrier
        )
        self.step = 0
        self.stream_state: dict | None = None  # the data stream's state after the last trained batch
        self.history: list[dict] = []
        self.seen_label_sums = torch.zeros(len(self.task_names), dtype=torch.float64)
        self.seen_examples = 0
        self.seen_lengths: list[np.ndarray] = []
        self.eval_history: list[dict] = []
        self.last_checkpoint: Path | None = None
        self.tracker: Tracker | None = None
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.weights = self.task_weights()

    # -- checkpoint state ------------------------------------------------------------------------------

    def state(self) -> dict:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "model": get_model_state_dict(self.train_model),
            "optim": self.optimizers.state_dict(),
            "data": {f"rank{self.ctx.rank}": self.stream_state or self.stream.state()},
            "rng": {f"rank{self.ctx.rank}": rng},
            "progress": {"step": self.step},
        }

    def load_latest(self) -> bool:
        path = self.checkpoints.latest()
        if path is None:
            log.info("--resume: no checkpoint in %s, starting from step 0", self.checkpoints.dir)
            return False
        template = self.state()
        template["optim"] = self.optimizers.empty_state_template()
        meta = self.checkpoints.load(template, path)
        if meta.get("dataset_checksum") not in (None, self.dataset_info.get("checksum")):
            raise TrainingError(
                f"checkpoint {path} was written for dataset {meta.get('dataset_checksum')}, "
                f"not {self.dataset_info.get('checksum')}"
            )
        set_model_state_dict(self.train_model, template["model"])
        self.optimizers.load_state_dict(template["optim"])
        self.stream.load_state(template["data"][f"rank{self.ctx.rank}"])
        rng = template["rng"][f"rank{self.ctx.rank}"]
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = int(template["progress"]["step"])
        self.last_checkpoint = path
        self.resumed_run_id = meta.get("mlflow_run_id")
        log.info("resumed from %s at step %d", path, self.step)
        return True

    def save_checkpoint(self) -> None:
        meta = {
            "dataset_checksum": self.dataset_info.get("checksum"),
            "recipe": self.config.recipe,
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
        }
        self.last_checkpoint = self.checkpoints.save(self.step, self.state(), meta)

    # -- loss and steps --------------------------------------------------------------------------------

    def task_weights(self) -> list[float]:
        weights = self.config.train.task_weights
        unknown = sorted(set(weights) - set(self.task_names))
        if unknown:
            raise TrainingError(f"train.task_weights names unknown label(s) {unknown}; labels are {self.task_names}")
        return [float(weights.get(name, 1.0)) for name in self.task_names]

    def check_finite(self, window: Window) -> None:
        bad = first_nonfinite(window.losses, window.first_step)
        if bad is None:
            return
        step, value = bad
        where = (
            f"the last good checkpoint is {self.last_checkpoint} (resume from it with --resume)"
            if self.last_checkpoint
            else "no checkpoint was written before it"
        )
        raise TrainingError(f"loss is {value} at step {step}: training stopped; {where}")

    # -- evaluation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """NE, AUC and calibration per task on the eval split; the result on rank 0, None elsewhere."""
        model = unwrap(self.train_model)
        model.eval()
        logits, labels = [], []
        try:
            for batch in self.eval_source():
                batch_labels = batch.labels
                inp = self.to_input(batch)
                with self.autocast():
                    out = model(inp)
                logits.append(out.logits.float().cpu().numpy())
                labels.append(batch_labels.numpy())
        finally:
            model.train()
        num_tasks = len(self.task_names)
        local = (
            np.concatenate(labels) if labels else np.zeros((0, num_tasks), np.float32),
            np.concatenate(logits) if logits else np.zeros((0, num_tasks), np.float32),
        )
        train_rates = self.dataset_info.get("train_base_rates") or self.observed_train_rates()  # collective
        gathered = self.ctx.gather_objects(local)
        if gathered is None:
            return None
        all_labels = np.concatenate([g[0] for g in gathered])
        all_logits = np.concatenate([g[1] for g in gathered])
        result = qm.task_metrics(all_labels, all_logits, self.task_names)
        for name in self.task_names:
            rate = train_rates.get(name)
            if rate is not None:  # NE of the constant prediction "training base rate", for reference
                y = all_labels[:, self.task_names.index(name)]
                result[name]["ne_train_base_rate_predictor"] = qm.normalized_entropy(y, np.full(len(y), rate))
        return {"tasks": result, "examples": int(len(all_labels))}

    def export_model(self):
        """A clean CPU copy of the trained model (no optimizer hooks, no wrappers) for MLflow, on rank 0.

        A collective: every rank takes part in gathering sharded parameters (FSDP2 DTensors, torchrec
        ShardedTensors) into full tensors; the other ranks get None.
        """
        from gemrec.model import build_model

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(unwrap(self.train_model), options=options)
        if not self.ctx.is_main:
            return None
        model = build_model(self.config.model, self.schema)
        model.load_state_dict(state)
        return model.eval()

    def observed_train_rates(self) -> dict[str, float]:
        """Positive rate per label over the training batches this run consumed (all ranks)."""
        examples = self.ctx.all_reduce_sum(float(self.seen_examples))
        sums = [self.ctx.all_reduce_sum(float(v)) for v in self.seen_label_sums]
        return {n: sums[i] / examples for i, n in enumerate(self.task_names)} if examples else {}

    def to_input(self, batch):
        from gemrec.components.trainer.data import to_model_input

        return to_model_input(batch).to(self.device, non_blocking=True)

    # -- the loop --------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, ctx = self.config, self.ctx
        self.resumed_run_id = None
        if self.options.resume:
            self.load_latest()
        else:
            self.checkpoints.clear()
        peak = device_peak(self.device, self.bf16)
        self.peak = peak
        self.tracker = Tracker(
            ctx.is_main,
            self.options.tracking_uri,
            self.options.experiment,
            run_name=f"{cfg.recipe}-{cfg.model.arch}",
            resume_run_id=self.resumed_run_id,
        )
        try:
            result = self._run(peak)
        except BaseException:
            self.tracker.finish("FAILED")
            raise
        self.tracker.finish()
        return result

    def _log_start(self, peak: Peak) -> None:
        tracker = self.tracker
        tracker.log_params(
            {
                **self.config.flat(),
                "world_size": self.ctx.world_size,
                "num_params": self.num_params,
                "total_steps": self.total_steps,
                "sparse_optimizer": self.sparse_kind,
            }
        )
        tracker.set_tags(
            {
                "git_commit": git_commit(),
                "dataset_checksum": self.dataset_info.get("checksum"),
                "dataset": self.dataset_info.get("name"),
                "device": peak.device,
                "world_size": self.ctx.world_size,
                "recipe": self.config.recipe,
                "arch": self.config.model.arch,
                "peak_flops": f"{peak.flops:.4g} ({peak.source})",
            }
        )
        tracker.log_dict(self.config.to_dict(), "config/config.json")
        lengths = self.dataset_info.get("train_seq_lengths")
        if lengths is not None and self.tracker.enabled:
            import matplotlib.pyplot as plt

            fig = plot_seq_lengths(lengths, self.config.data.max_seq_len)
            tracker.log_figure(fig, "plots/seq_length_hist.png")
            plt.close(fig)

    def _run(self, peak: Peak) -> dict:
        from gemrec.components.trainer.data import to_model_input
        from gemrec.model import loss as model_loss
        from gemrec.model import model_flops

        cfg, ctx, tracker = self.config, self.ctx, self.tracker
        if self.tracker.resumed:
            tracker.set_tags({f"resumed_at_step_{self.step}": str(self.last_checkpoint)})
        else:
            self._log_start(peak)
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
        window = Window()
        totals = {"examples": 0, "tokens": 0, "flops": 0.0, "seconds": 0.0}
        last_inp = None
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (ctx.is_main and self.options.progress),
            desc=f"train {cfg.model.arch}",
            unit="step",
            mininterval=1.0,
            dynamic_ncols=True,
        )
        # (batch, host input, device input, stream state after it); pipelined when the tables are sharded
        batches = training_inputs(self.train_model, self.stream, self.device, to_model_input)
        self.train_model.train()
        while self.step < self.total_steps:
            batch, host_inp, inp, self.stream_state = next(batches)
            labels = batch.labels.to(self.device, non_blocking=True)
            # FLOPs from the host-side lengths: no device sync.
            window.flops += total_flops(model_flops(unwrap(self.train_model), host_inp))
            with self.balance.step():  # per-rank compute time; every log_every-th step profiled
                with self.autocast():
                    out = self.train_model(inp)
                loss = model_loss(out, labels, self.weights)
                loss.backward()
                self.optimizers.clip_and_step()
            after_step(self.train_model, self.step + 1)
            self.step += 1
            if window.first_step is None:
                window.first_step = self.step
            window.losses.append(loss.detach())
            window.logits.append(out.logits.detach().float())
            window.labels.append(labels)
            self.seen_label_sums += batch.labels.sum(0).double()
            self.seen_examples += batch.batch_size
            if self.dataset_info.get("train_seq_lengths") is None and len(self.seen_lengths) < 200:
                self.seen_lengths.append(batch.seq_lengths().numpy())
            window.examples += batch.batch_size
            window.tokens += batch.num_tokens
            last_inp = inp
            bar.update(1)

            last = self.step == self.total_steps
            if self.step % cfg.train.log_every == 0 or last:
                self.check_finite(window)
                self._log_window(window, totals, peak, bar)
                window.reset()
            if cfg.checkpoint.every and (self.step % cfg.checkpoint.every == 0 or last):
                self.check_finite(window)
                paused = window.pause()
                self.save_checkpoint()
                window.resume(paused)
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0 and not last:
                self.check_finite(window)
                paused = window.pause()
                self._log_eval(self.evaluate())
                window.resume(paused)
        bar.close()
        final_eval = self.evaluate()
        self._log_eval(final_eval)
        return self._finish(final_eval, totals, peak, last_inp)

    def _log_window(self, window: Window, totals: dict, peak: Peak, bar) -> None:
        ctx = self.ctx
        seconds = ctx.all_reduce_max(time.perf_counter() - window.start)
        examples = ctx.all_reduce_sum(float(window.examples))
        tokens = ctx.all_reduce_sum(float(window.tokens))
        flops = ctx.all_reduce_sum(window.flops)
        totals["examples"] += examples
        totals["tokens"] += tokens
        totals["flops"] += flops
        totals["seconds"] += seconds
        loss = float(torch.stack(window.losses).float().mean())
        logits = torch.cat(window.logits).cpu().numpy()
        labels = torch.cat(window.labels).float().cpu().numpy()
        record = {
            "step": self.step,
            "loss": loss,
            "qps": examples / seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": flops / seconds / (peak.flops * ctx.world_size),
            "lr": self.optimizers.dense.param_groups[0]["lr"],
        }
        preds = qm.sigmoid(logits)
        for j, name in enumerate(self.task_names):
            record[f"ne_{name}"] = qm.normalized_entropy(labels[:, j], preds[:, j])
        record.update(self.balance.window())  # rank_imbalance, exposed_comm_s, ... (a collective)
        self.history.append(record)
        self.tracker.log_metrics({f"train/{k}": v for k, v in record.items() if k != "step"}, step=self.step)
        bar.set_postfix(loss=f"{loss:.4f}", qps=f"{record['qps']:.0f}", mfu=f"{100 * record['mfu']:.2f}%")

    def _log_eval(self, result: dict | None) -> None:
        if result is None:
            return
        flat = {"step": self.step}
        for name, values in result["tasks"].items():
            for key, value in values.items():
                flat[f"{key}_{name}"] = value
        self.eval_history.append(flat)
        self.tracker.log_metrics({f"eval/{k}": v for k, v in flat.items() if k != "step"}, step=self.step)
        log.info(
            "eval at step %d: %s",
            self.step,
            ", ".join(
                f"{n}: NE {v['ne']:.4f} AUC {v['auc']:.4f} calib {v['calibration']:.3f}"
                for n, v in result["tasks"].items()
            ),
        )

    def _finish(self, final_eval: dict | None, totals: dict, peak: Peak, last_inp) -> dict:
        from gemrec.model import model_flops

        cfg, ctx = self.config, self.ctx
        seconds = totals["seconds"]
        qps = totals["examples"] / seconds if seconds else float("nan")
        e2e = totals["flops"] / seconds / (peak.flops * ctx.world_size) if seconds else float("nan")
        local, layers = float("nan"), []
        if cfg.train.local_mfu and last_inp is not None:
            model = unwrap(self.train_model)
            if hasattr(self.train_model, "gemrec_parallel"):
                # Sharded layers cannot run alone on one rank: time them on an unsharded single-device replica.
                from gemrec.model import build_model

                model = build_model(cfg.model, self.schema).to(self.device)
            layer_flops = model_flops(model, last_inp)
            local, layers = measure_local_mfu(
                model,
                layer_flops,
                lambda: model(last_inp),
                peak.flops,
                self.device,
                self.autocast,
                cfg.train.local_mfu_repeats,
            )
        exported = self.export_model() if self.options.log_model else None
        if not ctx.is_main:
            return {}
        layer_rows = [{"name": r.name, "flops": r.flops, "seconds": r.seconds, "mfu": r.mfu} for r in layers]
        summary = {
            "recipe": cfg.recipe,
            "arch": cfg.model.arch,
            "steps": self.step,
            "world_size": ctx.world_size,
            "tasks": self.task_names,
            "ne": {n: v["ne"] for n, v in final_eval["tasks"].items()},
            "auc": {n: v["auc"] for n, v in final_eval["tasks"].items()},
            "calibration": {n: v["calibration"] for n, v in final_eval["tasks"].items()},
            "base_rate": {n: v["base_rate"] for n, v in final_eval["tasks"].items()},
            # NE of always predicting the training split's positive rate (the "base rate" arm).
            "ne_train_base_rate": {n: v.get("ne_train_base_rate_predictor") for n, v in final_eval["tasks"].items()},
            "eval_examples": final_eval["examples"],
            "qps": qps,
            "tokens_per_s": totals["tokens"] / seconds if seconds else float("nan"),
            "mfu": {
                "e2e": e2e,
                "local": local,
                "scaling_ratio": e2e / local if local and np.isfinite(local) else float("nan"),
                "peak_flops": peak.flops,
                "peak_source": peak.source,
                "measured_peak_flops": peak.measured_flops,
                "device": peak.device,
                "layers": {r["name"]: r["mfu"] for r in layer_rows},
            },
            "train_loss": self.history[-1]["loss"] if self.history else float("nan"),
            "train_seconds": seconds,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "mlflow": {
                "tracking_uri": self.options.tracking_uri,
                "experiment": self.options.experiment,
                "run_id": self.tracker.run_id,
            },
            "dataset": {"name": self.dataset_info.get("name"), "checksum": self.dataset_info.get("checksum")},
            "git_commit": git_commit(),
        }
        tracker = self.tracker
        tracker.log_metrics(
            {
                "final/qps": qps,
                "final/tokens_per_s": summary["tokens_per_s"],
                "final/mfu_e2e": e2e,
                "final/mfu_local": local,
                "final/scaling_ratio": summary["mfu"]["scaling_ratio"],
                **{f"final/ne_{n}": v for n, v in summary["ne"].items()},
                **{f"final/auc_{n}": v for n, v in summary["auc"].items()},
            },
            step=self.step,
        )
        if tracker.enabled:
            import matplotlib.pyplot as plt

            fig = plot_curves(self.history, self.eval_history)
            tracker.log_figure(fig, "plots/loss_ne_curves.png")
            plt.close(fig)
            if self.seen_lengths:  # the data service gives no length table: plot what training saw
                fig = plot_seq_lengths(np.concatenate(self.seen_lengths), cfg.data.max_seq_len)
                tracker.log_figure(fig, "plots/seq_length_hist.png")
                plt.close(fig)
            if layer_rows:
                fig = plot_layer_mfu(layer_rows, local, e2e)
                tracker.log_figure(fig, "plots/layer_mfu.png")
                plt.close(fig)
            tracker.log_dict(
                {"layers": layer_rows, "local_mfu": local, "e2e_mfu": e2e, "peak": peak.as_dict()}, "mfu/layers.json"
            )
            tracker.log_dict(summary, "metrics/summary.json")
            if exported is not None:
                tracker.log_model(exported)
        if self.options.metrics_out:
            path = Path(self.options.metrics_out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(finite_or_none(summary), indent=2))
            os.replace(tmp, path)
        return summary
