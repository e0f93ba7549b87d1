"""Rank balance and communication metrics, logged per window by the trainer.

`RankBalance.step()` wraps the compute of one training step (forward, backward, optimizer; not the wait for
data). Every step's wall time is taken (CUDA events on GPU, so the host never waits inside the step); one step in
`profile_every` also runs under `torch.profiler`, which splits its time into compute and communication: with
synchronous collectives the wall time of every rank is the slowest rank's, so only the profiler's compute time
shows which rank is slow. `window()` all-gathers the per-rank numbers and returns

    rank_imbalance        max / mean over ranks of the profiled compute seconds per step (1.0 = balanced)
    exposed_comm_s        communication time per step not hidden under compute (mean over ranks)
    comm_s, compute_s     per step, mean over ranks; step_s_max / step_s_mean: wall time per step

Communication = NCCL kernels on GPU; on CPU the gloo/c10d collectives (they block the calling thread, so there
they are all exposed unless another thread computes). Compute = every other GPU kernel, or on CPU every leaf
operator outside a collective.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

COMM_MARKERS = (
    "nccl",
    "gloo",
    "c10d::",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "all_to_all",
    "alltoall",
    "broadcast",
    "record_param_comms",
)


def is_communication(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in COMM_MARKERS)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def union_length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in _merged(intervals))


def uncovered_length(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` outside the union of `cover`."""
    return union_length(intervals + cover) - union_length(cover)


def _span(event) -> tuple[float, float]:
    return event.time_range.start / 1e6, event.time_range.end / 1e6


def split_profile(events) -> tuple[list, list]:
    """(communication intervals, compute intervals) in seconds from profiler events."""
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    if gpu:
        comm = [_span(e) for e in gpu if is_communication(e.name)]
        compute = [_span(e) for e in gpu if not is_communication(e.name)]
        return comm, compute
    comm, compute = [], []

    def inside_comm(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if is_communication(parent.name):
                return True
            parent = parent.cpu_parent
        return False

    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or inside_comm(e):
            continue
        if is_communication(e.name):
            comm.append(_span(e))
        elif not e.cpu_children:
            compute.append(_span(e))
    return comm, compute


def communication_breakdown(events, top: int = 12) -> dict[str, list[dict]]:
    """Which collectives cost what: per kernel name (count, total and exposed ms), and the `top` most exposed
    single collectives with their start (ms from the first kernel of the profile)."""
    comm: list = []
    compute: list = []
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in gpu:
        (comm if is_communication(e.name) else compute).append((_span(e), e.name))
    if not comm:
        return {"by_name": [], "most_exposed": []}
    cover = _merged([span for span, _ in compute])
    origin = min(span[0] for span, _ in comm + compute)
    by_name: dict[str, dict] = {}
    single = []
    for (lo, hi), name in comm:
        covered = sum(max(0.0, min(hi, c_hi) - max(lo, c_lo)) for c_lo, c_hi in cover if c_lo < hi and c_hi > lo)
        exposed = (hi - lo) - covered
        row = by_name.setdefault(name, {"name": name, "count": 0, "ms": 0.0, "exposed_ms": 0.0})
        row["count"] += 1
        row["ms"] += 1000 * (hi - lo)
        row["exposed_ms"] += 1000 * exposed
        single.append(
            {"name": name, "start_ms": 1000 * (lo - origin), "ms": 1000 * (hi - lo), "exposed_ms": 1000 * exposed}
        )
    return {
        "by_name": sorted(by_name.values(), key=lambda r: -r["exposed_ms"]),
        "most_exposed": sorted(single, key=lambda r: -r["exposed_ms"])[:top],
    }


def exposed_communication(events, steps: int = 1) -> dict[str, float]:
    comm, compute = split_profile(events)
    steps = max(steps, 1)
    comm_s, exposed_s = union_length(comm), uncovered_length(comm, compute)
    return {
        "comm_s": comm_s / steps,
        "compute_s": union_length(compute) / steps,
        "exposed_comm_s": exposed_s / steps,
    }


class RankBalance:
    def __init__(self, device: torch.device, profile_every: int = 20, trace_dir=None):
        """`trace_dir`: also keep each profiled step's collective breakdown (`breakdowns`) and write its
        Chrome trace there (`trace_rank<R>_<N>.json.gz`)."""
        self.device = device
        self.trace_dir = trace_dir
        self.breakdowns: list[dict] = []
        self.profile_every = max(1, profile_every)
        self._cuda = device.type == "cuda"
        self._events: list[tuple] = []
        self._wall = 0.0
        self._steps = 0
        self._profiled: list[dict[str, float]] = []

    @contextmanager
    def step(self):
        # One process has no communication to split out: it skips the (costly) profiler.
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        profile = distributed and self._steps % self.profile_every == 0
        self._steps += 1
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                with self._timed():
                    yield
                if self._cuda:
                    torch.cuda.synchronize(self.device)
            self._profiled.append(exposed_communication(prof.events()))
            if self.trace_dir is not None:
                self.breakdowns.append(communication_breakdown(prof.events()))
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(self.trace_dir / f"trace_rank{dist.get_rank()}_{self._steps}.json.gz"))
        else:
            with self._timed():
                yield

    @contextmanager
    def _timed(self):
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self._wall += time.perf_counter() - start

    def window(self) -> dict[str, float]:
        """Metrics of the steps since the last call (a collective when distributed: every rank calls it)."""
        for start, end in self._events:
            end.synchronize()
            self._wall += start.elapsed_time(end) / 1e3
        self._events.clear()
        steps = max(self._steps, 1)
        profiled = self._profiled or [{"comm_s": 0.0, "compute_s": self._wall / steps, "exposed_comm_s": 0.0}]
        local = torch.tensor(
            [
                self._wall / steps,
                *(sum(p[k] for p in profiled) / len(profiled) for k in ("compute_s", "comm_s", "exposed_comm_s")),
            ],
            dtype=torch.float64,
        )
        self._wall, self._steps, self._profiled = 0.0, 0, []
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            gathered = [torch.zeros_like(local, device=comm_device) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local.to(comm_device))
            per_rank = torch.stack(gathered).cpu()
        else:
            per_rank = local[None]
        wall, compute, comm, exposed = per_rank.unbind(1)
        mean_compute = float(compute.mean())
        return {
            "step_s_max": float(wall.max()),
            "step_s_mean": float(wall.mean()),
            "compute_s_max": float(compute.max()),
            "compute_s_mean": mean_compute,
            "rank_imbalance": float(compute.max()) / mean_compute if mean_compute > 0 else float("nan"),
            "slowest_rank": int(compute.argmax()) if mean_compute > 0 else -1,
            "comm_s": float(comm.mean()),
            "exposed_comm_s": float(exposed.mean()),
        }
