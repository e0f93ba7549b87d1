"""Precision conversion: the trainer turns the vanilla model's MLPs and MoE experts into FP8 ones before
`parallelize` (as torchtitan's float8 converter swaps nn.Linear for float8 linears); the model never knows.

`[train] precision = "fp8"` runs everything else as "auto" does (bf16 autocast on a GPU; fp32 on a CPU) and
converts every `Mlp` (fc1 -> gelu -> fc2) and every `GroupedExperts` (the MoE's SwiGLU experts) whose name no
`[fp8] overrides` pattern sends back to "bf16" (settings: `Fp8Config`). Converting swaps the module's class for a
subclass whose forward calls the block-scaled FP8 ops of `gemrec.kernels.fp8`; parameters, their names and the
state dict stay the same, so checkpoints move freely between precisions. Embedding projections, the router,
attention projections and the task heads are never converted (the stability recipe: first and last layers bf16).
With `[fp8] attention = true` the attention layers' own products (QK^T, PV) run the FP8 forward too
(`KernelOptions.fp8` on the layer), by the same overrides.

On CUDA the ops run the Triton kernels; elsewhere the torch emulation (quantize -> dequantize -> fp32 matmul),
so CPU runs and CI exercise the same conversion, scaling and counters.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import torch
from gemrec.components.trainer.config import Fp8Config
from gemrec.kernels import KernelOptions, fp8
from gemrec.model.layers import JaggedAttention, Mlp
from gemrec.model.moe import GroupedExperts
from torch import nn


def _training_stats(module: Fp8Mlp | Fp8GroupedExperts) -> fp8.Fp8Stats | None:
    """The module's scaling state in training; in evaluation none: dynamic scales, and no amax or counter of an
    eval batch enters the training's histories."""
    return module.fp8_stats if module.training else None


class Fp8Mlp(Mlp):
    """An `Mlp` whose fc1 -> gelu -> fc2 runs through `gemrec.kernels.fp8.fp8_mlp`."""

    fp8_recipe: fp8.Fp8Recipe
    fp8_stats: fp8.Fp8Stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.fc1, self.fc2
        return fp8.fp8_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, self.fp8_recipe, _training_stats(self))


class Fp8GroupedExperts(GroupedExperts):
    """`GroupedExperts` whose SwiGLU runs through `gemrec.kernels.fp8.fp8_grouped_swiglu`."""

    fp8_recipe: fp8.Fp8Recipe
    fp8_stats: fp8.Fp8Stats

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return fp8.fp8_grouped_swiglu(
            x_sorted, tokens_per_expert, self.w1, self.w3, self.w2, self.fp8_recipe, _training_stats(self)
        )


# The stability recipe's last layers: GEM's towers that feed the task heads (`fp8.top_layers_bf16`).
TOP_LAYERS = ("nonseq_tower.*", "interaction.*")
_CONVERSIONS = {Mlp: (Fp8Mlp, fp8.MLP_ROLES), GroupedExperts: (Fp8GroupedExperts, fp8.EXPERT_ROLES)}


def module_precision(name: str, overrides: Mapping[str, str]) -> str:
    """ "fp8" unless the last `overrides` glob that matches `name` says otherwise."""
    choice = "fp8"
    for pattern, value in overrides.items():
        if fnmatch.fnmatchcase(name, pattern):
            choice = value
    return choice


def convert_to_fp8(model: nn.Module, config: Fp8Config, device: torch.device) -> list[str]:
    """Convert in place (before `parallelize`); returns the converted modules' names. An override pattern that
    matches no module is refused (a typo would silently keep a layer in FP8)."""
    recipe = fp8.Fp8Recipe(
        grad_format=fp8.fp8_format(config.grad_format),
        backend="triton" if device.type == "cuda" else "reference",
        gemm=config.gemm,
    )
    history = config.amax_history if config.scaling == "delayed" else 0
    overrides = {**({p: "bf16" for p in TOP_LAYERS} if config.top_layers_bf16 else {}), **config.overrides}
    converted = []
    for name, module in model.named_modules():
        if isinstance(module, JaggedAttention) and config.attention and module_precision(name, overrides) == "fp8":
            if module.rope_base:
                raise ValueError(
                    f"fp8.attention: {name} fuses RoPE (rope_base), which the FP8 attention forward does not "
                    f"support; keep it bf16 with fp8.overrides = {{'{name}' = 'bf16'}}"
                )
            module.kernel_options = dataclasses.replace(module.kernel_options or KernelOptions(), fp8=True)
            converted.append(name)
            continue
        target = _CONVERSIONS.get(type(module))
        if target is None or module_precision(name, overrides) != "fp8":
            continue
        cls, roles = target
        module.__class__ = cls
        module.fp8_recipe = recipe
        module.fp8_stats = fp8.Fp8Stats(roles, history, device)
        converted.append(name)
    names = [name for name, _ in model.named_modules()]
    unmatched = sorted(p for p in config.overrides if not fnmatch.filter(names, p))
    if unmatched:
        raise ValueError(f"fp8.overrides: pattern(s) {unmatched} match no module name (e.g. 'interaction.*')")
    return converted


def fp8_stats(model: nn.Module) -> list[tuple[str, fp8.Fp8Stats]]:
    return [(name, m.fp8_stats) for name, m in model.named_modules() if isinstance(m, (Fp8Mlp, Fp8GroupedExperts))]


def collect_counters(model: nn.Module, on: bool) -> None:
    """Turn the overflow/underflow counters on (for the next step) or off."""
    for _, stats in fp8_stats(model):
        stats.collect = on


def after_step(model: nn.Module) -> None:
    """After each optimizer step: amaxes into the delayed-scaling histories."""
    for _, stats in fp8_stats(model):
        stats.step()


def counters(model: nn.Module) -> dict[str, float]:
    """Counters since the last call, summed over modules per tensor role, then reset: `fp8/<role>_overflow` and
    `fp8/<role>_underflow` (fractions of the non-zero values) and `fp8/nonfinite` (a count)."""
    totals: dict[str, torch.Tensor] = {}
    for _, stats in fp8_stats(model):
        for role, row in zip(stats.roles, stats.counts):
            totals[role] = totals.get(role, 0) + row.cpu()
        stats.reset_counts()
    out: dict[str, float] = {}
    nonfinite = 0
    for role, (overflow, underflow, nonzero, bad) in ((r, t.tolist()) for r, t in totals.items()):
        if nonzero:
            out[f"fp8/{role}_overflow"] = overflow / nonzero
            out[f"fp8/{role}_underflow"] = underflow / nonzero
        nonfinite += bad
    if totals:
        out["fp8/nonfinite"] = float(nonfinite)
    return out
