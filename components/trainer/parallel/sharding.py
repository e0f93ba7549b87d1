"""TorchRec model parallelism for the embedding tables.

The planner (`EmbeddingShardingPlanner`) picks table-wise / row-wise / column-wise per table from the tables'
sizes and the topology (optionally constrained by `ParallelConfig.sharding_types`); the plan is computed on
rank 0 and broadcast (`collective_plan`). The model's `EmbeddingBagCollection` submodules are then replaced
in place by their sharded variants with torchrec's sharder API (`shard_modules`), leaving the rest of the model
untouched for FSDP2; parameter names stay the same, so checkpoints of sharded and unsharded runs line up.

2D sparse parallelism (`DMPCollection`: sharded inside a group of `sparse_shard` ranks, replicated across
groups and re-synchronised every `dmp_sync_interval` steps) wraps the whole model, as TorchRec requires.

Tables use the FUSED compute kernel, the only model-parallel kernel TorchRec offers: the optimizer attached with
`apply_optimizer_in_backward` before sharding (the trainer's row-wise Adagrad) runs inside the embedding backward.

Gradient scale: a sharded table receives the pooled-embedding gradients of every rank of its group; TorchRec's
output all-to-all divides them by the group size in backward (`torchrec.distributed.comm_ops` gradient division,
on by default), so the tables see the gradient of the global-batch mean loss, as FSDP's averaged dense gradients
do, and as a single-process run on the global batch does (checked by test_parallel_torchrun.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from gemrec.components.trainer.parallel.dims import ParallelConfig, ParallelDims
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torchrec.distributed.model_parallel import DMPCollection
    from torchrec.distributed.types import ShardedModule

log = logging.getLogger(__name__)


def has_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


def world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("sharding the embedding tables needs an initialized process group")
    return group


def embedding_names(model: nn.Module, name: str) -> list[str]:
    """The feature names of the EmbeddingBagCollection `name` of `model`, in order."""
    return list(getattr(model.get_submodule(name), "_embedding_names"))  # noqa: B009 (torchrec keeps it private)


def find_embedding_bag_collections(model: nn.Module) -> list[str]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return [name for name, module in model.named_modules() if isinstance(module, EmbeddingBagCollection)]


def embedding_sharders() -> list:
    """TorchRec's EBC sharder, model-parallel types only, with row-wise (and table-row-wise) allowed on CPU too:
    TorchRec leaves them out for CPU, but they only need all-to-all and reduce-scatter, which gloo has."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class EBCSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = super().sharding_types(compute_device_type)
            extra = ["row_wise", "table_row_wise"] if compute_device_type == "cpu" else []
            # Data-parallel tables would be wrapped in DDP, a second gradient path beside FSDP: model-parallel only.
            return [t for t in types + extra if t != "data_parallel"]

    return [EBCSharder()]


