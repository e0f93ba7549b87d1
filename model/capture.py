"""Recording the real inputs of a model's layers, to run each layer alone (local MFU, per-layer benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def _detach_inputs(obj):
    """Fresh leaves for floating tensors (so backward stops at the layer), everything else as is."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            return obj.detach().clone().requires_grad_(True)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_detach_inputs(x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach_inputs(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _detach_inputs(v) for k, v in obj.items()}
    return obj


def capture_layer_inputs(model: nn.Module, names: Iterable[str], run_forward: Callable[[], object]) -> dict:
    """Run one forward and record the (args, kwargs) each named submodule was called with (first call)."""
    captured: dict[str, tuple] = {}
    handles = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue

        def hook(mod, args, kwargs, output, _name=name):
            captured.setdefault(_name, (_detach_inputs(args), _detach_inputs(kwargs)))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return captured
