"""`parallelize(model, parallel_dims, config, device)`: apply every kind of parallelism to the unmodified model.

As in torchtitan's `parallelize_*`, the model from `gemrec.model` stays vanilla PyTorch and this step applies,
in order:

1. sparse   torchrec sharding of the embedding tables (planner-chosen table/row/column-wise), in place over all
            ranks, or TorchRec 2D sparse parallelism (`DMPCollection`) when `sparse_shard < world size`
2. EP       MoE experts split over the `ep` mesh dimension, tokens moved with all-to-all
3. AC       activation checkpointing of the blocks the memory plan names (`apply_activation_checkpointing`, also
            run on a single process by `setup_training`; parameter names unchanged)
4. compile  `torch.compile` per block, and per module of the root outside the block lists
5. FSDP2    `fully_shard` per block on the (dp_replicate, dp_shard) mesh (HSDP when dp_replicate > 1), expert
            weights on (dp_replicate, dp_shard_mod_ep), the root last with the sharded tables left out;
            explicit forward/backward prefetch of the next block's all-gather along each block list
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from gemrec.components.trainer.parallel.dims import ParallelConfig, ParallelConfigError, ParallelDims
from gemrec.components.trainer.parallel.expert_parallel import apply_expert_parallel, find_moe_layers
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


@dataclass
class ParallelizeReport:
    """What was applied, for logs and MLflow params."""

    layout: str
    embedding_plan: dict[str, str] = field(default_factory=dict)
    fsdp_blocks: list[str] = field(default_factory=list)
    expert_parallel: list[str] = field(default_factory=list)
    compiled_root_modules: list[str] = field(default_factory=list)
    activation_checkpointed: list[str] = field(default_factory=list)
    sparse_2d: bool = False

    def as_params(self) -> dict[str, str]:
        params = {
            "parallel.layout": self.layout,
            "parallel.fsdp_blocks": str(len(self.fsdp_blocks)),
            "parallel.expert_parallel_layers": str(len(self.expert_parallel)),
            "parallel.sparse_2d": str(self.sparse_2d),
            "parallel.activation_checkpointed": ",".join(self.activation_checkpointed) or "none",
        }
        params.update({f"parallel.table.{k}": v for k, v in self.embedding_plan.items()})
        return params


@dataclass
class Parallelized:
    """What `parallelize` made: the module to train, the layout it follows and what was applied."""

    model: nn.Module  # what to train: the model itself, or with 2D sparse parallelism the `DMPCollection` around it
    module: nn.Module  # the (sharded, FSDP-wrapped) gemrec model inside `model`
    dims: ParallelDims
    config: ParallelConfig
    report: ParallelizeReport
    sync_replicas: Callable[[], object] | None = None  # 2D sparse: all-reduce the embedding-table replicas

    def after_step(self, step: int) -> None:
        """2D sparse parallelism: all-reduce the embedding replicas every `dmp_sync_interval` steps."""
        if self.sync_replicas is not None and step % self.config.dmp_sync_interval == 0:
            self.sync_replicas()


def fsdp_blocks(model: nn.Module, skip: AbstractSet[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """The FSDP units: every element (with parameters) of the outermost `nn.ModuleList`s, in order, outside
    the modules in `skip` (the sharded embedding tables)."""
    blocks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in skip:
            return
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList):
                for index, block in enumerate(child):
                    if any(True for _ in block.parameters()) and id(block) not in skip:
                        blocks.append((f"{path}.{index}", block))
            else:
                visit(path, child)

    visit("", model)
    return blocks


def activation_checkpoint_plan(blocks: list[tuple[str, nn.Module]], config: ParallelConfig) -> list[str]:
    """The names of the blocks whose forward is recomputed in backward (`ParallelConfig.activation_checkpoint`):
    none, every block, or (selective) the blocks matching `activation_checkpoint_blocks` (globs over the block names;
    empty: all), every `activation_checkpoint_every`-th of them in model order starting with the first."""
    names = [name for name, _ in blocks]
    if config.activation_checkpoint == "none":
        return []
    if config.activation_checkpoint == "full":
        return names
    patterns = config.activation_checkpoint_blocks or ("*",)
    unmatched = [p for p in patterns if not any(fnmatchcase(name, p) for name in names)]
    if unmatched:
        raise ParallelConfigError(
            f"parallel.activation_checkpoint_blocks {unmatched} match no block; the model's blocks are {names}"
        )
    chosen = [name for name in names if any(fnmatchcase(name, p) for p in patterns)]
    return chosen[:: config.activation_checkpoint_every]


def _recomputed_forward(block: nn.Module, *args, **kwargs):
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def checkpoint_block(block: nn.Module) -> None:
    """Recompute `block`'s forward in its backward instead of keeping its activations: its class's forward runs inside
    `torch.utils.checkpoint.checkpoint` (non-reentrant), which torch.compile traces into the step's one graph and
    which leaves the module, its parameters and their names as they were. A bound method: a deep copy of the block
    recomputes itself, not the original."""
    block.forward = types.MethodType(_recomputed_forward, block)


def apply_activation_checkpointing(
    model: nn.Module, config: ParallelConfig, skip: AbstractSet[int] = frozenset()
) -> list[str]:
    """The memory plan: checkpoint the blocks `activation_checkpoint_plan` picks among `fsdp_blocks(model, skip)`;
    their names. Applied to the vanilla model, before compile and FSDP (by `parallelize`, or by `setup_training`
    on a single process): the layers themselves know nothing of it."""
    blocks = dict(fsdp_blocks(model, skip))
    names = activation_checkpoint_plan(list(blocks.items()), config)
    for name in names:
        checkpoint_block(blocks[name])
    if names:
        log.info("activation checkpointing (%s): %s", config.activation_checkpoint, ", ".join(names))
    return names


def _module_lists(blocks: list[tuple[str, nn.Module]]) -> list[list[nn.Module]]:
    """Blocks grouped by the ModuleList they come from (consecutive blocks of one list run in order)."""
    groups: dict[str, list[nn.Module]] = {}
    for name, block in blocks:
        groups.setdefault(name.rsplit(".", 1)[0], []).append(block)
    return list(groups.values())


def parallelize(
    model: nn.Module, parallel_dims: ParallelDims, config: ParallelConfig, device: torch.device
) -> Parallelized:
    """Parallelize `model` in place; the result's `model` is what to train: `model` itself except with 2D sparse
    parallelism, where it is the `DMPCollection` around it (`Parallelized.after_step` syncs its replicas)."""
    report = ParallelizeReport(layout=parallel_dims.describe())
    train_model, root, sync_replicas = model, model, None

    # 1. Sparse.
    from gemrec.components.trainer.parallel import sharding

    has_tables = sharding.has_torchrec() and bool(sharding.find_embedding_bag_collections(model))
    if has_tables:
        if parallel_dims.sparse_2d:
            if device.type != "cuda":
                raise ParallelConfigError(
                    f"2D sparse parallelism (sparse_shard {parallel_dims.sparse_shard} < world size "
                    f"{parallel_dims.world_size}) uses TorchRec's DMPCollection, which needs CUDA; "
                    f"on {device.type} set sparse_shard = -1 (shard over all {parallel_dims.world_size} ranks)"
                )
            dmp, report.embedding_plan = sharding.shard_embedding_tables_2d(model, parallel_dims, config, device)
            train_model, root, sync_replicas = dmp, dmp.module, dmp.sync
            report.sparse_2d = True
        else:
            report.embedding_plan = sharding.shard_embedding_tables(model, parallel_dims, config, device)
    sharded_tables = sharding.sharded_embedding_modules(root) if has_tables else []
    skip = {id(m) for m in sharded_tables}
    table_params = {p for m in sharded_tables for p in m.parameters()}
    # Tables left as plain parameters with an in-backward optimizer (the torch embedding backend, used where
    # torchrec is absent): replicated on every rank, gradient averaged before their optimizer runs.
    replicated = [p for p in root.parameters() if hasattr(p, "_in_backward_optimizers") and p not in table_params]
    for param in replicated:
        dist.broadcast(param.data, src=0)
        _average_grad_before_optimizer(param)
    table_params |= set(replicated)
    if replicated:
        skip |= {id(m) for m in root.modules() if any(p in table_params for p in m.parameters(recurse=False))}

    # 2. Expert parallelism.
    moe_layers = find_moe_layers(root)
    if parallel_dims.ep_enabled:
        if not moe_layers:
            raise ParallelConfigError(f"ep = {parallel_dims.ep} but the model has no MoE layer")
        for name, moe in moe_layers:
            apply_expert_parallel(moe.experts, parallel_dims.ep_mesh)
            report.expert_parallel.append(name)

    # 3-4. Activation checkpointing and compile, per block.
    report.activation_checkpointed = apply_activation_checkpointing(root, config, skip)
    blocks = fsdp_blocks(root, skip)
    report.fsdp_blocks = [name for name, _ in blocks]
    for _, block in blocks:
        if config.compile:
            block.compile()
    if config.compile:
        # The root's own modules outside the block lists (input projections, PMA, norms) run inside the root
        # FSDP unit; compiling them too fuses their elementwise work and cuts kernel launches.
        in_blocks = {id(m) for _, block in blocks for m in block.modules()}
        for name, child in root.named_children():
            if (
                not isinstance(child, nn.ModuleList)
                and id(child) not in skip
                and id(child) not in in_blocks
                and any(True for _ in child.parameters())
            ):
                child.compile()
                report.compiled_root_modules.append(name)

    # 5. FSDP2.
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, config.param_dtype) if config.param_dtype else None,
        reduce_dtype=getattr(torch, config.reduce_dtype) if config.reduce_dtype else None,
    )
    dense_mesh = parallel_dims.dense_mesh
    for _, moe in moe_layers:
        if parallel_dims.ep_enabled:
            experts = fully_shard(
                moe.experts,
                mesh=parallel_dims.expert_mesh,
                mp_policy=mp,
                reshard_after_forward=config.reshard_after_forward,
            )
            # Each expert's gradient already sums the tokens of all `ep` ranks (all-to-all backward): dividing
            # by every data-parallel rank, not only the expert mesh's, gives the global-batch mean.
            experts.set_gradient_divide_factor(float(parallel_dims.world_size))
            if device.type != "cuda" and parallel_dims.dp_shard_mod_ep > 1:
                # A custom divide factor makes FSDP2 reduce-scatter with ReduceOp.PREMUL_SUM, which only NCCL
                # has ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): on gloo, plain SUM and a division after.
                # Not with a shard group of 1: FSDP2 (torch 2.11-2.13) then skips the reduce-scatter, divides
                # while copying and divides again after a forced sum, halving the gradients (the loss test of
                # mesh 2x2 ep 2 caught it).
                experts.set_force_sum_reduction_for_comms(True)
    sharded_blocks = {
        id(block): fully_shard(block, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=config.reshard_after_forward)
        for _, block in blocks
    }
    # The root keeps its parameters after forward: backward needs them at once, and FSDP2 can only re-gather
    # them through hooks on the forward's output tensors, which a dataclass output (ModelOutput) hides.
    fully_shard(root, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=table_params or None)
    for group in _module_lists(blocks):
        units = [sharded_blocks[id(block)] for block in group]
        for current, nxt in zip(units, units[1:]):
            current.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([current])
    log.info(
        "parallelized: %s; %d FSDP blocks, EP on %d MoE layers, tables: %s",
        report.layout,
        len(blocks),
        len(report.expert_parallel),
        report.embedding_plan or "unsharded",
    )
    return Parallelized(train_model, root, parallel_dims, config, report, sync_replicas)


def _average_grad_before_optimizer(param: nn.Parameter) -> None:
    """All-reduce (mean over all ranks) a replicated table's gradient before its in-backward optimizer: a
    pre-hook on the gradient accumulator runs before the post-accumulate hook that steps the optimizer."""
    from torch.distributed.optim.apply_optimizer_in_backward import param_to_acc_grad_map

    # In place: the incoming gradient is the embedding backward's own fresh tensor (a copy of the table's size
    # is a full extra pass at the very end of backward, where nothing hides it).
    average = dist.get_backend() == "nccl"  # gloo has no ReduceOp.AVG

    def hook(grad_outputs):
        grad = grad_outputs[0]
        if average:
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
            return (grad,)
        dist.all_reduce(grad)
        return (grad.div_(dist.get_world_size()),)

    param_to_acc_grad_map[param].register_prehook(hook)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
