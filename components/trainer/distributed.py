"""Process context: alone or under torchrun (rank, world size, device, the collectives the train loop uses)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return float(t.item())

    def all_reduce_max(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def broadcast_from_main(self, value: float) -> float:
        """Rank 0's `value` on every rank (what rank 0 decided, e.g. a validation metric only it computed)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.broadcast(t, src=0)
        return float(t.item())

    def gather_objects(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere); `[obj]` when alone."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(device: str = "auto") -> DistContext:
    """Read torchrun's environment; start a process group (gloo on CPU, nccl on GPU) when world_size > 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
