"""`gemrec bench import`: benchmark results written on a machine without MLflow (the GPU box runs with
`--no-tracking`), logged into MLflow afterwards. One run per file, with the metrics, plots and JSON the benchmark
logs itself where MLflow is installed:
- `gemrec bench seqrec --metrics-out FILE`: per-validation and test metrics per arm, `plots/seqrec_metrics.png`;
- `gpu_bench.json` (`gemrec bench train`, `gpu_bench`): throughput and MFU, the loss of every step,
  `plots/layer_mfu.png` (local MFU per layer)."""

from __future__ import annotations

import json
from pathlib import Path

from gemrec.components.trainer.tracking import Tracker, plot_layer_mfu

KINDS = {
    "seqrec": ("protocol", "dataset", "arms"),
    "train": ("recipe", "step_ms", "mfu_e2e", "layers", "losses"),
}
TRAIN_PARAMS = ("recipe", "device", "torch", "precision", "compile", "batch_size", "max_seq_len", "steps", "batches")
TRAIN_METRICS = (
    "step_ms",
    "qps",
    "tokens_per_s",
    "model_tflop_per_step",
    "mfu_e2e",
    "mfu_local",
    "scaling_ratio",
    "mfu_e2e_vs_fp8_peak",
    "peak_memory_gib",
    "host_syncs_per_step",
)


class ResultError(ValueError):
    """A file that is not a benchmark result this command knows."""


def read_result(path: Path) -> tuple[str, dict]:
    """(kind, result) of one results file; a clear error for a missing, unreadable or unknown file."""
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ResultError(f"{path}: no such file") from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ResultError(f"{path}: not a JSON results file ({err})") from err
    if isinstance(result, dict):
        for kind, keys in KINDS.items():
            if all(key in result for key in keys):
                return kind, result
    expected = "; ".join(f"{kind}: {', '.join(keys)}" for kind, keys in KINDS.items())
    raise ResultError(f"{path}: not a result of gemrec bench seqrec or gpu_bench (expected keys {expected})")


def import_results(
    paths: list[Path], tracking_uri: str, experiment: str, commit: str | None = None
) -> list[tuple[Path, str, str]]:
    """Log every file as its own MLflow run; (path, kind, run id) per file. All files are read before any run
    is created, so a bad file logs nothing."""
    results = [(path, *read_result(path)) for path in paths]
    imported = []
    for path, kind, result in results:
        name = (
            f"seqrec-{result['protocol']}-{result['dataset']}-{result.get('recipe', '')}"
            if kind == "seqrec"
            else f"gpu-bench-{result['recipe']}"
        )
        tracker = Tracker(True, tracking_uri, experiment, run_name=f"{name} (imported)")
        try:
            source = result.get("git_commit") or commit
            tags = {"imported_from": str(path), "kind": kind}
            tracker.set_tags(tags | ({"git_commit": source} if source else {}))
            (_log_seqrec if kind == "seqrec" else _log_train)(tracker, result)
            tracker.log_dict(result, f"metrics/{path.name}")
        except BaseException:
            tracker.finish("FAILED")
            raise
        tracker.finish()
        imported.append((path, kind, str(tracker.run_id)))
    return imported


def _log_seqrec(tracker: Tracker, result: dict) -> None:
    from gemrec.components.trainer.seqrec import arm_metrics, plot_results

    params = ("protocol", "dataset", "recipe", "seed", "device", "threads", "machine", "wall_seconds")
    tracker.log_params({key: result[key] for key in params if key in result} | {"arms": ",".join(result["arms"])})
    for arm, r in result["arms"].items():
        for record in r["history"]:
            ranking = {k: v for k, v in record.items() if k not in ("step", "epoch", "train_loss")}
            train_loss = {f"{arm}/train_loss": record["train_loss"]}
            tracker.log_metrics(arm_metrics(arm, "valid", ranking) | train_loss, step=record["step"])
        test = arm_metrics(arm, "test", r["test"])
        tracker.log_metrics(test | {f"{arm}/best_epoch": r["best_epoch"]}, step=r["steps"])
    tracker.log_plot(plot_results(result, result.get("published", {})), "plots/seqrec_metrics.png")


def _log_train(tracker: Tracker, result: dict) -> None:
    tracker.log_params({key: result[key] for key in TRAIN_PARAMS if key in result})
    for step, loss in enumerate(result["losses"]):
        tracker.log_metrics({"train_loss": loss}, step=step)
    tracker.log_metrics({key: result[key] for key in TRAIN_METRICS if result.get(key) is not None}, step=0)
    if result["layers"] and result.get("mfu_local"):
        tracker.log_plot(
            plot_layer_mfu(result["layers"], result["mfu_local"], result["mfu_e2e"]), "plots/layer_mfu.png"
        )
