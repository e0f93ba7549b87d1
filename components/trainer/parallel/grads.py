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


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms]), ord=norm_type)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients so their global norm is at most `max_norm`; returns the norm before clipping."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coef.to(grad.device))
    return total
