"""`gemrec bench quality`: every model arm trained and evaluated on the same data in one invocation.

Arms: the models asked for (gem, dlrm) plus two constant predictors: the training base rate and the eval
base rate (NE exactly 1.0 by definition of NE here). Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

from gemrec.components.trainer.config import load_recipe
from gemrec.components.trainer.run import run_training
from gemrec.components.trainer.tracking import git_commit


def run_quality_bench(
    dataset: Path,
    recipe: str,
    arms: list[str],
    overrides: list[str],
    tracking_uri: str | None,
    experiment: str,
    device: str,
    out: Path | None,
) -> str:
    configs = {arm: load_recipe(recipe, overrides, arch=arm) for arm in arms}  # every arm checked before training
    results = {}
    with tempfile.TemporaryDirectory(prefix="gemrec-bench-") as tmp:
        for arm, config in configs.items():
            start = time.perf_counter()
            summary = run_training(
                config,
                dataset=dataset,
                data_addr=None,
                run_dir=Path(tmp) / arm,
                tracking_uri=tracking_uri,
                experiment=experiment,
                metrics_out=None,
                resume=False,
                device=device,
                progress=True,
                log_model=False,
            )
            summary["wall_seconds"] = time.perf_counter() - start
            results[arm] = summary
    first = results[arms[0]]
    tasks = first["tasks"]
    lines = [
        f"quality bench: recipe `{recipe}` {' '.join(overrides)} on `{first['dataset']['name']}` "
        f"({first['eval_examples']} eval examples), commit {git_commit()[:10]}, {platform.node()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| arm | "
        + " | ".join(f"NE {t}" for t in tasks)
        + " | "
        + " | ".join(f"AUC {t}" for t in tasks)
        + " | "
        + " | ".join(f"calib {t}" for t in tasks)
        + " | QPS | wall s |",
        "|---" * (2 + 3 * len(tasks) + 1) + "|",
    ]

    def fmt(value, digits=4):
        return "n/a" if value is None else f"{value:.{digits}f}"

    for arm in arms:
        r = results[arm]
        lines.append(
            f"| {arm} | "
            + " | ".join(fmt(r["ne"][t]) for t in tasks)
            + " | "
            + " | ".join(fmt(r["auc"][t]) for t in tasks)
            + " | "
            + " | ".join(fmt(r["calibration"][t], 3) for t in tasks)
            + f" | {r['qps']:.0f} | {r['wall_seconds']:.0f} |"
        )
    blank = " | ".join("-" for _ in tasks)
    lines.append(
        "| base rate (train) | "
        + " | ".join(fmt(first["ne_train_base_rate"][t]) for t in tasks)
        + f" | {blank} | {blank} | - | - |"
    )
    lines.append("| base rate (eval) | " + " | ".join("1.0000" for _ in tasks) + f" | {blank} | {blank} | - | - |")
    table = "\n".join(lines)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"arms": results, "table": table}, indent=2, default=str))
    return table
