"""ParallelDims: the shape of a run's parallelism and its named DeviceMesh views.

Dense parameters use HSDP over `dp_replicate x dp_shard` (shard inside a group, replicate across groups).
MoE experts are split over `ep` ranks borrowed from `dp_shard` (as in torchtitan): the `dp_shard` ranks are
laid out as `dp_shard_mod_ep x ep`, so each expert lives on `world / ep` ranks and is FSDP-sharded over
`dp_shard_mod_ep` and replicated over `dp_replicate`. Embedding tables are model-parallel over a sharding group
of `sparse_shard` consecutive ranks and replicated `sparse_replicate = world / sparse_shard` times (TorchRec 2D
sparse parallelism when `sparse_replicate > 1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

import torch
from gemrec.config import ConfigError, Section
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ShardingType = Literal["table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise"]
DType = Literal["bfloat16", "float16", "float32"]


class ParallelConfigError(ConfigError):
    """An impossible parallel layout; the message shows the arithmetic."""


@dataclass(frozen=True)
class ParallelConfig(Section):
    """The `[parallel]` section of a recipe. -1 means "whatever is left of the world size"."""

    SECTION: ClassVar[str] = "parallel"

    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    sparse_shard: int = -1  # ranks in one embedding sharding group
    # Memory plan: blocks (the elements of the model's ModuleLists: seq_tower.0, interaction.1, ...) whose forward is
    # recomputed in backward instead of keeping its activations. none; full: every block; selective: the blocks named
    # by activation_checkpoint_blocks (globs; empty = all), every activation_checkpoint_every-th of them.
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    activation_checkpoint_blocks: tuple[str, ...] = ()
    activation_checkpoint_every: int = 1
    compile: bool = False  # torch.compile each block
    reshard_after_forward: bool = True  # FSDP2: free gathered params after forward (ZeRO-3) or keep (ZeRO-2)
    param_dtype: DType | None = None  # FSDP2 mixed precision; unset ("" in TOML) keeps fp32
    reduce_dtype: DType | None = None
    # Planner constraint on the embedding tables; empty lets the planner choose per table.
    sharding_types: tuple[ShardingType, ...] = ()
    dmp_sync_interval: int = 1  # 2D sparse: all-reduce embedding replicas every N steps

    def check(self) -> None:
        self.require(self.dmp_sync_interval >= 1, "dmp_sync_interval", "must be >= 1")
        self.require(self.activation_checkpoint_every >= 1, "activation_checkpoint_every", "must be >= 1")
        selective = self.activation_checkpoint == "selective"
        for key, default in (("activation_checkpoint_blocks", ()), ("activation_checkpoint_every", 1)):
            self.require(
                selective or getattr(self, key) == default,
                key,
                f"chooses blocks for activation_checkpoint = 'selective', not {self.activation_checkpoint!r}",
            )


@dataclass
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    sparse_shard: int = -1

    def __post_init__(self) -> None:
        ws = self.world_size
        if ws < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {ws}")
        for name in ("dp_replicate", "ep"):
            if getattr(self, name) < 1:
                raise ParallelConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_shard == -1:
            if ws % self.dp_replicate:
                raise ParallelConfigError(
                    f"dp_shard = world size / dp_replicate = {ws} / {self.dp_replicate} is not an integer "
                    f"({ws} % {self.dp_replicate} = {ws % self.dp_replicate})"
                )
            self.dp_shard = ws // self.dp_replicate
        if self.dp_shard < 1:
            raise ParallelConfigError(f"dp_shard must be >= 1 or -1 (auto), got {self.dp_shard}")
        if self.dp_replicate * self.dp_shard != ws:
            raise ParallelConfigError(
                f"dp_replicate x dp_shard = {self.dp_replicate} x {self.dp_shard} = "
                f"{self.dp_replicate * self.dp_shard}, but the world size is {ws}"
            )
        if self.dp_shard % self.ep:
            raise ParallelConfigError(
                f"ep ({self.ep}) borrows ranks from dp_shard ({self.dp_shard}) and must divide it: "
                f"{self.dp_shard} % {self.ep} = {self.dp_shard % self.ep}"
            )
        if self.sparse_shard == -1:
            self.sparse_shard = ws
        if self.sparse_shard < 1 or ws % self.sparse_shard:
            raise ParallelConfigError(
                f"world size = sparse_replicate x sparse_shard needs sparse_shard ({self.sparse_shard}) to divide "
                f"the world size ({ws}): {ws} % {self.sparse_shard} = "
                f"{ws % self.sparse_shard if self.sparse_shard > 0 else 'undefined'}"
            )

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> ParallelDims:
        return cls(world_size, config.dp_replicate, config.dp_shard, config.ep, config.sparse_shard)

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def sparse_replicate(self) -> int:
        return self.world_size // self.sparse_shard

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def sparse_2d(self) -> bool:
        return self.sparse_replicate > 1

    def describe(self) -> str:
        return (
            f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
            f"(= dp_shard_mod_ep {self.dp_shard_mod_ep} x ep {self.ep}); "
            f"sparse: sparse_replicate {self.sparse_replicate} x sparse_shard {self.sparse_shard}"
        )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The world mesh (dp_replicate, dp_shard_mod_ep, ep) with the flattened views `dp_shard` and `dp`."""
        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard_mod_ep, self.ep),
            mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"),
        )
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp")
        return mesh

    @cached_property
    def world_mesh(self) -> DeviceMesh:
        return self.build_mesh(_device_type())

    @property
    def dense_mesh(self) -> DeviceMesh:
        """HSDP mesh of the dense (non-expert) parameters: (dp_replicate, dp_shard)."""
        return self.world_mesh["dp_replicate", "dp_shard"]

    @property
    def expert_mesh(self) -> DeviceMesh:
        """HSDP mesh of the expert parameters, which EP has already split over `ep`."""
        return self.world_mesh["dp_replicate", "dp_shard_mod_ep"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.world_mesh["ep"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """All data-parallel ranks flattened: the ranks whose batches form one global batch."""
        return self.world_mesh["dp"]

    @cached_property
    def sparse_mesh(self) -> DeviceMesh:
        """(sparse_replicate, sparse_shard) over consecutive ranks: tables sharded inside a group of
        `sparse_shard` neighbours (one host), replicas across groups."""
        ranks = torch.arange(self.world_size).reshape(self.sparse_replicate, self.sparse_shard)
        return DeviceMesh(_device_type(), ranks, mesh_dim_names=("sparse_replicate", "sparse_shard"))


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
