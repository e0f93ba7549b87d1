"""`gemrec bench quality`: every model arm trained and evaluated on the same data in one invocation.

Arms: the models asked for (gem, dlrm, gbdt), named variants of the recipe (`--variant "NAME: section.key=value
..."`, e.g. the sequence tower with a window mask), each for every seed asked for, plus two constant predictors: the
training base rate and the eval base rate (NE exactly 1.0 by definition of NE here). Prints a markdown table for
docs/benchmarks.md; with more than one arm, each arm's NE relative to the first arm's of the same seed.
"""

from __future__ import annotations

import json
import platform
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemrec.components.trainer.config import TrainConfig, load_recipe
from gemrec.components.trainer.run import run_training
from gemrec.config import ConfigError, parse_override
from gemrec.provenance import git_commit


@dataclass(frozen=True)
class Arm:
    """One trained arm: `arch` (None: the recipe's) with the bench's overrides, then its own."""

    name: str
    arch: str | None = None
    overrides: tuple[str, ...] = field(default=())


def parse_variant(text: str) -> Arm:
    """`NAME: section.key=value ...` (overrides separated by spaces, shell quoting) -> an `Arm` of the recipe's arch."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not name or any(c.isspace() for c in name):
        raise ConfigError(
            f"--variant {text!r}: expected 'NAME: section.key=value ...' (a name without spaces, a colon)"
        )
    overrides = tuple(shlex.split(rest))
    if not overrides:
        raise ConfigError(f"--variant {text!r}: no section.key=value override after {name!r}:")
    for item in overrides:
        parse_override(item)  # refuses a malformed one now, naming it
    return Arm(name, None, overrides)


def run_quality_bench(
    dataset: Path,
    recipe: str,
    arms: list[Arm],
    overrides: list[str],
    tracking_uri: str | None,
    experiment: str,
    device: str,
    out: Path | None,
    seeds: list[int] | None = None,
) -> str:
    """Train and evaluate every arm for every seed (None: the recipe's `train.seed`) on `dataset`; the table."""
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ConfigError(f"arm names must differ, got {names}")
    each_seed: list[int | None] = list(seeds) if seeds else [None]
    runs = [(arm, seed) for seed in each_seed for arm in arms]

    def label(arm: Arm, seed: int | None) -> str:
        return arm.name if seed is None or len(seeds or []) < 2 else f"{arm.name} (seed {seed})"

    configs = {  # every arm checked before training
        label(arm, seed): load_recipe(
            recipe, [*overrides, *arm.overrides, *([f"train.seed={seed}"] if seed is not None else [])], arch=arm.arch
        )
        for arm, seed in runs
    }
    with tempfile.TemporaryDirectory(prefix="gemrec-bench-") as tmp:
        results = train_arms(
            configs, dataset, Path(tmp), tracking_uri=tracking_uri, experiment=experiment, device=device
        )
    first = next(iter(results.values()))
    tasks = first["tasks"]
    relative = len(arms) > 1  # each arm's NE against the first arm's of the same seed
    variants = "; ".join(f"{arm.name}: {' '.join(arm.overrides)}" for arm in arms if arm.overrides)
    lines = [
        f"quality bench: recipe `{recipe}` {' '.join(overrides)} on `{first['dataset']['name']}` "
        f"({first['eval_examples']} eval examples), commit {git_commit()[:10]}, {platform.node()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}" + (f"; variants {variants}" if variants else ""),
        "",
        "| arm | "
        + " | ".join(f"NE {t}" for t in tasks)
        + (" | " + " | ".join(f"NE {t} vs {arms[0].name}" for t in tasks) if relative else "")
        + " | "
        + " | ".join(f"AUC {t}" for t in tasks)
        + " | "
        + " | ".join(f"calib {t}" for t in tasks)
        + " | QPS | wall s |",
        "|---" * (2 + (4 if relative else 3) * len(tasks) + 1) + "|",
    ]

    def fmt(value, digits=4):
        return "n/a" if value is None else f"{value:.{digits}f}"

    for arm, seed in runs:
        r, base = results[label(arm, seed)], results[label(arms[0], seed)]
        lines.append(
            f"| {label(arm, seed)} | "
            + " | ".join(fmt(r["ne"][t]) for t in tasks)
            + (" | " + " | ".join(f"{100 * (r['ne'][t] / base['ne'][t] - 1):+.2f}%" for t in tasks) if relative else "")
            + " | "
            + " | ".join(fmt(r["auc"][t]) for t in tasks)
            + " | "
            + " | ".join(fmt(r["calibration"][t], 3) for t in tasks)
            + f" | {r['qps']:.0f} | {r['wall_seconds']:.0f} |"
        )
    blank = " | ".join("-" for _ in tasks)
    skip = f" | {blank}" if relative else ""
    lines.append(
        "| base rate (train) | "
        + " | ".join(fmt(first["ne_train_base_rate"][t]) for t in tasks)
        + f"{skip} | {blank} | {blank} | - | - |"
    )
    lines.append(
        "| base rate (eval) | " + " | ".join("1.0000" for _ in tasks) + f"{skip} | {blank} | {blank} | - | - |"
    )
    table = "\n".join(lines)
    log_comparison(results, list(results), tasks, table, recipe, tracking_uri, experiment)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"arms": results, "table": table}, indent=2, default=str))
    return table


def train_arms(
    configs: dict[str, TrainConfig],
    dataset: Path,
    run_root: Path,
    *,
    tracking_uri: str | None,
    experiment: str,
    device: str,
    progress: bool = True,
    tracking: bool = True,
) -> dict[str, dict]:
    """Train and evaluate every named config on `dataset` in turn (run folders `run_root/arm<i>`, no model logged):
    name -> its run summary with `wall_seconds`."""
    results = {}
    for index, (name, config) in enumerate(configs.items()):
        start = time.perf_counter()
        summary = run_training(
            config,
            dataset=dataset,
            data_addr=None,
            run_dir=run_root / f"arm{index}",
            tracking_uri=tracking_uri,
            experiment=experiment,
            metrics_out=None,
            resume=False,
            device=device,
            progress=progress,
            log_model=False,
            tracking=tracking,
        )
        summary["wall_seconds"] = time.perf_counter() - start
        results[name] = summary
    return results


def log_comparison(results: dict, arms: list[str], tasks: list[str], table: str, recipe: str, tracking_uri, experiment):
    """An MLflow run `quality-<recipe>`: the table and a PNG of every arm's NE per task beside the base rate."""
    import matplotlib.pyplot as plt
    from gemrec.components.trainer.tracking import Tracker, metric_key, plot_ne_comparison, resolve_tracking_uri

    first = results[arms[0]]
    fig = plot_ne_comparison(
        {arm: results[arm]["ne"] for arm in arms},
        first["ne_train_base_rate"],
        tasks,
        f"{first['dataset']['name']}, recipe {recipe}",
    )
    tracker = Tracker(True, resolve_tracking_uri(tracking_uri), experiment, run_name=f"quality-{recipe}")
    tracker.set_tags({"dataset": first["dataset"]["name"], "recipe": recipe, "arms": ",".join(arms)})

    tracker.log_metrics(
        {f"ne_{t}/{metric_key(arm)}": v for arm in arms for t in tasks if (v := results[arm]["ne"][t]) is not None},
        step=0,
    )
    tracker.log_figure(fig, "plots/quality_comparison.png")
    tracker.log_text(table, "quality_table.md")
    tracker.finish()
    plt.close(fig)
