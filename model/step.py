"""The training step of a gemrec model: forward under the caller's autocast, the multi-task loss, backward, then the
optimizer. `gemrec train` runs it and every benchmark times it (`gemrec bench train`, `gemrec bench model`, the
scaling benchmark), so a benchmark measures exactly what training runs. Models trained on another objective
(next-item retrieval in `gemrec bench seqrec`) pass it as `objective` and run the same step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from gemrec.model.gem import loss
from gemrec.model.inputs import ModelInput, ModelOutput
from torch import nn


@dataclass
class StepResult:
    loss: torch.Tensor  # the step's loss, detached (reading it syncs the device)
    output: ModelOutput | None  # the forward's output (logits per task); None with an `objective`


def train_step(
    model: nn.Module,
    inp: ModelInput,
    labels: torch.Tensor | None,
    *,
    task_weights: Sequence[float] | torch.Tensor | None = None,
    autocast: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    optimizer_step: Callable[[], object] | None = None,
    objective: Callable[[nn.Module, ModelInput], torch.Tensor] | None = None,
) -> StepResult:
    """One step on a batch already on the model's device. `autocast()` opens the forward's precision context;
    `optimizer_step()` (clip, step, zero the gradients) runs after backward, none for forward + backward alone.
    `objective(model, inp)`: the batch's loss instead of the multi-task loss of `model(inp)` against `labels`."""
    output = None
    with autocast():
        if objective is not None:
            total = objective(model, inp)
        else:
            output = model(inp)
    if objective is None:
        if output is None or labels is None:
            raise ValueError("train_step needs labels (or an objective) for the loss")
        total = loss(output, labels, task_weights)
    with torch.autograd.set_multithreading_enabled(False):  # no hand-off to autograd's device thread (host time)
        total.backward()
    if optimizer_step is not None:
        optimizer_step()
    return StepResult(total.detach(), output)
