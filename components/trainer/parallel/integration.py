"""What the trainer calls: the recipe's `[parallel]` table in, the model to train out (and the per-step hooks)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from gemrec.components.trainer.parallel.dims import ParallelConfig, ParallelConfigError, ParallelDims
from gemrec.components.trainer.parallel.parallelize import parallelize
from torch import nn

log = logging.getLogger(__name__)


def parallel_config(values: dict[str, Any]) -> ParallelConfig:
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ParallelConfigError(
            f"unknown setting(s) {', '.join(f'parallel.{k}' for k in unknown)}; [parallel] takes {', '.join(sorted(known))}"
        )
    return ParallelConfig(**values)


def parallelize_for_training(model: nn.Module, world_size: int, device: torch.device,
                             values: dict[str, Any]) -> nn.Module:
    """`parallelize` with the layout of the recipe's `[parallel]` table (defaults: FSDP over all ranks, tables
    sharded by the planner over all ranks)."""
    config = parallel_config(values)
    dims = ParallelDims.from_config(config, world_size)
    train_model, report = parallelize(model, dims, config, device)
    train_model.gemrec_parallel = (config, report)
    log.info("parallel: %s", report.as_params())
    return train_model


def after_step(train_model: nn.Module, step: int) -> None:
    """2D sparse parallelism: all-reduce the embedding replicas every `dmp_sync_interval` steps."""
    config_report = getattr(train_model, "gemrec_parallel", None)
    if config_report is None or not config_report[1].sparse_2d:
        return
    if step % config_report[0].dmp_sync_interval == 0:
        train_model.sync()
