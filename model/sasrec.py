"""SASRec (Kang and McAuley, ICDM 2018), the next-item baseline of the sequential-recommendation tables.

As S3-Rec's and ICLRec's implementation of it: item embedding plus a learned position embedding (counted
from the end of the history, as their left-padded windows do), LayerNorm and dropout, causal transformer
layers, and items scored by the dot product with the same item table. The layers are the model's own
`SeqLayer`, post-norm as theirs (attention through the one dispatch point, so no attention-probability dropout);
every weight starts from N(0, init_std) as theirs.
It has the retrieval interface of `GEMModel`: `sequence_vectors(inp)` and `item_vectors(item_ids)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from gemrec.config import Section
from gemrec.model.config import FeatureSchema
from gemrec.model.inputs import ModelInput
from gemrec.model.layers import JaggedAttention, SeqLayer
from torch import nn


@dataclass(frozen=True)
class SASRecConfig(Section):
    """The published SASRec settings of the S3-Rec/ICLRec tables (hidden 64, 2 layers, 2 heads, dropout 0.5):
    the recipe's `[sasrec]` table."""

    SECTION: ClassVar[str] = "sasrec"

    d_model: int = 64
    num_heads: int = 2
    layers: int = 2
    mlp_ratio: float = 4.0
    dropout: float = 0.5
    max_positions: int = 50  # longest history; longer ones must be cut before the model
    init_std: float = 0.02  # normal init of the tables and every linear weight (biases zero), as the published code
    post_norm: bool = True  # each residual sum normalised (the published code's BERT layers); false: pre-norm
    attention_backend: Literal["auto", "reference"] = "auto"  # auto: Triton kernels on CUDA

    def check(self) -> None:
        for name in ("d_model", "num_heads", "layers", "max_positions"):
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        self.require(self.d_model % self.num_heads == 0, "d_model", f"must be divisible by num_heads {self.num_heads}")
        self.require(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")


class SASRec(nn.Module):
    def __init__(self, config: SASRecConfig, schema: FeatureSchema):
        super().__init__()
        self.config = config
        d = config.d_model
        self.items = nn.Embedding(schema.feature("item_id").num_embeddings, d)
        self.positions = nn.Embedding(config.max_positions, d)
        self.norm_in = nn.LayerNorm(d)
        self.norm_out = nn.Identity() if config.post_norm else nn.LayerNorm(d)  # post-norm layers end normalised
        self.dropout = nn.Dropout(config.dropout)
        hidden = int(config.mlp_ratio * d)
        self.layers = nn.ModuleList(
            SeqLayer(
                d, config.num_heads, hidden, "softmax", causal=True, dropout=config.dropout, post_norm=config.post_norm
            )
            for _ in range(config.layers)
        )
        for module in self.modules():
            if isinstance(module, (nn.Embedding, nn.Linear)):
                nn.init.normal_(module.weight, std=config.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, JaggedAttention):
                module.backend = config.attention_backend

    def sequence_vectors(self, inp: ModelInput) -> torch.Tensor:
        """The output at every history token, (T, d_model); token t sees tokens <= t (causal)."""
        offsets, max_len, tokens = inp.seq_offsets, inp.max_seq_len, inp.num_tokens
        if max_len > self.config.max_positions:
            raise ValueError(
                f"sasrec: a history of {max_len} items is longer than max_positions={self.config.max_positions}"
            )
        device = offsets.device
        example = torch.repeat_interleave(
            torch.arange(inp.batch_size, device=device), inp.seq_lengths(), output_size=tokens
        )
        from_end = offsets[1:][example] - 1 - torch.arange(tokens, device=device)
        x = self.dropout(self.norm_in(self.items(inp.seq_item_ids) + self.positions(from_end)))
        for layer in self.layers:
            x = layer(x, offsets, max_len)
        return self.norm_out(x)

    def item_vectors(self, item_ids: torch.Tensor, item_features=None) -> torch.Tensor:
        """Items as scored against `sequence_vectors`: rows of the input item table (tied), (N, d_model)."""
        return self.items(item_ids)
