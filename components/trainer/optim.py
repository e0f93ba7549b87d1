"""Optimizers: row-wise Adagrad on embedding tables fused into backward, AdamW on the dense rest.

The sparse optimizer is attached with `torch.distributed.optim._apply_optimizer_in_backward` (what
torchrec's `apply_optimizer_in_backward` forwards to): each table updates as soon as its gradient is
ready and its gradient is freed, and torchrec's sharder turns the same annotation into a fused FBGEMM
kernel (`EmbOptimType.EXACT_ROWWISE_ADAGRAD`) when the parallelism layer shards the tables. The
optimizer class is `torchrec.optim.RowWiseAdagrad`; where torchrec is absent (the GPU benchmark
machine) `RowWiseAdagrad` below does the same update without torchrec (and without its per-step host sync).
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from gemrec.components.trainer.config import OptimConfig
from gemrec.components.trainer.parallel.grads import clip_grad_norm_, total_grad_norm
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per table row (FBGEMM's EXACT_ROWWISE_ADAGRAD, torchrec's RowWiseAdagrad
    without weight or lr decay): sum_r += mean_j g_rj^2, then w_r -= lr * g_r / (sqrt(sum_r) + eps)."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-10):
        if lr <= 0 or eps < 0:
            raise ValueError(f"RowWiseAdagrad: lr must be > 0 and eps >= 0, got lr={lr}, eps={eps}")
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse or param.ndim != 2:
                    raise RuntimeError("RowWiseAdagrad updates dense 2-D table weights (rows x dim)")
                state = self.state[param]
                if "sum" not in state:
                    state["sum"] = torch.zeros(param.shape[0], 1, device=param.device, dtype=torch.float32)
                row_sq = torch.linalg.vector_norm(grad, dim=1, keepdim=True, dtype=torch.float32).square_()
                state["sum"].add_(row_sq, alpha=1.0 / param.shape[1])
                param.addcdiv_(grad, state["sum"].sqrt().add_(group["eps"]), value=-group["lr"])
        return None


def sparse_optimizer_class() -> tuple[type[torch.optim.Optimizer], str]:
    try:
        from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
    except ImportError:
        return RowWiseAdagrad, "gemrec RowWiseAdagrad (torchrec not installed)"
    return TorchrecRowWiseAdagrad, "torchrec.optim.RowWiseAdagrad"


TABLE_MODULES = ("EmbeddingBagCollection", "EmbeddingCollection", "TorchTables")


def embedding_parameter_names(model: nn.Module) -> list[str]:
    """Names of the embedding-table weights: every parameter of an Embedding/EmbeddingBag, a torchrec table
    collection or the model's fused torch tables (`gemrec.model.embeddings.TorchTables`)."""
    names = []
    table_types: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag)
    for module_name, module in model.named_modules():
        if isinstance(module, table_types) or type(module).__name__ in TABLE_MODULES:
            for param_name, _ in module.named_parameters(recurse=True):
                names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return sorted(set(names))


def apply_sparse_optimizer(model: nn.Module, config: OptimConfig) -> str:
    """Attach row-wise Adagrad to every embedding table, run in backward; call before parallelizing."""
    params = dict(model.named_parameters())
    tables = [params[n] for n in embedding_parameter_names(model) if params[n].requires_grad]
    sparse_cls, kind = sparse_optimizer_class()
    if tables:
        _apply_optimizer_in_backward(sparse_cls, tables, {"lr": config.sparse_lr, "eps": config.sparse_eps})
    return kind


