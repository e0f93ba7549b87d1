"""What the trainer calls: the recipe's `[parallel]` table in, the model to train out (and the per-step hooks)."""

from __future__ import annotations

import logging

import torch
from gemrec.components.trainer.parallel.dims import ParallelConfig, ParallelDims
from gemrec.components.trainer.parallel.parallelize import parallelize
from torch import nn

log = logging.getLogger(__name__)


def parallelize_for_training(
    model: nn.Module, world_size: int, device: torch.device, config: ParallelConfig
) -> nn.Module:
    """`parallelize` with the layout of the recipe's `[parallel]` table (defaults: FSDP over all ranks, tables
    sharded by the planner over all ranks)."""
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


def training_inputs(train_model: nn.Module, stream, device: torch.device, to_model_input):
    """Yield `(batch, host_input, device_input, stream_state)` for the train loop.

    With sharded tables the next batch's copy and embedding input all-to-all run during the current step
    (`SparseDistPipeline`), so the stream is read one batch ahead: `stream_state` is the stream's resume state
    right after *this* batch, what a checkpoint taken after training it must hold."""
    from gemrec.components.trainer.parallel import sharding
    from gemrec.components.trainer.parallel.pipeline import SparseDistPipeline, gem_lookup_call

    def with_state():
        for batch in stream:
            yield batch, to_model_input(batch), stream.state()

    def move(item):
        batch, host, state = item
        return batch, host, host.to(device, non_blocking=True), state

    model = (
        getattr(train_model, "module", train_model) if type(train_model).__name__ == "DMPCollection" else train_model
    )
    tables = sharding.sharded_embedding_modules(model) if _has_torchrec() else []
    if not tables or not hasattr(model, "embeddings"):
        yield from (move(item) for item in with_state())
        return
    pipeline = SparseDistPipeline(model, gem_lookup_call(model), device)
    yield from pipeline(with_state(), move=move, lookup_input=lambda item: item[2])


def _has_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True
