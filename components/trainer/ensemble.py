"""`train.ensemble = N`: N models trained independently and predicting together.

The members are ordinary training runs (`run_training`, seeds `train.seed + i`, `train.threads` split among them) in
processes of their own, all at once, each in `run_dir/member<i>` with its own checkpoints (`--resume` resumes each),
its data stream and its validation, best weights and offsets. Each hands over its evaluated model and the logits it
predicted for the valid and eval splits (`Trainer.handover`); the coordinator averages those logits (no second pass
over the data), fits one logit offset per task on the valid split of that mean (never on eval), computes the eval
metrics and logs one MLflow run: the ensemble's numbers, every member's curves and final numbers as `member<i>/*`,
the exported `Ensemble` of the members' models. A member that fails stops the others; the error names it and its log
lines carry `member <i>`."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gemrec.cli import CLIError
from gemrec.components.trainer import metrics as qm
from gemrec.components.trainer.config import TrainConfig, split_valid_metric
from gemrec.components.trainer.evaluate import split_metrics
from gemrec.components.trainer.tracking import Tracker, run_summary, write_summary
from gemrec.components.trainer.trainer import RunOptions
from gemrec.provenance import git_commit

log = logging.getLogger(__name__)


def member_configs(config: TrainConfig) -> list[TrainConfig]:
    """Each member's recipe: seed `train.seed + i`, `train.threads` (0: the machine's cores) split evenly; member 0
    alone measures the local MFU (`train.local_mfu`), the others' probes would only slow it down."""
    count, train = config.train.ensemble, config.train
    threads = max(1, (train.threads or os.cpu_count() or 1) // count)
    return [
        replace(
            config,
            train=replace(
                train, seed=train.seed + i, threads=threads, ensemble=1, local_mfu=train.local_mfu and i == 0
            ),
        )
        for i in range(count)
    ]


def _exit_with(coordinator: int, poll_seconds: float = 1.0) -> None:
    """Ends this member's process once the coordinator is gone (killed, so it could not stop its members): no
    orphan keeps training. Its checkpoints stay for `--resume`."""
    while os.getppid() == coordinator:
        time.sleep(poll_seconds)
    logging.getLogger(__name__).error("the ensemble's coordinator (pid %d) is gone: this member stops", coordinator)
    os._exit(1)


def _member(
    index: int, config: TrainConfig, kwargs: dict[str, Any], verbose: bool, conn: Connection, coordinator: int
) -> None:
    """A member's process: train, then send ("ok", summary) or ("error", message) to the coordinator."""
    from gemrec.cli import configure_logging
    from gemrec.components.trainer.run import run_training

    configure_logging(verbose, label=f"member {index}", replace=True)
    threading.Thread(target=_exit_with, args=(coordinator,), name="coordinator-watch", daemon=True).start()
    try:
        conn.send(("ok", run_training(config, **kwargs)))
    except CLIError as err:
        conn.send(("error", str(err)))
    except Exception as err:  # the coordinator reports it: a member never dies silently
        logging.getLogger(__name__).exception("member %d failed", index)
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def train_members(configs: list[TrainConfig], member_kwargs: list[dict[str, Any]]) -> list[dict]:
    """Run every member at once (spawned processes); their summaries, or CLIError naming the first that failed
    (the others are stopped)."""
    spawn = mp.get_context("spawn")
    verbose = logging.getLogger("gemrec").isEnabledFor(logging.DEBUG)
    processes, conns = [], []
    for index, (config, kwargs) in enumerate(zip(configs, member_kwargs)):
        receive, send = spawn.Pipe(duplex=False)
        process = spawn.Process(
            target=_member, args=(index, config, kwargs, verbose, send, os.getpid()), name=f"member{index}"
        )
        process.start()
        send.close()
        processes.append(process)
        conns.append(receive)
    results: dict[int, dict] = {}
    try:
        while len(results) < len(processes):
            pending = {i: conns[i] for i in range(len(processes)) if i not in results}
            ready = wait([*pending.values(), *(processes[i].sentinel for i in pending)])
            for i, conn in pending.items():
                if conn not in ready and processes[i].sentinel not in ready:
                    continue
                try:
                    status, payload = conn.recv()
                except EOFError:
                    processes[i].join()
                    status, payload = "error", f"its process exited with code {processes[i].exitcode} and no result"
                if status != "ok":
                    raise CLIError(f"ensemble member {i} (train.seed = {configs[i].train.seed}) failed: {payload}")
                results[i] = payload
    finally:
        for process in processes:
            if process.is_alive() and len(results) < len(processes):
                process.terminate()
            process.join()
    return [results[i] for i in range(len(processes))]


def run_ensemble(
    config: TrainConfig, options: RunOptions, *, dataset: Path | None, data_addr: str | None, device: str
) -> dict:
    """Train `train.ensemble` members, then evaluate and log their ensemble; returns its summary."""
    from gemrec.model import Ensemble

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError(
            f"train.ensemble = {config.train.ensemble} runs its members as processes of one trainer: launch it as "
            "one process (WORLD_SIZE=1), not under a multi-rank torchrun"
        )
    configs = member_configs(config)
    member_dirs = [options.run_dir / f"member{i}" for i in range(len(configs))]
    handovers = [d / "member.pt" for d in member_dirs]
    common = dict(dataset=dataset, data_addr=data_addr, tracking_uri=options.tracking_uri, device=device)
    kwargs = [
        dict(
            common,
            experiment=options.experiment,
            run_dir=d,
            metrics_out=d / "summary.json",
            resume=options.resume,
            progress=False,
            log_model=False,
            tracking=False,
            member_out=out,
        )
        for d, out in zip(member_dirs, handovers)
    ]
    log.info(
        "ensemble of %d: members with seeds %s, %d thread(s) each, in %s",
        len(configs),
        [c.train.seed for c in configs],
        configs[0].train.threads,
        options.run_dir,
    )
    start = time.perf_counter()
    summaries = train_members(configs, kwargs)
    train_wall = time.perf_counter() - start

    handed = [torch.load(path, map_location="cpu", weights_only=False) for path in handovers]
    info = handed[0]["dataset"]
    labels = list(summaries[0]["ne"])
    rates = handed[0]["train_rates"]
    valid_result, offsets = None, None
    if all(h["valid"] is not None for h in handed) and config.train.eval_every > 0:
        valid_labels, valid_logits = mean_logits([h["valid"] for h in handed], "valid")
        if config.train.calibrate:
            offsets = qm.logit_offsets(valid_labels, valid_logits)
            valid_logits = valid_logits + offsets.astype(valid_logits.dtype)
        valid_result = split_metrics(valid_labels, valid_logits, labels, rates)
    eval_labels, eval_logits = mean_logits([h["eval"] for h in handed], "eval")
    if offsets is not None:
        eval_logits = eval_logits + offsets.astype(eval_logits.dtype)
    final_eval = split_metrics(eval_labels, eval_logits, labels, rates)

    model = Ensemble([h["model"] for h in handed], len(labels))
    if offsets is not None:
        model.logit_offset += torch.as_tensor(offsets, dtype=model.logit_offset.dtype)
    run_name = f"{config.recipe}-{config.model.arch}"
    tracker = Tracker(options.tracking, options.tracking_uri, options.experiment, run_name=run_name)
    try:
        summary = _log_ensemble(tracker, config, configs, summaries, handed, final_eval, valid_result, offsets, info)
        summary["mlflow"] = {
            "tracking_uri": options.tracking_uri,
            "experiment": options.experiment,
            "run_id": tracker.run_id,
        }
        summary["ensemble"]["train_wall_seconds"] = train_wall
        exported = model.eval() if options.log_model else None
        tracker.log_final(summary, [], member_peak(summaries), None, config.data.max_seq_len, exported)
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()
    if options.metrics_out:
        write_summary(Path(options.metrics_out), summary)
    return summary


def mean_logits(predictions: list[tuple[np.ndarray, np.ndarray]], split: str) -> tuple[np.ndarray, np.ndarray]:
    """(labels, the members' mean logits) of a split; the members must have predicted the same examples."""
    labels = predictions[0][0]
    for i, (other, _) in enumerate(predictions[1:], start=1):
        if other.shape != labels.shape or not np.array_equal(other, labels):
            raise CLIError(f"ensemble member {i} predicted other {split} examples than member 0: cannot average them")
    return labels, np.mean([logits for _, logits in predictions], axis=0)


def member_peak(summaries: list[dict]) -> dict:
    """The device peak the members measured MFU against (`mfu.Peak.as_dict()`), from member 0's summary."""
    mfu = summaries[0]["mfu"]
    return {
        "device": mfu["device"],
        "flops": mfu["peak_flops"],
        "source": mfu["peak_source"],
        "measured_flops": mfu["measured_peak_flops"],
    }


def _log_ensemble(
    tracker: Tracker,
    config: TrainConfig,
    configs: list[TrainConfig],
    summaries: list[dict],
    handed: list[dict],
    final_eval: dict,
    valid_result: dict | None,
    offsets: np.ndarray | None,
    info: dict,
) -> dict:
    """Log the ensemble's run (its config, the members' curves and numbers, valid and eval) and return its summary:
    training totals are the members' (examples, tokens and FLOPs summed over them, seconds the longest member's;
    E2E MFU against the members' peaks summed, each having measured its own share of the machine, as ranks do),
    data-path numbers the worst member's, validation the ensemble's at the members' last step."""
    labels = list(final_eval["tasks"])
    peak = member_peak(summaries)
    steps = max(int(s["steps"]) for s in summaries)
    tracker.log_start(
        config.to_dict(),
        {**config.flat(), "world_size": len(configs), "ensemble_seeds": [c.train.seed for c in configs]},
        {
            "git_commit": git_commit(),
            "dataset_checksum": info.get("checksum"),
            "dataset": info.get("name"),
            "device": peak["device"],
            "recipe": config.recipe,
            "arch": config.model.arch,
            "ensemble": len(configs),
        },
        info.get("train_seq_lengths"),
        config.data.max_seq_len,
    )
    for i, (summary, state) in enumerate(zip(summaries, handed)):
        for record in state["history"]:
            metrics = {f"member{i}/train/{k}": v for k, v in record.items() if k != "step"}
            tracker.log_metrics(metrics, step=record["step"])
        tracker.log_metrics(
            {
                **{f"member{i}/eval/ne_{n}": v for n, v in summary["ne"].items()},
                **{f"member{i}/eval/auc_{n}": v for n, v in summary["auc"].items()},
            },
            step=int(summary["steps"]),
        )
    tracker.history = handed[0]["history"]  # the curves' plot: member 0's training windows
    if valid_result is not None:
        tracker.log_eval(steps, valid_result, split="valid")
    if offsets is not None:
        tracker.log_metrics({f"valid/logit_offset_{n}": float(v) for n, v in zip(labels, offsets)}, step=steps)
    tracker.log_eval(steps, final_eval)

    seconds = [float(s["train_seconds"] or 0.0) for s in summaries]
    totals = {
        "examples": sum(float(s["qps"] or 0.0) * t for s, t in zip(summaries, seconds)),
        "tokens": sum(float(s["tokens_per_s"] or 0.0) * t for s, t in zip(summaries, seconds)),
        "flops": sum(float(s["mfu"]["e2e"] or 0.0) * peak["flops"] * t for s, t in zip(summaries, seconds)),
        "seconds": max(seconds),
        "steps": float(sum(s["timed_steps"] for s in summaries)),
        "data_wait_s": 0.0,
        "in_flight": 0.0,
        "build_cpu_s": 0.0,
    }
    summary = run_summary(
        recipe=config.recipe,
        arch=config.model.arch,
        steps=steps,
        world_size=len(configs),
        final_eval=final_eval,
        totals=totals,
        data_waits=[],
        data_source=summaries[0]["data"]["source"],
        peak=peak,
        local_mfu=float(summaries[0]["mfu"]["local"] or float("nan")),
        layer_rows=[],
        train_loss=float(np.mean([s["train_loss"] for s in summaries])),
        checkpoint=None,
        mlflow={},
        dataset={"name": info.get("name"), "checksum": info.get("checksum")},
        valid=_valid_summary(summaries, valid_result, offsets, labels, steps),
    )
    summary["data"] = {
        "source": summaries[0]["data"]["source"],
        **{
            key: max((s["data"][key] for s in summaries if s["data"].get(key) is not None), default=None)
            for key in summaries[0]["data"]
            if key != "source"
        },
    }
    summary["ensemble"] = {
        "members": len(configs),
        "seeds": [c.train.seed for c in configs],
        "threads_per_member": configs[0].train.threads,
        "logit_offsets": None if offsets is None else dict(zip(labels, map(float, offsets))),
        "member_ne": [s["ne"] for s in summaries],
        "member_valid": [s["valid"] for s in summaries],
        "member_checkpoints": [s["checkpoint"] for s in summaries],
    }
    return summary


def _valid_summary(
    summaries: list[dict], valid_result: dict | None, offsets: np.ndarray | None, labels: list[str], steps: int
) -> dict | None:
    """`Trainer.valid_summary`'s fields for the ensemble: the members' followed metric, its value for the ensemble."""
    members = [s["valid"] for s in summaries]
    if valid_result is None or any(v is None for v in members):
        return None
    kind, label = split_valid_metric(members[0]["metric"])
    value = valid_result["tasks"][label][kind] if kind and label else None
    return {
        "metric": members[0]["metric"],
        "best": float("nan") if value is None else float(value),
        "best_step": steps,
        "validations": 1,
        "stopped_early": any(v["stopped_early"] for v in members),
        "max_steps": max(v["max_steps"] for v in members),
        "best_checkpoint": None,
        "logit_offsets": None if offsets is None else dict(zip(labels, map(float, offsets))),
    }
