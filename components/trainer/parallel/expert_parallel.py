"""Expert parallelism: the stacked expert weights are split over the `ep` mesh dimension and each MoE layer's
tokens travel to their experts and back with two all-to-alls.

The model's MoE (`gemrec.model.moe.MoEFeedForward`) runs route -> dispatch -> experts -> combine. Only the
`experts` module (`GroupedExperts`: `w1`, `w3`, `w2` stacked on dim 0, `forward(x_sorted, tokens_per_expert)`)
changes: its weights become DTensors `Shard(0)` on the ep mesh (so checkpoints hold the global tensors and
reshard freely) and its forward is wrapped:

    counts all-to-all   how many rows each rank sends to each of my local experts
    token all-to-all    rows grouped by destination rank (they already are: sorted by global expert)
    regroup             source-major -> expert-major, run the local experts on local weights
    token all-to-all    results back to their source rank, in the original row order

Both token all-to-alls are autograd-aware (their backward is the reverse all-to-all), so the expert weight
gradients sum the contributions of every rank's tokens.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
import torch.distributed as dist
from gemrec.model.moe import GroupedExperts, MoEFeedForward
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def is_grouped_experts(module: nn.Module) -> bool:
    return hasattr(module, "num_experts") and all(
        isinstance(getattr(module, name, None), nn.Parameter) for name in EXPERT_WEIGHTS
    )


def find_moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """(name, module) of every MoE layer (its `experts` hold the stacked expert weights)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, MoEFeedForward) and is_grouped_experts(module.experts)
    ]


def apply_expert_parallel(experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
    """Shard `experts` over `ep_mesh` in place (weights -> DTensor Shard(0), forward -> all-to-all wrapped)."""
    ep = ep_mesh.size()
    if experts.num_experts % ep:
        raise ValueError(
            f"expert parallelism: num_experts ({experts.num_experts}) must be divisible by ep ({ep}): "
            f"{experts.num_experts} % {ep} = {experts.num_experts % ep}"
        )
    for name in EXPERT_WEIGHTS:
        weight = getattr(experts, name)
        # distribute_tensor slices the (identical on every rank) full weight without communication.
        sharded = distribute_tensor(weight.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    # The wrapped forward's state, attached by this transform (the model's class does not know about EP).
    setattr(experts, "ep_group", ep_mesh.get_group())  # noqa: B010
    setattr(experts, "num_local_experts", experts.num_experts // ep)  # noqa: B010
    setattr(experts, "forward", types.MethodType(_expert_parallel_forward(type(experts).forward), experts))  # noqa: B010


@contextmanager
def _local_weights(experts: GroupedExperts):
    """Run the unmodified expert forward on this rank's slice: weights as local tensors (still differentiable
    back to the DTensor parameters) and `num_experts` as the local count."""
    saved = {name: experts._parameters[name] for name in EXPERT_WEIGHTS}
    num_experts = experts.num_experts
    try:
        for name, weight in saved.items():
            experts._parameters[name] = weight.to_local() if isinstance(weight, DTensor) else weight
        experts.num_experts = getattr(experts, "num_local_experts")  # noqa: B009 (set by apply_expert_parallel)
        yield
    finally:
        experts._parameters.update(saved)
        experts.num_experts = num_experts


def _expert_parallel_forward(local_forward):
    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        group = self.ep_group
        ep, local = dist.get_world_size(group), self.num_local_experts
        counts = tokens_per_expert.long()
        # recv[s, j]: rows source rank s sends to my local expert j.
        recv = all_to_all_single(counts, None, None, group).view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group)
        order = source_major_to_expert_major(recv)
        with _local_weights(self):
            y_local = local_forward(self, x_recv[order], recv.sum(0))
        y_recv = torch.empty_like(y_local).index_copy(0, order, y_local)
        return all_to_all_single_autograd(y_recv, send_splits, recv_splits, group)

    return forward


def source_major_to_expert_major(blocks: torch.Tensor) -> torch.Tensor:
    """Row order that turns rows laid out in blocks [source][expert] (sizes `blocks`, shape (S, E)) into
    [expert][source]: `rows[order]` is expert-major."""
    sizes = blocks.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(blocks).t().reshape(-1)
    sizes_em = blocks.t().reshape(-1)
    starts_em = torch.cumsum(sizes_em, 0) - sizes_em
    total = int(sizes.sum())
    shift = torch.repeat_interleave(starts - starts_em, sizes_em, output_size=total)
    return shift + torch.arange(total, device=blocks.device)
