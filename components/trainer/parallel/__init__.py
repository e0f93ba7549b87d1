"""5D parallelism for the trainer: HSDP (FSDP2) and expert parallelism for the dense parameters, TorchRec
model parallelism (1D or 2D) for the embedding tables. See docs/parallelism.md."""

from gemrec.components.trainer.parallel.dims import ParallelConfig, ParallelConfigError, ParallelDims
from gemrec.components.trainer.parallel.parallelize import (
    Parallelized,
    ParallelizeReport,
    apply_activation_checkpointing,
    parallelize,
)

__all__ = [
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelDims",
    "Parallelized",
    "ParallelizeReport",
    "apply_activation_checkpointing",
    "parallelize",
]
