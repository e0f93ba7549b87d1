"""What a training step needs, set up in one place from a `TrainConfig`: the model, its parallelization, the sparse
and dense optimizers and the forward's precision. `gemrec train` (the `Trainer`), `gemrec bench train` (`gpu_bench`)
and the scaling benchmark all build it here and run `Training.step` (`gemrec.model.train_step`), so every benchmark
measures exactly what training runs. Nothing here imports torchrec, mlflow or kfp: it runs on the GPU machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from gemrec.components.trainer import precision
from gemrec.components.trainer.config import LoopConfig, TrainConfig
from gemrec.components.trainer.optim import Optimizers, WeightAverage, apply_sparse_optimizer
from gemrec.components.trainer.parallel import ParallelDims, Parallelized, apply_activation_checkpointing, parallelize
from gemrec.config import ConfigError
from gemrec.model import FeatureSchema, ModelInput, StepResult, build_model, train_step
from torch import nn


def set_determinism(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def autocast_for(precision: str, device: torch.device) -> tuple[bool, Callable[[], AbstractContextManager[object]]]:
    """(bf16?, a factory of the forward's autocast context): `auto` is bf16 autocast on GPU and fp32 on CPU; `fp8`
    runs as `auto` around the converted modules."""
    if precision == "bf16" or (precision in ("auto", "fp8") and device.type == "cuda"):
        return True, lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return False, contextlib.nullcontext


def task_weights_for(train: LoopConfig, labels: Sequence[str]) -> list[float]:
    """The loss weight of every label (`train.task_weights`, default 1.0); unknown labels are refused."""
    unknown = sorted(set(train.task_weights) - set(labels))
    if unknown:
        raise ConfigError(
            f"train.task_weights names unknown label(s) {unknown}; the dataset's labels are {list(labels)}"
        )
    return [float(train.task_weights.get(name, 1.0)) for name in labels]


def timed_steps(step: Callable[[], object], count: int, wait: Callable[[], object]) -> float:
    """Seconds for `count` calls of `step`, between two `wait()`s (device sync, and a barrier across ranks)."""
    wait()
    start = time.perf_counter()
    for _ in range(count):
        step()
    wait()
    return time.perf_counter() - start


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory the device's allocator held since the last call (or the start), in GiB, and a new count
    from here; None off CUDA (no allocator statistics). Host-side counters: no device sync."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


@dataclass
class Training:
    model: nn.Module  # the vanilla model (FLOP counts, evaluation, export); parallelized in place when distributed
    train_model: nn.Module  # what the step runs: `model`, the DMPCollection around it, compiled when asked
    parallel: Parallelized | None  # what `parallelize` made (None in a single process)
    optimizers: Optimizers
    sparse_optimizer: str  # which row-wise Adagrad runs in backward
    bf16: bool
    autocast: Callable[[], AbstractContextManager[object]]
    task_weights: torch.Tensor  # per label, on the device: the loss reads it without a host-to-device copy
    fp8_modules: list[str]  # what train.precision = "fp8" converted (empty otherwise)
    checkpointed: list[str]  # the blocks whose activations are recomputed in backward (parallel.activation_checkpoint)
    average: WeightAverage | None = None  # the moving average of the weights (optim.weight_average > 0)

    def step(self, inp: ModelInput, labels: torch.Tensor) -> StepResult:
        """One training step on a batch on the device: forward, loss, backward, clip and optimizer step."""
        result = train_step(
            self.train_model,
            inp,
            labels,
            task_weights=self.task_weights,
            autocast=self.autocast,
            optimizer_step=self.optimizers.clip_and_step,
        )
        if self.fp8_modules:
            precision.after_step(self.model)
        if self.average is not None:
            self.average.update()
        return result

    def fp8_counters(self, collect_next: bool) -> dict[str, float]:
        """The FP8 overflow/underflow counters since the last call (`precision.counters`; {} without FP8), and
        whether the next steps count (the atomics cost a little: the trainer counts its logging steps only)."""
        if not self.fp8_modules:
            return {}
        out = precision.counters(self.model)
        precision.collect_counters(self.model, collect_next)
        return out


def setup_training(
    config: TrainConfig,
    schema: FeatureSchema,
    device: torch.device,
    total_steps: int,
    world_size: int | None = None,
) -> Training:
    """Build the model from `config.model` on `device` (parameters from torch's RNG: seed first), attach the sparse
    optimizer, parallelize it with `config.parallel` over `world_size` ranks when given (a process group must be up;
    on one process only its memory plan, `parallel.activation_checkpoint`),
    compile it when `train.compile`, and create the dense optimizer for `total_steps` steps (and the weights' moving
    average when `optim.weight_average` > 0)."""
    weights = task_weights_for(config.train, schema.labels)
    if config.optim.weight_average and world_size is not None:
        raise ConfigError(
            "optim.weight_average averages one process's unsharded weights: set it to 0 for a distributed run"
        )
    model = build_model(config.model, schema, config.kernels).to(device)
    # FP8 is a conversion of the vanilla model, before parallelize (it keeps every parameter and its name)
    fp8_modules = precision.convert_to_fp8(model, config.fp8, device) if config.train.precision == "fp8" else []
    sparse_optimizer = apply_sparse_optimizer(model, config.optim)
    parallel, train_model = None, model
    if world_size is not None:
        parallel = parallelize(model, ParallelDims.from_config(config.parallel, world_size), config.parallel, device)
        train_model, checkpointed = parallel.model, parallel.report.activation_checkpointed
    else:  # one process: of parallelize's steps only the memory plan applies
        checkpointed = apply_activation_checkpointing(model, config.parallel)
    if config.train.compile:
        train_model = cast(nn.Module, torch.compile(train_model))  # an OptimizedModule, typed as a callable
    bf16, autocast = autocast_for(config.train.precision, device)
    if bf16 and device.type == "cuda":  # mixed precision: the fp32 matmuls outside autocast on tensor cores too
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Training(
        model=model,
        train_model=train_model,
        parallel=parallel,
        optimizers=Optimizers(model, config.optim, total_steps),
        sparse_optimizer=sparse_optimizer,
        bf16=bf16,
        autocast=autocast,
        task_weights=torch.tensor(weights, device=device),
        fp8_modules=fp8_modules,
        checkpointed=checkpointed,
        average=WeightAverage(model, config.optim.weight_average) if config.optim.weight_average else None,
    )
