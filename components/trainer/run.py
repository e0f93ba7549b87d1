"""Wire a training run together: process context, data source, schema, trainer; map failures to CLIError."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import numpy as np
from gemrec.cli import CLIError
from gemrec.components.trainer.config import TrainConfig
from gemrec.components.trainer.distributed import init_distributed, shutdown_distributed
from gemrec.components.trainer.tracking import resolve_tracking_uri

log = logging.getLogger(__name__)


def train_label_rates(dataset_dir: Path, labels: list[str]) -> dict[str, float]:
    """Positive rate of each label over the training split (examples/train.parquet)."""
    import pyarrow.parquet as pq

    table = pq.read_table(dataset_dir / "examples" / "train.parquet", columns=list(labels))
    return {name: float(np.mean(table.column(name).to_numpy())) for name in labels}


def dataset_source(config: TrainConfig, dataset_dir: Path, rank: int, world_size: int):
    """(stream, eval batches factory, valid batches factory or None, manifest, info) for an in-process dataset
    directory."""
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer.data import EVAL_SPLIT, TRAIN_SPLIT, VALID_SPLIT, DatasetStream, eval_row_chunks

    ds = Dataset.open(dataset_dir)
    stream = DatasetStream(
        ds,
        config.data.batch_size,
        config.data.max_seq_len,
        config.train.seed,
        rank,
        world_size,
        prefetch=config.data.prefetch,
    )

    def split_batches(split: str, max_examples: int):
        chunks = eval_row_chunks(ds.num_examples(split), max_examples, config.data.eval_batch_size, rank, world_size)

        def batches():
            for rows in chunks:
                yield ds.collate(split, rows, config.data.max_seq_len)

        return batches

    has_valid = VALID_SPLIT in ds.splits and ds.num_examples(VALID_SPLIT) > 0

    manifest = ds.manifest
    info = {
        "name": manifest.get("name"),
        "checksum": manifest.get("dataset_checksum"),
        "batches_per_epoch": stream.batches_per_epoch,
        "train_base_rates": train_label_rates(Path(dataset_dir), list(manifest["labels"])),
        "train_seq_lengths": ds.history_lengths(TRAIN_SPLIT, config.data.max_seq_len),
    }
    eval_batches = split_batches(EVAL_SPLIT, config.data.eval_max_examples)
    valid_batches = split_batches(VALID_SPLIT, config.data.valid_max_examples) if has_valid else None
    return stream, eval_batches, valid_batches, manifest, info


def remote_source(config: TrainConfig, addr: str, rank: int, world_size: int):
    import grpc
    from gemrec.components.trainer.data import EVAL_SPLIT, VALID_SPLIT, RemoteStream

    try:
        stream = RemoteStream(
            addr,
            config.data.batch_size,
            config.data.max_seq_len,
            config.train.seed,
            rank,
            world_size,
            token=os.environ.get("GEMREC_AUTH_TOKEN"),
            client_options={"stall_s": config.data.stall_s, "wait_timeout_s": config.data.wait_timeout_s},
        )
    except grpc.RpcError as err:
        raise CLIError(
            f"--data-addr {addr}: the data service did not answer ({err.code().name}: {err.details()})"
        ) from err
    manifest = stream.manifest

    def split_batches(split: str, max_examples: int):
        return lambda: stream.split_batches(split, config.data.eval_batch_size, max_examples)

    info = {
        "name": manifest.get("name"),
        "checksum": manifest.get("dataset_checksum"),
        "batches_per_epoch": stream.batches_per_epoch,
        "train_base_rates": {},
        "train_seq_lengths": None,
    }
    eval_batches = split_batches(EVAL_SPLIT, config.data.eval_max_examples)
    has_valid = stream.split_sizes.get(VALID_SPLIT, 0) > 0
    valid_batches = split_batches(VALID_SPLIT, config.data.valid_max_examples) if has_valid else None
    return stream, eval_batches, valid_batches, manifest, info


def run_training(
    config: TrainConfig,
    *,
    dataset: Path | None,
    data_addr: str | None,
    run_dir: Path,
    tracking_uri: str | None,
    experiment: str,
    metrics_out: Path | None,
    resume: bool,
    device: str = "auto",
    progress: bool = True,
    log_model: bool = True,
    tracking: bool = True,
    member_out: Path | None = None,
) -> dict:
    """Train, evaluate and log; returns the summary (the --metrics-out content) on rank 0, {} elsewhere.
    `tracking=False`: no MLflow (the GPU machine has none); the summary still goes to `metrics_out`.
    `train.ensemble` > 1: the members train as processes of their own (`ensemble.run_ensemble`); `member_out`: this
    run is one of them (`RunOptions.member_out`)."""
    from gemrec.components.data_service.client import DataServiceTimeout
    from gemrec.components.data_service.errors import DataError
    from gemrec.components.trainer.trainer import RunOptions, Trainer, TrainingError
    from gemrec.model import FeatureSchema

    if dataset is not None and not Path(dataset).is_dir():
        raise CLIError(f"--dataset {dataset}: no such directory")
    if tracking and importlib.util.find_spec("mlflow") is None:
        raise CLIError("mlflow is not installed: install it, or train without MLflow (--no-tracking)")
    if config.model.arch == "gbdt":
        from gemrec.components.trainer.gbdt import run_gbdt

        if dataset is None:
            raise CLIError("--model gbdt reads a dataset directory (--dataset), not the data service")
        try:
            return run_gbdt(
                config, Path(dataset), resolve_tracking_uri(tracking_uri), experiment, metrics_out, tracking
            )
        except (DataError, ValueError) as err:
            raise CLIError(f"{dataset}: {err}") from err
    options = RunOptions(
        run_dir=Path(run_dir),
        tracking_uri=resolve_tracking_uri(tracking_uri),
        experiment=experiment,
        metrics_out=metrics_out,
        resume=resume,
        progress=progress,
        log_model=log_model and tracking,
        tracking=tracking,
        member_out=member_out,
    )
    if config.train.ensemble > 1:
        from gemrec.components.trainer.ensemble import run_ensemble

        return run_ensemble(config, options, dataset=dataset, data_addr=data_addr, device=device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CLIError("--device cuda: no CUDA device is available")
    ctx = init_distributed(device)
    if not ctx.is_main:  # rank 0 speaks for the run
        logging.getLogger("gemrec").setLevel(logging.WARNING)
    try:
        try:
            if dataset is not None:
                source = dataset_source(config, Path(dataset), ctx.rank, ctx.world_size)
            elif data_addr is not None:
                source = remote_source(config, data_addr, ctx.rank, ctx.world_size)
            else:
                raise CLIError("train from a dataset directory or a data service address: give one")
            stream, eval_batches, valid_batches, manifest, info = source
            schema = FeatureSchema.from_manifest(manifest)
        except (DataError, ValueError, ConnectionError) as err:
            raise CLIError(f"{dataset or data_addr}: {err}") from err
        try:
            trainer = Trainer(config, ctx, options, stream, eval_batches, schema, info, valid_batches)
        except (ValueError, TrainingError) as err:  # the model or the trainer rejects the config
            raise CLIError(f"recipe {config.recipe}: {err}") from err
        try:
            return trainer.run()
        except TrainingError as err:
            raise CLIError(str(err)) from err
        except DataServiceTimeout as err:
            raise CLIError(f"--data-addr {data_addr}: {err}") from err
        except Exception as err:
            if data_addr is not None and type(err).__module__.startswith("grpc"):
                raise CLIError(f"--data-addr {data_addr}: the batch stream failed: {err}") from err
            raise
    finally:
        if os.environ.get("WORLD_SIZE", "1") != "1":
            shutdown_distributed()