def plan_embedding_sharding(
    model: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    sharding_types: Sequence[str] | None = None,
    local_world_size: int | None = None,
    batch_size: int | None = None,
    shard_world_size: int | None = None,
):
    """A planner-chosen `ShardingPlan` for every EBC of `model`, computed on rank 0 of `group` and broadcast
    (collective: all ranks call it). `shard_world_size`: ranks to shard over when smaller than the group
    (2D: one sharding group's plan, which DMPCollection remaps onto every group)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    world = shard_world_size or dist.get_world_size(group)
    constraints = None
    if sharding_types:
        tables = [
            cfg.name
            for module in model.modules()
            if isinstance(module, EmbeddingBagCollection)
            for cfg in module.embedding_bag_configs()
        ]
        constraints = {name: ParameterConstraints(sharding_types=list(sharding_types)) for name in tables}
    topology = Topology(
        world_size=world,
        compute_device=device.type,
        local_world_size=local_world_size or world,
    )
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, batch_size=batch_size, debug=False)
    return planner.collective_plan(model, embedding_sharders(), group)


def describe_plan(plan) -> dict[str, str]:
    """{table: "sharding_type on ranks [..]"} for logs and MLflow params."""
    out = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            out[table] = f"{sharding.sharding_type} on ranks {sharding.ranks}"
    return out


@torch.no_grad()
def load_full_weights(sharded: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy the unsharded tables' weights into this rank's shards: the sharders allocate fresh tables, and every
    rank must keep the weights the model was built with (same seed, same init as a single-process run)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, target in sharded.state_dict().items():
        source = full[key]
        if isinstance(target, ShardedTensor):
            for shard in target.local_shards():
                rows, cols = shard.metadata.shard_offsets
                height, width = shard.metadata.shard_sizes
                shard.tensor.copy_(source[rows : rows + height, cols : cols + width])
        else:
            target.copy_(source)


def _equal_stride_pre_hook(group: dist.ProcessGroup):
    """Forward pre-hook of a sharded EBC: pad the batch with empty rows to the largest stride in the group.

    The model looks up examples and history tokens in one batch (stride B + T), and T differs between ranks;
    TorchRec's sharded lookups assume one batch size on every rank (row-wise's reduce-scatter backward fails on
    uneven ones). One tiny all-reduce of the stride per step, empty rows appended to every key (their values
    unchanged), and the output hook cuts the padding off again."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def hook(module, args):
        (features,) = args
        stride = features.stride()
        device = features.lengths().device
        largest = torch.tensor([stride], dtype=torch.long, device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        largest = int(largest.item())
        module._gemrec_stride = stride
        if largest == stride:
            return None
        lengths = features.lengths().view(len(features.keys()), stride)
        padded = torch.nn.functional.pad(lengths, (0, largest - stride)).reshape(-1)
        return (KeyedJaggedTensor(keys=features.keys(), values=features.values(), lengths=padded, stride=largest),)

    return hook


def _pooled_output_hook(keys: list[str]):
    """Forward hook of a sharded EBC: wait for the output all-to-all and put the features back in the unsharded
    module's key order (sharding regroups them by shard), without the rows the pre-hook padded on."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    def hook(module, args, output):
        if hasattr(output, "wait"):
            output = output.wait()
        by_key = output.to_dict()
        values = torch.cat([by_key[k] for k in keys], dim=1)[: module._gemrec_stride]
        return KeyedTensor(keys=keys, length_per_key=[by_key[k].shape[1] for k in keys], values=values)

    return hook


def _add_hooks(sharded: nn.Module, keys: list[str], group: dist.ProcessGroup) -> None:
    sharded.register_forward_pre_hook(_equal_stride_pre_hook(group))
    sharded.register_forward_hook(_pooled_output_hook(keys))


def shard_embedding_tables(
    model: nn.Module, parallel_dims: ParallelDims, config: ParallelConfig, device: torch.device
) -> dict[str, str]:
    """Replace every EBC of `model` by its sharded variant over all ranks (1D); returns the chosen plan."""
    from torchrec.distributed.shard import shard_modules
    from torchrec.distributed.types import ShardingEnv

    names = find_embedding_bag_collections(model)
    if not names:
        return {}
    group = world_group()
    keys = {name: embedding_names(model, name) for name in names}
    weights = {name: model.get_submodule(name).state_dict() for name in names}
    plan = plan_embedding_sharding(model, group, device, config.sharding_types)
    shard_modules(
        model, env=ShardingEnv.from_process_group(group), device=device, plan=plan, sharders=embedding_sharders()
    )
    for name in names:
        load_full_weights(model.get_submodule(name), weights[name])
        _add_hooks(model.get_submodule(name), keys[name], group)
    described = describe_plan(plan)
    log.info("embedding sharding plan: %s", described)
    return described


def shard_embedding_tables_2d(
    model: nn.Module, parallel_dims: ParallelDims, config: ParallelConfig, device: torch.device
) -> tuple[DMPCollection, dict[str, str]]:
    """TorchRec 2D sparse parallelism: DMPCollection shards the tables inside each group of `sparse_shard`
    consecutive ranks and replicates them across the `sparse_replicate` groups. Dense parameters are left to
    FSDP2 (no DDP wrapper). Returns (the DMPCollection wrapping `model`, the plan of one sharding group)."""
    from torchrec.distributed.model_parallel import DMPCollection

    names = find_embedding_bag_collections(model)
    keys = {name: embedding_names(model, name) for name in names}
    weights = {name: model.get_submodule(name).state_dict() for name in names}
    sparse_mesh: DeviceMesh = parallel_dims.sparse_mesh
    shard_group = sparse_mesh.get_group("sparse_shard")
    plan = plan_embedding_sharding(
        model, world_group(), device, config.sharding_types, shard_world_size=parallel_dims.sparse_shard
    )
    dmp = DMPCollection(
        module=model,
        device=device,
        plan=plan,
        world_size=parallel_dims.world_size,
        sharding_group_size=parallel_dims.sparse_shard,
        global_pg=dist.group.WORLD,
        sharders=embedding_sharders(),
        init_data_parallel=False,
        use_inter_host_allreduce=True,  # shard over consecutive ranks (one host), all-reduce across hosts
    )
    for name in names:
        load_full_weights(dmp.module.get_submodule(name), weights[name])
        _add_hooks(dmp.module.get_submodule(name), keys[name], shard_group)
    return dmp, describe_plan(plan)


def sharded_embedding_modules(model: nn.Module) -> list[ShardedModule]:
    from torchrec.distributed.types import ShardedModule

    return [m for m in model.modules() if isinstance(m, ShardedModule)]


def fused_optimizer(model: nn.Module):
    """The in-backward optimizers of the sharded tables as one torchrec `KeyedOptimizer` (state_dict with
    ShardedTensors, checkpointable with DCP), or None when no table is sharded."""
    from torchrec.optim.keyed import CombinedOptimizer

    modules = sharded_embedding_modules(model)
    if not modules:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return CombinedOptimizer([(names[id(m)], m.fused_optimizer) for m in modules])
