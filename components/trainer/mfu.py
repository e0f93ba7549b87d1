"""Peak FLOP/s per device and model FLOPs utilisation (MFU), measured the way GEM reports it.

- E2E MFU: model FLOPs of the training steps (forward + backward from the real jagged lengths, no
  recomputation counted) / wall time / (peak x number of ranks).
- Local MFU: every layer run alone on one device on a captured real input (forward + backward, no
  communication, no recomputation), with the step's precision and, when the step is compiled, compiled
  itself (`torch.compile` of the layer), so that it bounds the step from above; per-layer MFU = its FLOPs /
  its time / peak; the local MFU is the FLOP-weighted mean of the per-layer MFUs.
- Scaling ratio = E2E MFU / local MFU: what the whole system keeps of the single-layer efficiency.

Nothing here imports torchrec, so the GPU benchmark can use it on a machine without torchrec.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import cast

import torch
from gemrec.model.capture import capture_layer_inputs
from torch import nn

# Dense bf16 tensor-core peak of one H200 SXM (NVIDIA datasheet, without sparsity).
H200_BF16_DENSE_PEAK_FLOPS = 989e12
H200_FP8_DENSE_PEAK_FLOPS = 1979e12  # datasheet, dense: what FP8 runs report their MFU against beside the bf16 peak
# An 8192^3 bf16 matmul through PyTorch on this workplace's H200s (random data; docs/benchmarks.md).
H200_BF16_MEASURED_PEAK_FLOPS = 799e12
# Same chip arithmetic as the H200.
H100_BF16_DENSE_PEAK_FLOPS = 989e12

GPU_PEAKS = {  # name substring -> (datasheet bf16 dense, measured or None)
    "H200": (H200_BF16_DENSE_PEAK_FLOPS, H200_BF16_MEASURED_PEAK_FLOPS),
    "H100": (H100_BF16_DENSE_PEAK_FLOPS, None),
}


@dataclass
class Peak:
    device: str  # e.g. "cpu (2 threads)" or "NVIDIA H200"
    flops: float  # the denominator of every MFU reported
    source: str  # "datasheet" | "measured matmul ceiling"
    measured_flops: float | None = None  # measured ceiling beside a datasheet number

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "flops": self.flops,
            "source": self.source,
            "measured_flops": self.measured_flops,
        }


def measure_matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int = 1024, seconds: float = 0.3) -> float:
    """Best FLOP/s of an n x n x n matmul on random data over about `seconds` (after one warm-up)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


def device_peak(device: torch.device, bf16: bool) -> Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (datasheet, measured) in GPU_PEAKS.items():
            if key in name and bf16:
                return Peak(name, datasheet, "datasheet", measured)
        dtype = torch.bfloat16 if bf16 else torch.float32
        ceiling = measure_matmul_ceiling(device, dtype, n=8192, seconds=1.0)
        return Peak(name, ceiling, "measured matmul ceiling", ceiling)
    ceiling = measure_matmul_ceiling(device, torch.float32)
    return Peak(f"cpu ({torch.get_num_threads()} threads)", ceiling, "measured matmul ceiling", ceiling)


def total_flops(layer_flops: Mapping[str, tuple[float, float]]) -> float:
    return float(sum(f + b for f, b in layer_flops.values()))


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


@dataclass
class LayerMFU:
    name: str
    flops: float  # forward + backward
    seconds: float  # one forward + backward of this layer alone
    mfu: float


def measure_local_mfu(
    model: nn.Module,
    layer_flops: Mapping[str, tuple[float, float]],
    run_forward: Callable[[], object],
    peak: float,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | Callable[[], contextlib.AbstractContextManager] | None = None,
    repeats: int = 3,
    compile: bool = False,
) -> tuple[float, list[LayerMFU]]:
    """Local MFU (FLOP-weighted mean of per-layer MFUs) and the per-layer table.

    Each layer named in `layer_flops` that is a submodule of `model` runs alone, forward + backward, on
    the input it saw in `run_forward()`; `compile`: each layer through `torch.compile` (as a compiled step
    runs it; compiling is in the warm-up, not the timing). Parameters that carry an in-backward optimizer
    (the fused sparse optimizer) are frozen meanwhile so the measurement never updates the model; dense grads
    are cleared. FLOP entries that are not submodules (DLRM's dot interaction) are left out of the table and the mean.
    """
    names = [n for n, (f, b) in layer_flops.items() if f + b > 0]
    captured = capture_layer_inputs(model, names, run_forward)
    frozen = [p for p in model.parameters() if hasattr(p, "_in_backward_optimizers") and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    make_autocast = autocast if callable(autocast) else (lambda: autocast or contextlib.nullcontext())
    table: list[LayerMFU] = []
    try:
        for name in names:
            if name not in captured:
                continue
            module = model.get_submodule(name)
            if compile:
                module = cast(nn.Module, torch.compile(module))  # an OptimizedModule, typed as a callable
            args, kwargs = captured[name]
            leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]

            def step(module=module, args=args, kwargs=kwargs, leaves=leaves):
                with make_autocast():
                    out = module(*args, **kwargs)
                outs = [t for t in _tensors(out) if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                for t in leaves:
                    t.grad = None

            for _ in range(2 if compile else 1):  # warm-up; compiled: the first compiles forward and backward
                step()
            sync()
            times = []
            for _ in range(max(1, repeats)):
                start = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - start)
            seconds = sorted(times)[len(times) // 2]
            flops = float(sum(layer_flops[name]))
            table.append(LayerMFU(name, flops, seconds, flops / seconds / peak))
    finally:
        for p in frozen:
            p.requires_grad_(True)
        model.zero_grad(set_to_none=True)
    weight = sum(row.flops for row in table)
    local = sum(row.flops * row.mfu for row in table) / weight if weight > 0 else float("nan")
    return local, table
