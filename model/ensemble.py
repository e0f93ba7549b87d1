"""Independently trained models of one architecture, predicting together: the mean of their logits plus one offset
per task (fitted on the valid split by the trainer's ensemble coordinator, `components/trainer/ensemble.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gemrec.model.inputs import ModelInput, ModelOutput
from torch import nn


class Ensemble(nn.Module):
    logit_offset: torch.Tensor  # (num_tasks,)

    def __init__(self, members: Sequence[nn.Module], num_tasks: int):
        super().__init__()
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = nn.ModuleList(members)
        self.register_buffer("logit_offset", torch.zeros(num_tasks))

    def forward(self, inp: ModelInput) -> ModelOutput:
        outputs = [member(inp) for member in self.members]
        logits = torch.stack([out.logits for out in outputs]).mean(0)
        aux_loss = torch.stack([out.aux_loss for out in outputs]).mean()
        return ModelOutput(logits=logits + self.logit_offset.to(logits.dtype), aux_loss=aux_loss)