class Optimizers:
    """AdamW + LR schedule over the dense parameters, and the in-backward sparse optimizers already
    attached by `apply_sparse_optimizer`; saved and loaded together."""

    def __init__(self, model: nn.Module, config: OptimConfig, total_steps: int):
        self.config = config
        self.total_steps = max(1, total_steps)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sparse_params = {n: p for n, p in named if hasattr(p, "_in_backward_optimizers")}
        self.dense_named = [(n, p) for n, p in named if n not in self.sparse_params]
        decay = [p for n, p in self.dense_named if p.ndim >= 2]
        no_decay = [p for n, p in self.dense_named if p.ndim < 2]
        # One fused kernel per step (the H200 profile showed 8 ms/step in the multi-tensor AdamW; on the CPU the
        # default per-tensor loop is ~5 ops per tensor, a dispatch cost per step).
        fused = bool(self.dense_named) and all(p.device.type in ("cpu", "cuda") for _, p in self.dense_named)
        self.dense = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.dense_lr,
            betas=config.betas,
            eps=config.eps,
            fused=True if fused else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.dense, self.lr_factor)
        self.set_sparse_lr(self.lr_factor(0))
        log.info(
            "optimizers: AdamW over %d dense tensors, in-backward sparse optimizer over %d tables",
            len(self.dense_named),
            len(self.sparse_params),
        )

    def lr_factor(self, step: int) -> float:
        """Linear warmup to 1, then cosine/linear decay to min_lr_ratio at the last step."""
        c = self.config
        if c.warmup_steps > 0 and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.decay == "constant":
            return 1.0
        span = max(1, self.total_steps - c.warmup_steps)
        progress = min(1.0, (step - c.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if c.decay == "cosine" else 1.0 - progress
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * shape

    def sparse_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {name: p._in_backward_optimizers[0] for name, p in self.sparse_params.items()}

    def set_sparse_lr(self, factor: float) -> None:
        for opt in self.sparse_optimizers().values():
            for group in opt.param_groups:
                group["lr"] = self.config.sparse_lr * factor
            if getattr(opt, "_emb_module", None) is not None:
                opt.step()  # a torchrec fused (sharded) table optimizer takes a new lr only in step()

    def clip_and_step(self) -> torch.Tensor:
        """Clip dense grads, step AdamW and the schedule; returns the pre-clip dense grad norm (on the device)."""
        grads = [p for _, p in self.dense_named if p.grad is not None]
        clip = self.config.grad_clip
        if clip > 0 and grads and self.dense.defaults["fused"] and not any(isinstance(p.grad, DTensor) for p in grads):
            # The fused kernel divides each gradient by `grad_scale` as it reads it (the AMP unscaling hook): the
            # clip costs no pass of its own over the gradients.
            norm = total_grad_norm(grads)
            self.dense.grad_scale = torch.clamp((norm + 1e-6) / clip, min=1.0)  # type: ignore[attr-defined]
        elif clip > 0 and grads:
            # Mesh-aware: under expert parallelism the gradients are DTensors on different meshes.
            norm = clip_grad_norm_(grads, clip)
        elif grads:
            norm = total_grad_norm(grads)
        else:
            norm = torch.zeros(())
        self.dense.step()
        self.dense.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.set_sparse_lr(self.lr_factor(self.scheduler.last_epoch))
        return norm

    # Checkpoint state: string keys all the way down (DCP flattens nested dicts).
    def state_dict(self) -> dict:
        dense_names = {id(p): n for n, p in self.dense_named}
        dense_state = {dense_names[id(p)]: dict(s) for p, s in self.dense.state.items()}
        sparse_state = {
            name: dict(opt.state[self.sparse_params[name]]) for name, opt in self.sparse_optimizers().items()
        }
        return {"dense": dense_state, "sparse": sparse_state, "scheduler": {"last_epoch": self.scheduler.last_epoch}}

    def load_state_dict(self, state: dict) -> None:
        params = dict(self.dense_named)
        for name, s in state["dense"].items():
            self.dense.state[params[name]] = dict(s)
        for name, opt in self.sparse_optimizers().items():
            if name in state["sparse"]:
                opt.state[self.sparse_params[name]] = dict(state["sparse"][name])
        # Only the position is restored: the schedule's shape comes from the current config.
        self.scheduler.last_epoch = int(state["scheduler"]["last_epoch"])
        factor = self.lr_factor(self.scheduler.last_epoch)
        for group, base in zip(self.dense.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * factor
        self.set_sparse_lr(factor)

    def empty_state_template(self) -> dict:
        """A state dict with the right structure and shapes for DCP to load into (states materialised)."""
        for _, p in self.dense_named:
            if p not in self.dense.state:
                self.dense.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        return self.state_dict()


class WeightAverage:
    """Exponential moving average of a model's floating-point parameters (Polyak averaging), evaluated in place of
    the live weights; buffers (running statistics, constants such as infinite bin edges) stay the live ones. The
    decay ramps up as min(decay, (1 + n) / (10 + n)) over the first updates, so early averages are not dominated by
    the initial weights."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"WeightAverage: decay must be in (0, 1), got {decay}")
        named = [(name, p.detach()) for name, p in model.named_parameters() if p.is_floating_point()]
        self.names = [name for name, _ in named]
        self.live = [t for _, t in named]
        self.average = [t.detach().clone() for t in self.live]
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update(self) -> None:
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        self.updates += 1
        torch._foreach_lerp_(self.average, self.live, 1.0 - decay)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The model holds the averaged weights from here on (the end of training)."""
        torch._foreach_copy_(self.live, self.average)

    @contextlib.contextmanager
    def applied(self):
        """The model holds the averaged weights inside the block, its live weights again after it."""
        saved = [t.clone() for t in self.live]
        self.copy_to_model()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.live, saved)

    # Checkpoint state (DCP loads the tensors in place): the averaged tensors by state-dict name and the ramp's count.
    def state_dict(self) -> dict:
        return {"weights": dict(zip(self.names, self.average)), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.average, [state["weights"][name] for name in self.names])
        self.updates = int(state["updates"])
