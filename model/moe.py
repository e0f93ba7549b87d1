"""Mixture-of-experts feed-forward: top-k routing, dropless, with a load-balancing auxiliary loss.

The forward is three explicit steps so expert parallelism can cut between them:

    weights, experts, aux = moe.route(x)                          # router (replicated)
    x_sorted, tokens_per_expert, order = moe.dispatch(x, experts)  # tokens grouped by expert
    y_sorted = moe.experts(x_sorted, tokens_per_expert)            # GroupedExperts: the sharded part
    y = moe.combine(y_sorted, order, weights)                      # back to token order, weighted sum

`GroupedExperts` holds every expert's weights stacked, `w1`/`w3` of shape `[num_experts, dim, hidden]`
and `w2` of shape `[num_experts, hidden, dim]` (SwiGLU). Expert parallelism shards dim 0 of the three
and wraps `experts` with an all-to-all: after `dispatch` each rank sends the rows of `x_sorted` of the
experts it does not own (counts from `tokens_per_expert`), runs its local experts, and sends results
back before `combine`. Nothing else in the model touches the expert weights.

Aux loss (Switch Transformer): num_experts * sum_e f_e * P_e, where f_e is the fraction of the N * k
assignments routed to expert e and P_e the mean router probability of e; 1.0 when perfectly balanced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import flop_registry, register_flop_formula

# grouped_mm needs 16-byte aligned strides; each expert's row group is padded to a multiple of this.
_GROUP_ALIGN = 16


def _grouped_extent(offs: torch.Tensor | None, size: int) -> int:
    """How much of the grouped dim the groups cover: offs[-1] (a host read), or all of it under fake tensors."""
    if offs is None or offs.numel() == 0:
        return size
    try:
        return int(offs[-1])
    except (RuntimeError, NotImplementedError):  # fake tensors (compile-time counting): the padded size
        return size


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *args, **kwargs) -> int:
    """2 x multiply-adds of `torch._grouped_mm` (torch's FlopCounterMode has no formula for it and counted the
    experts of the CUDA MoE path as 0). The jagged dim is the one `offs` cuts: the rows of a 2-D `a` against a
    3-D `b`, the columns of a 2-D `b` against a 3-D `a`, the contraction of two 2-D operands (a weight gradient)."""
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if a.dim() == 2 and b.dim() == 3:
        return 2 * _grouped_extent(offs, a.shape[0]) * a.shape[1] * b.shape[2]
    if a.dim() == 3:
        return 2 * a.shape[1] * a.shape[2] * _grouped_extent(offs, b.shape[1])
    return 2 * a.shape[0] * _grouped_extent(offs, a.shape[1]) * b.shape[1]


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_registry:
    register_flop_formula(torch.ops.aten._grouped_mm, get_raw=True)(grouped_mm_flops)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, hidden: int, init_std: float = 0.02):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, std=init_std)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """`x_sorted` (n, dim): rows grouped by expert in expert order, `tokens_per_expert[e]` rows each."""
        if x_sorted.is_cuda and hasattr(torch, "_grouped_mm") and _compute_dtype(x_sorted) == torch.bfloat16:
            return self._grouped(x_sorted, tokens_per_expert)
        return self._looped(x_sorted, tokens_per_expert)

    def _looped(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Reference path: one matmul chain per expert (reads the counts on the host).
        outs = []
        for e, xe in enumerate(torch.split(x_sorted, tokens_per_expert.tolist())):
            hidden = F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])
            outs.append(hidden @ self.w2[e])
        return torch.cat(outs)

    def _grouped(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # CUDA path: torch._grouped_mm over aligned row groups, no host sync.
        n, dtype = x_sorted.shape[0], torch.bfloat16
        counts = tokens_per_expert.long()
        padded = (counts + _GROUP_ALIGN - 1) // _GROUP_ALIGN * _GROUP_ALIGN
        ends = torch.cumsum(padded, 0)
        starts_padded, starts = ends - padded, torch.cumsum(counts, 0) - counts
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_experts, device=x_sorted.device), counts, output_size=n
        )
        dest = starts_padded[expert_of_row] + torch.arange(n, device=x_sorted.device) - starts[expert_of_row]
        capacity = n + self.num_experts * _GROUP_ALIGN
        xp = x_sorted.new_zeros(capacity, self.dim, dtype=dtype).index_copy(0, dest, x_sorted.to(dtype))
        offs = ends.to(torch.int32)
        hidden = F.silu(torch._grouped_mm(xp, self.w1.to(dtype), offs=offs)) * torch._grouped_mm(
            xp, self.w3.to(dtype), offs=offs
        )
        return torch._grouped_mm(hidden, self.w2.to(dtype), offs=offs)[dest]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts; `forward(x) -> (y, aux_loss)` with x of shape (tokens, dim)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"MoE: top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        nn.init.trunc_normal_(self.router.weight, std=init_std)
        self.experts = GroupedExperts(num_experts, dim, hidden, init_std)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights (n, k), experts (n, k), aux_loss); weights renormalised over the chosen k."""
        probs = self.router(x).float().softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        n = max(x.shape[0], 1)
        assigned = torch.zeros(self.num_experts, device=x.device).scatter_add_(
            0, experts.reshape(-1), torch.ones(experts.numel(), device=x.device)
        )
        aux = self.num_experts * torch.sum(assigned / (n * self.top_k) * probs.sum(0) / n)
        return weights, experts, aux

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_sorted (n*k, dim), tokens_per_expert (E,), order): token copies grouped by expert."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        return x.index_select(0, order // self.top_k), tokens_per_expert, order

    def combine(self, y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = weights.shape[0]
        y = y_sorted.new_empty(y_sorted.shape).index_copy(0, order, y_sorted)
        return (y.view(n, self.top_k, y.shape[-1]) * weights.unsqueeze(-1).to(y.dtype)).sum(1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts, aux = self.route(x)
        x_sorted, tokens_per_expert, order = self.dispatch(x, experts)
        y_sorted = self.experts(x_sorted, tokens_per_expert)
        return self.combine(y_sorted, order, weights).to(x.dtype), aux

    def flops(self, tokens: int) -> tuple[int, int]:
        """Matmul FLOPs (forward, backward) for `tokens` rows; dropless, so exactly k expert passes each."""
        dim, hidden = self.experts.dim, self.experts.hidden
        router = 2 * tokens * dim * self.num_experts
        experts = 3 * 2 * tokens * self.top_k * dim * hidden
        return router + experts, 2 * (router + experts)
