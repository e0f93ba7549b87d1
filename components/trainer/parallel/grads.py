"""Gradient-norm clipping over parameters that live on different device meshes.

`torch.nn.utils.clip_grad_norm_` stacks the per-tensor norms, which fails when the gradients are DTensors on
different meshes (dense parameters on (dp_replicate, dp_shard), experts on (dp_replicate, dp_shard_mod_ep, ep)).
As in torchtitan's EP-aware clipping: one norm per mesh, each reduced to a plain tensor with `full_tensor()`,
then combined; plain (replicated) tensors form their own group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def _by_mesh(parameters: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return groups


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    norms = []
    for params in _by_mesh(parameters).values():
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None], norm_type=norm_type, foreach=True
        )
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    # Stays on the device: a host copy here would stall the GPU queue once per step.
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]), ord=norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients so their global norm is at most `max_norm`; returns the norm before clipping (a
    device tensor: reading it on the host is the caller's choice of when to synchronize)."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    for params in _by_mesh(parameters).values():  # one foreach scaling per mesh (as torchtitan does under EP)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
