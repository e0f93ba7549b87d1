"""torchrun worker for tests/components/trainer/test_parallel_*.py: several checks per launch (torchrun
start-up dominates on CI). Usage: torchrun --nproc_per_node N parallel_worker.py OUT_DIR CHECK [CHECK ...].
Each rank writes OUT_DIR/<check>.rank<R>.json; the test asserts on them.

The single-process reference runs inside every rank on the whole global batch, without collectives.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gemrec.components.trainer.parallel import ParallelConfig, ParallelDims, parallelize
from gemrec.components.trainer.parallel.expert_parallel import apply_expert_parallel
from gemrec.components.trainer.parallel.sharding import fused_optimizer
from gemrec.model.moe import MoEFeedForward
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

CPU = torch.device("cpu")
TABLES = [("user", 64, 16), ("item", 96, 16), ("genre", 12, 16)]  # name, rows, dim
KEYS = [f"f_{name}" for name, _, _ in TABLES]


class Block(nn.Module):
    def __init__(self, d: int, moe: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.moe = MoEFeedForward(d, 2 * d, num_experts=4, top_k=2) if moe else None
        if self.moe is not None:  # large experts, so that their gradients move the loss visibly
            for w in (self.moe.experts.w1, self.moe.experts.w2, self.moe.experts.w3):
                nn.init.normal_(w, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        if self.moe is not None:
            x = x + self.moe(x)[0]  # aux loss left out: it is not additive over ranks' batches
        return x


class ToyRec(nn.Module):
    """EBC -> projection -> blocks (one with an MoE FFN) -> logit: the shape of the real model, small."""

    def __init__(self, d: int = 32, blocks: int = 3):
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{n}", num_embeddings=r, embedding_dim=e, feature_names=[f"f_{n}"])
                for n, r, e in TABLES
            ]
        )
        self.proj = nn.Linear(sum(e for _, _, e in TABLES) + 2, d)
        self.blocks = nn.ModuleList(Block(d, moe=i == 1) for i in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.cat([self.ebc(kjt).values(), dense], dim=1))
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def make_batch(seed: int, batch: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.cat(
        [
            torch.ones(batch, dtype=torch.long),
            torch.ones(batch, dtype=torch.long),
            torch.randint(0, 4, (batch,), generator=g),
        ]
    )
    values = torch.cat(
        [
            torch.randint(0, r, (int(n),), generator=g)
            for (_, r, _), n in zip(TABLES, lengths.view(len(TABLES), batch).sum(1))
        ]
    )
    kjt = KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)
    dense = torch.randn(batch, 2, generator=g)
    labels = (torch.rand(batch, generator=g) < 0.3).float()
    return kjt, dense, labels


def split_kjt(kjt: KeyedJaggedTensor, parts: int, index: int) -> KeyedJaggedTensor:
    """Rows [index * B/parts, (index+1) * B/parts) of every key."""
    by_key = kjt.to_dict()
    rows = kjt.stride() // parts
    lo, hi = index * rows, (index + 1) * rows
    values, lengths = [], []
    for key in KEYS:
        jt = by_key[key]
        offsets = jt.offsets()
        values.append(jt.values()[offsets[lo] : offsets[hi]])
        lengths.append(jt.lengths()[lo:hi])
    return KeyedJaggedTensor(keys=KEYS, values=torch.cat(values), lengths=torch.cat(lengths))


def build(seed: int = 0) -> ToyRec:
    torch.manual_seed(seed)
    return ToyRec()


def attach_sparse_sgd(model: nn.Module, lr: float = 0.5) -> None:
    _apply_optimizer_in_backward(torch.optim.SGD, list(model.ebc.parameters()), {"lr": lr})


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    tables = {id(p) for m in model.modules() if type(m).__name__.startswith("Sharded") for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in tables and not hasattr(p, "_in_backward_optimizers")]


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def train_losses(
    model: nn.Module, batches, rank: int, world: int, steps: int, first_grads: dict | None = None, bf16: bool = False
):
    """Mean global-batch loss per step; each rank trains on its contiguous slice of the global batch. The dense
    gradients of the first step go into `first_grads`. `bf16`: forward under bf16 autocast, as the trainer
    runs FSDP2 mixed precision."""
    # Plain SGD: linear in the gradients, so a wrong gradient average (a factor of 2 here or there) shows in
    # the losses; Adam's scale invariance would hide it.
    opt = torch.optim.SGD(dense_params(model), lr=0.1)
    losses = []
    for kjt, dense, labels in batches[:steps]:
        rows = labels.shape[0] // world
        sl = slice(rank * rows, (rank + 1) * rows)
        local = split_kjt(kjt, world, rank) if world > 1 else kjt
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(local, dense[sl])
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels[sl])
        loss.backward()
        if first_grads is not None and not losses:
            first_grads.update(full_grads(model))
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses


def check_train(mesh: str, rank: int, world: int) -> dict:
    """dp_replicate x dp_shard (x ep) mesh, tables sharded by the planner: loss trajectory vs one process."""
    mesh, _, option = mesh.partition("+")
    rep, shard, ep = (int(x) for x in mesh.split("x"))
    steps, global_batch = 6, 16
    batches = [make_batch(100 + s, global_batch) for s in range(steps)]
    reference = build()
    attach_sparse_sgd(reference)
    ref_grads, grads = {}, {}
    ref_losses = train_losses(reference, batches, 0, 1, steps, ref_grads)
    model = build()
    attach_sparse_sgd(model)
    dims = ParallelDims(world, dp_replicate=rep, dp_shard=shard, ep=ep)
    mixed = option == "zero2bf16"  # the layout measured on the H200: ZeRO-2, bf16 all-gathers and reductions
    config = ParallelConfig(
        dp_replicate=rep,
        dp_shard=shard,
        ep=ep,
        activation_checkpoint="full" if option == "ac" else "none",
        compile=option == "compile",
        reshard_after_forward=not mixed,
        param_dtype="bfloat16" if mixed else None,
        reduce_dtype="bfloat16" if mixed else None,
    )
    parallel = parallelize(model, dims, config, CPU)
    model, report = parallel.model, parallel.report
    losses = train_losses(model, batches, rank, world, steps, grads, bf16=mixed)
    # Relative error of every dense gradient of step 1 (a wrong average shows as 0.5 or 2 here).
    grad_err = {n: ((grads[n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in ref_grads.items()}
    return {
        "ref": ref_losses,
        "dist": losses,
        "grad_err": grad_err,
        "plan": report.embedding_plan,
        "blocks": report.fsdp_blocks,
        "ep_layers": report.expert_parallel,
        "compiled_root": report.compiled_root_modules,
        "checkpointed": report.activation_checkpointed,
    }


def check_sharding(sharding_type: str, rank: int, world: int) -> dict:
    """Sharded EBC (one plan type, or the planner's choice) vs the unsharded collection: lookups and one
    fused-SGD update of the tables."""
    torch.manual_seed(0)
    reference = ToyRec().ebc
    sharded_host = ToyRec()
    sharded_host.ebc.load_state_dict(reference.state_dict())
    for m in (reference, sharded_host.ebc):
        _apply_optimizer_in_backward(torch.optim.SGD, list(m.parameters()), {"lr": 0.5})
    types = [] if sharding_type == "planner" else [sharding_type]
    dims = ParallelDims(world)
    report = parallelize(sharded_host, dims, ParallelConfig(sharding_types=types), CPU).report
    kjt, _, _ = make_batch(7, 8 * world)
    local = split_kjt(kjt, world, rank)
    out = sharded_host.ebc(local).values()
    expected_local = reference(local).values()
    lookup_err = (out - expected_local).abs().max().item()
    # One update: every rank's loss is the sum of its pooled embeddings times fixed weights; the reference sees
    # the whole global batch with the loss divided by `world` (the mean over ranks).
    weights = torch.randn(out.shape[1], generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    (reference(kjt).values() * weights).sum().div(world).backward()
    after = sharded_host.ebc(local).values()
    update_err = (after - reference(local).values()).abs().max().item()
    return {
        "lookup_err": lookup_err,
        "update_err": update_err,
        "plan": report.embedding_plan,
        "changed": (after - out.detach()).abs().max().item(),
    }


def check_ep(rank: int, world: int) -> dict:
    """Expert-parallel dispatch/combine vs the single-process MoE: outputs and expert gradients."""
    dims = ParallelDims(world, ep=world)
    torch.manual_seed(0)
    reference = MoEFeedForward(8, 16, num_experts=2 * world, top_k=2)
    moe = copy.deepcopy(reference)
    apply_expert_parallel(moe.experts, dims.ep_mesh)
    xs = [torch.randn(9 + 5 * r, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    y, _ = moe(xs[rank])
    y.square().sum().backward()
    ys = [reference(x)[0] for x in xs]
    sum(t.square().sum() for t in ys).backward()
    grad_err = max(
        (getattr(moe.experts, n).grad.full_tensor() - getattr(reference.experts, n).grad).abs().max().item()
        for n in ("w1", "w2", "w3")
    )
    return {
        "out_err": (y - ys[rank]).abs().max().item(),
        "bitwise": bool(torch.equal(y, ys[rank])),
        "grad_err": grad_err,
        "local_experts": moe.experts.w1.to_local().shape[0],
    }


def check_metrics(rank: int, world: int) -> dict:
    """RankBalance (profiled compute, exposed communication) on a real FSDP + sharded-table step; rank 1 gets a
    batch 16 times as large, so the imbalance must show."""
    from gemrec.components.trainer.parallel.balance import RankBalance

    model = build()
    attach_sparse_sgd(model)
    model = parallelize(model, ParallelDims(world), ParallelConfig(), CPU).model
    opt = torch.optim.SGD(dense_params(model), lr=0.1)
    kjt, dense, labels = make_batch(5 + rank, 256 * (1 + 15 * rank))
    balance = RankBalance(CPU, profile_every=1)
    for _ in range(4):
        with balance.step():
            F.binary_cross_entropy_with_logits(model(kjt, dense), labels).backward()
            opt.step()
            opt.zero_grad()
    return balance.window()


GEM_MANIFEST = {
    "labels": ["like", "love"],
    "actions": ["rating", "like", "love"],
    "sparse_features": [
        {"name": "user_id", "source": "user", "num_embeddings": 50},
        {"name": "item_id", "source": "item", "num_embeddings": 100},
        {"name": "item_genres", "source": "item", "num_embeddings": 12, "multi_valued": True},
    ],
    "seq_item_features": ["item_genres"],
    "dense_features": ["hour_sin"],
}


def check_gem(backend: str, rank: int, world: int) -> dict:
    """The real GEM model (MoE interaction layer, jagged histories of different total length on each rank):
    FSDP2 + EP over all ranks, tables sharded by torchrec (or, for the torch backend, replicated), against the
    same model in one process on the same per-rank batches (loss = mean of the per-rank mean losses)."""
    from gemrec.model import FeatureSchema, ModelConfig, build_model
    from gemrec.model.synthetic import random_input

    schema = FeatureSchema.from_manifest(GEM_MANIFEST)
    config = ModelConfig(
        embedding_dim=8,
        d_model=16,
        num_heads=2,
        moe_hidden=16,
        head_hidden=16,
        pma_seeds=2,
        moe_num_experts=2 * world,
        embedding_backend=backend,
    )

    def build_gem():
        torch.manual_seed(0)
        model = build_model(config, schema)
        tables = [p for n, p in model.named_parameters() if n.startswith("embeddings.tables")]
        _apply_optimizer_in_backward(torch.optim.SGD, tables, {"lr": 0.5})
        return model

    steps = 4
    inputs = [[random_input(schema, 6, 8, seed=100 * s + r) for r in range(world)] for s in range(steps)]
    labels = [
        [(torch.rand(6, 2, generator=torch.Generator().manual_seed(7 * s + r)) < 0.4).float() for r in range(world)]
        for s in range(steps)
    ]

    def bce(model, inp, y):
        return F.binary_cross_entropy_with_logits(model(inp).logits, y)

    reference = build_gem()
    ref_opt = torch.optim.SGD(dense_params(reference), lr=0.1)
    ref_losses = []
    for s in range(steps):
        loss = sum(bce(reference, inputs[s][r], labels[s][r]) for r in range(world)) / world
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    model = build_gem()
    parallel = parallelize(model, ParallelDims(world, ep=world), ParallelConfig(ep=world), CPU)
    model, report = parallel.model, parallel.report
    opt = torch.optim.SGD(dense_params(model), lr=0.1)
    losses = []
    for s in range(steps):
        loss = bce(model, inputs[s][rank], labels[s][rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return {
        "ref": ref_losses,
        "dist": losses,
        "plan": report.embedding_plan,
        "blocks": report.fsdp_blocks,
        "ep_layers": report.expert_parallel,
        "tokens": [inputs[s][rank].num_tokens for s in range(steps)],
    }


def check_pipeline(rank: int, world: int) -> dict:
    """The sparse/dense pipeline (next batch's lookup all-to-all in flight during this step) trains the real
    GEM model exactly as the plain loop does, and every lookup used the prefetched input."""
    from gemrec.components.trainer.parallel.pipeline import SparseDistPipeline, gem_lookup_call
    from gemrec.model import FeatureSchema, ModelConfig, build_model
    from gemrec.model.synthetic import random_input

    schema = FeatureSchema.from_manifest(GEM_MANIFEST)
    config = ModelConfig(embedding_dim=8, d_model=16, num_heads=2, moe_hidden=16, head_hidden=16, pma_seeds=2)
    batches = [random_input(schema, 6, 8, seed=50 * s + rank) for s in range(5)]
    labels = [(torch.rand(6, 2, generator=torch.Generator().manual_seed(s)) < 0.4).float() for s in range(5)]

    def run(pipelined: bool):
        torch.manual_seed(0)
        model = build_model(config, schema)
        _apply_optimizer_in_backward(torch.optim.SGD, list(model.embeddings.tables.parameters()), {"lr": 0.5})
        model = parallelize(model, ParallelDims(world), ParallelConfig(), CPU).model
        opt = torch.optim.SGD(dense_params(model), lr=0.1)
        pipeline = SparseDistPipeline(model, gem_lookup_call(model), CPU) if pipelined else None
        stream = pipeline(batches) if pipelined else iter(batches)
        losses = []
        for step, inp in enumerate(stream):
            loss = F.binary_cross_entropy_with_logits(model(inp).logits, labels[step])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, (pipeline.hits, pipeline.misses) if pipeline else (0, 0)

    plain, _ = run(False)
    piped, (hits, misses) = run(True)
    return {"plain": plain, "pipelined": piped, "hits": hits, "misses": misses}


def check_sparse_2d_on_cpu(rank: int, world: int) -> dict:
    """2D sparse parallelism is CUDA-only (DMPCollection): on CPU parallelize must refuse it, saying what to do."""
    from gemrec.components.trainer.parallel import ParallelConfigError

    try:
        parallelize(build(), ParallelDims(world, sparse_shard=1), ParallelConfig(sparse_shard=1), CPU)
    except ParallelConfigError as err:
        return {"refused": str(err)}
    return {"refused": None}


def full_state(state: dict) -> dict:
    """Every tensor of a (nested) state dict as a full tensor on every rank (collective)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            for sub, t in full_state(value).items():
                out[f"{key}.{sub}"] = t
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
        elif isinstance(value, ShardedTensor):
            full = torch.zeros(value.size(), dtype=value.dtype)
            for shard in value.local_shards():
                idx = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
                full[idx] = shard.tensor
            dist.all_reduce(full)  # shards are disjoint: the sum assembles them
            out[key] = full
        elif isinstance(value, torch.Tensor):
            out[key] = value
    return out


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {
        "model": model.state_dict(),
        "dense_optim": get_optimizer_state_dict(model, optimizer),
        "sparse_optim": fused_optimizer(model).state_dict(),
    }


def parallel_toy(world: int, mesh: str, rank: int):
    rep, shard, ep = (int(x) for x in mesh.split("x"))
    model = build()
    _apply_optimizer_in_backward(torch.optim.Adagrad, list(model.ebc.parameters()), {"lr": 0.1})
    cfg = ParallelConfig(dp_replicate=rep, dp_shard=shard, ep=ep, sharding_types=["row_wise"])
    model = parallelize(model, ParallelDims(world, rep, shard, ep), cfg, CPU).model
    optimizer = torch.optim.AdamW(dense_params(model), lr=1e-2)
    return model, optimizer


def check_dcp_save(directory: str, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp

    model, optimizer = parallel_toy(world, "2x2x2", rank)
    for step in range(3):
        kjt, dense, labels = make_batch(200 + step, 4 * world)
        local = split_kjt(kjt, world, rank)
        rows = slice(rank * 4, rank * 4 + 4)
        F.binary_cross_entropy_with_logits(model(local, dense[rows]), labels[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = checkpoint_state(model, optimizer)
    dcp.save(state, checkpoint_id=directory)
    full = full_state(state)
    if rank == 0:
        torch.save(full, Path(directory) / "full_state.pt")
    return {"keys": len(full)}


def check_dcp_load(directory: str, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model, optimizer = parallel_toy(world, "1x2x2", rank)
    # One step materialises the optimizer states that DCP loads into.
    kjt, dense, labels = make_batch(999, 2 * world)
    F.binary_cross_entropy_with_logits(model(split_kjt(kjt, world, rank), dense[:2]), labels[:2]).backward()
    optimizer.step()
    optimizer.zero_grad()
    saved = torch.load(Path(directory) / "full_state.pt")
    before = full_state(checkpoint_state(model, optimizer))
    differed_before = sum(1 for k in saved if k in before and not torch.equal(saved[k], before[k]))
    state = checkpoint_state(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    set_optimizer_state_dict(model, optimizer, state["dense_optim"])
    fused_optimizer(model).load_state_dict(state["sparse_optim"])
    loaded = full_state(checkpoint_state(model, optimizer))
    mismatched = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
    missing = sorted(set(saved) ^ set(loaded))
    return {"keys": len(saved), "mismatched": mismatched, "missing": missing, "differed_before": differed_before}


def main() -> None:
    out_dir, checks = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for check in checks:
        name, _, arg = check.partition(":")
        try:
            if name == "train":
                result = check_train(arg, rank, world)
            elif name == "sharding":
                result = check_sharding(arg, rank, world)
            elif name == "gem":
                result = check_gem(arg, rank, world)
            elif name == "pipeline":
                result = check_pipeline(rank, world)
            elif name == "sparse2d_cpu":
                result = check_sparse_2d_on_cpu(rank, world)
            elif name == "metrics":
                result = check_metrics(rank, world)
            elif name == "ep":
                result = check_ep(rank, world)
            elif name == "dcp_save":
                result = check_dcp_save(str(out_dir / "ckpt"), rank, world)
            elif name == "dcp_load":
                result = check_dcp_load(arg, rank, world)
            else:
                raise ValueError(f"unknown check {check!r}")
        except Exception:  # reported to the test, which fails with the traceback
            result = {"error": traceback.format_exc()}
        safe = check.replace(":", "_").replace("/", "_")
        (out_dir / f"{safe}.rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
