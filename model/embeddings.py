"""Sparse embeddings: the non-sequence features of each example and the history tokens, in ONE lookup.

History tokens share the tables of the target item (`item_id` plus the schema's `seq_item_features`).
With torchrec, both go through one keyed jagged batch of `B + T` rows per key: rows `[0, B)` hold the
examples' ids, rows `[B, B + T)` the history tokens' ids (empty for user/context features). One lookup keeps
the table collection shardable as a unit.

Backends: "torchrec" (`EmbeddingBagCollection`, imported only here, lazily) and "torch" (all tables stacked
row-wise in one weight, needs no torchrec): one `F.embedding_bag` over the examples' features and the tokens'
item features only (no empty (token, user feature) bags are pooled), so one gradient for the table; no host syncs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gemrec.model.config import FeatureSchema, ModelConfig
from torch import nn


def _key_rows(features, key: str, stride: int, what: str) -> int:
    keys = list(features.keys())
    if features.stride() != stride:
        raise ValueError(f"{what}: stride {features.stride()} does not match the {stride} rows expected")
    return keys.index(key) * stride


def _check_keys(features, expected: list[str], what: str) -> None:
    keys = list(features.keys())
    if sorted(keys) != sorted(expected):
        raise ValueError(f"{what}: keys {keys} must be exactly the schema's {expected}")


class TorchTables(nn.Module):
    """All tables as one `(sum of rows, dim)` weight; one fused `embedding_bag` per forward, no host sync."""

    # buffers (registered in __init__)
    row_starts: torch.Tensor
    mean_pooled: torch.Tensor

    def __init__(self, schema: FeatureSchema, dim: int):
        super().__init__()
        sizes = [f.num_embeddings for f in schema.sparse_features]
        self.weight = nn.Parameter(torch.empty(sum(sizes), dim))
        starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
        self.register_buffer("row_starts", starts, persistent=False)
        self.register_buffer(
            "mean_pooled", torch.tensor([f.multi_valued for f in schema.sparse_features]), persistent=False
        )
        self.num_features, self.dim = len(sizes), dim
        self.sizes = sizes
        self.names = schema.feature_names
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The same per-table init as torchrec: uniform(+-sqrt(1 / rows)).
        with torch.no_grad():
            for start, size in zip(self.row_starts.tolist(), self.sizes):
                bound = (1.0 / size) ** 0.5
                self.weight[start : start + size].uniform_(-bound, bound)

    def table(self, name: str) -> torch.Tensor:
        """The rows of feature `name` (a view into the fused weight)."""
        index = self.names.index(name)
        start = int(self.row_starts[index])
        return self.weight.data[start : start + self.sizes[index]]

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, blocks: list[tuple[torch.Tensor, int]]):
        """One `embedding_bag` over consecutive blocks of bags; block `(features, rows)` holds `rows` bags per table
        in `features` (indices), feature-major. Returns one `(rows, len(features), dim)` tensor per block."""
        key_of_row = torch.cat([features.repeat_interleave(rows) for features, rows in blocks])
        key_of_value = torch.repeat_interleave(key_of_row, lengths, output_size=values.numel())
        ids = values + self.row_starts[key_of_value]
        lengths_per_value = torch.repeat_interleave(lengths, lengths, output_size=values.numel())
        weights = torch.where(
            self.mean_pooled[key_of_value], 1.0 / lengths_per_value.clamp(min=1).to(self.weight.dtype), 1.0
        ).to(self.weight.dtype)
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        pooled = F.embedding_bag(
            ids, self.weight, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
        )
        sizes = [features.numel() * rows for features, rows in blocks]
        return [
            part.view(features.numel(), rows, self.dim).transpose(0, 1)
            for part, (features, rows) in zip(pooled.split(sizes), blocks)
        ]


class TorchrecTables(nn.Module):
    """torchrec `EmbeddingBagCollection`, one table per feature (mean pooling for multi-valued ones)."""

    def __init__(self, schema: FeatureSchema, dim: int):
        super().__init__()
        try:
            from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
            from torchrec.modules.embedding_modules import EmbeddingBagCollection
        except ImportError as err:
            raise ImportError(
                f"embedding_backend='torchrec' needs torchrec ({err}); use embedding_backend='torch' without it"
            ) from err

        tables = [
            EmbeddingBagConfig(
                name=f"t_{f.name}",
                embedding_dim=dim,
                num_embeddings=f.num_embeddings,
                feature_names=[f.name],
                pooling=PoolingType.MEAN if f.multi_valued else PoolingType.SUM,
            )
            for f in schema.sparse_features
        ]
        self.ebc = EmbeddingBagCollection(tables=tables)
        self.keys = schema.feature_names
        self.num_features, self.dim = len(tables), dim

    def table(self, name: str) -> torch.Tensor:
        return self.ebc.embedding_bags[f"t_{name}"].weight.data

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, rows: int) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, stride=rows)
        pooled = self.ebc(kjt).values()  # (rows, F * dim), features in table order
        return pooled.view(rows, self.num_features, self.dim)


class SparseEmbeddings(nn.Module):
    """`forward(sparse_features, seq_item_ids, seq_item_features)` -> `(example_emb, token_emb)`.

    example_emb: (B, num_features, dim) in schema order. token_emb: (T, 1 + num_seq_features, dim), the
    item_id embedding first, or None when no history is given (the dlrm arch).
    """

    # buffers (registered in __init__)
    token_columns: torch.Tensor
    id_dropout: torch.Tensor
    all_columns: torch.Tensor

    def __init__(self, schema: FeatureSchema, config: ModelConfig):
        super().__init__()
        self.schema = schema
        self.features = schema.feature_names
        self.token_features = ["item_id", *schema.seq_item_features]
        columns = torch.tensor([self.features.index(name) for name in self.token_features])
        self.register_buffer("token_columns", columns, persistent=False)  # on the device: no host copy
        self.register_buffer("all_columns", torch.arange(len(self.features)), persistent=False)
        tables = TorchrecTables if config.embedding_backend == "torchrec" else TorchTables
        self.tables = tables(schema, config.embedding_dim)
        dropout = {"user_id": config.user_id_dropout, "item_id": config.item_id_dropout}
        self.register_buffer(
            "id_dropout", torch.tensor([dropout.get(name, 0.0) for name in self.features]), persistent=False
        )
        self.token_id_dropout = config.item_id_dropout
        self.hides_ids = any(p > 0 for name, p in dropout.items() if name in self.features)  # no host sync per step
        with torch.no_grad():
            for name, p in dropout.items():
                if p > 0:
                    self.tables.table(name).zero_()

    def _hide_ids(self, example_emb: torch.Tensor, token_emb: torch.Tensor | None):
        """Training only: each example's id embeddings (and each token's item id) dropped to zero at random."""
        if not self.training or not self.hides_ids:
            return example_emb, token_emb
        keep = torch.rand(example_emb.shape[:2], device=example_emb.device) >= self.id_dropout
        example_emb = example_emb * keep.unsqueeze(-1).to(example_emb.dtype)
        if token_emb is not None and self.token_id_dropout > 0:
            keep = torch.ones(token_emb.shape[:2], device=token_emb.device, dtype=token_emb.dtype)
            keep[:, 0] = (torch.rand(token_emb.shape[0], device=token_emb.device) >= self.token_id_dropout).to(keep)
            token_emb = token_emb * keep.unsqueeze(-1)
        return example_emb, token_emb

    def forward(self, sparse_features, seq_item_ids=None, seq_item_features=None, batch_size: int | None = None):
        return self._hide_ids(*self._lookup(sparse_features, seq_item_ids, seq_item_features, batch_size))

    def _lookup(self, sparse_features, seq_item_ids, seq_item_features, batch_size: int | None):
        batch = sparse_features.stride() if batch_size is None else batch_size
        _check_keys(sparse_features, self.features, "sparse_features")
        if isinstance(self.tables, TorchTables):
            return self._torch_lookup(sparse_features, seq_item_ids, seq_item_features, batch)
        if seq_item_ids is None:
            return self.tables(*self._reorder(sparse_features, batch), batch), None
        values, lengths = self._merge(sparse_features, seq_item_ids, seq_item_features, batch)
        tokens = seq_item_ids.numel()
        pooled = self.tables(values, lengths, batch + tokens)
        return pooled[:batch], pooled[batch:].index_select(1, self.token_columns)

    def tokens(self, seq_item_ids: torch.Tensor, seq_item_features=None) -> torch.Tensor:
        """Token embeddings alone, (T, 1 + num_seq_features, dim): items as history tokens, without examples."""
        from gemrec.model.inputs import JaggedFeatures

        empty = seq_item_ids.new_zeros(0, dtype=torch.long)
        no_examples = JaggedFeatures(self.features, empty, empty, stride=0)
        return self(no_examples, seq_item_ids, seq_item_features, batch_size=0)[1]

    def _reorder(self, features, batch: int, names: list[str] | None = None, what: str = "sparse_features"):
        """The features' rows in the order of `names` (default: the schema's keys)."""
        device = features.values().device
        perm = torch.cat(
            [
                torch.arange(start, start + batch, device=device)
                for start in (_key_rows(features, name, batch, what) for name in names or self.features)
            ]
        )
        return _permute_rows(features.values(), features.lengths(), perm, features.values().numel())

    def _seq_names(self, seq_item_features) -> list[str]:
        """The schema's per-token item features, checked against what the input carries."""
        seq_names = list(self.schema.seq_item_features)
        if seq_names:
            if seq_item_features is None:
                raise ValueError(f"seq_item_features is None but the schema expects {seq_names}")
            _check_keys(seq_item_features, seq_names, "seq_item_features")
        return seq_names

    def _torch_lookup(self, sparse_features, seq_item_ids, seq_item_features, batch: int):
        """Torch backend: one `embedding_bag` over the examples' features and the tokens' item features only."""
        example_values, example_lengths = self._reorder(sparse_features, batch)
        if seq_item_ids is None:
            return self.tables(example_values, example_lengths, [(self.all_columns, batch)])[0], None
        tokens = seq_item_ids.numel()
        values = [example_values, seq_item_ids.long()]
        lengths = [example_lengths, torch.ones(tokens, dtype=torch.long, device=seq_item_ids.device)]
        seq_names = self._seq_names(seq_item_features)
        if seq_names:
            seq_values, seq_lengths = self._reorder(seq_item_features, tokens, seq_names, "seq_item_features")
            values.append(seq_values)
            lengths.append(seq_lengths)
        example_emb, token_emb = self.tables(
            torch.cat(values), torch.cat(lengths), [(self.all_columns, batch), (self.token_columns, tokens)]
        )
        return example_emb, token_emb

    def _merge(self, sparse_features, seq_item_ids, seq_item_features, batch: int):
        """One (values, lengths) batch of `batch + T` rows per key (see the module docstring)."""
        device = seq_item_ids.device
        tokens = seq_item_ids.numel()
        seq_names = self._seq_names(seq_item_features)
        parts_values = [sparse_features.values(), seq_item_ids]
        parts_lengths = [sparse_features.lengths(), torch.ones(tokens, dtype=torch.long, device=device)]
        item_rows = sparse_features.lengths().numel()
        seq_rows = item_rows + tokens
        if seq_names:
            parts_values.append(seq_item_features.values())
            parts_lengths.append(seq_item_features.lengths())
        empty_row = seq_rows + (seq_item_features.lengths().numel() if seq_names else 0)
        parts_lengths.append(torch.zeros(1, dtype=torch.long, device=device))  # the shared empty row
        perm = []
        for name in self.features:
            start = _key_rows(sparse_features, name, batch, "sparse_features")
            perm.append(torch.arange(start, start + batch, device=device))
            if name == "item_id":
                perm.append(torch.arange(item_rows, item_rows + tokens, device=device))
            elif name in seq_names:
                start = seq_rows + _key_rows(seq_item_features, name, tokens, "seq_item_features")
                perm.append(torch.arange(start, start + tokens, device=device))
            else:
                perm.append(torch.full((tokens,), empty_row, dtype=torch.long, device=device))
        total = sum(v.numel() for v in parts_values)
        values = torch.cat([v.long() for v in parts_values])
        return _permute_rows(values, torch.cat([x.long() for x in parts_lengths]), torch.cat(perm), total)


def _permute_rows(values: torch.Tensor, lengths: torch.Tensor, perm: torch.Tensor, total: int):
    """Rows `perm` of a jagged (values, lengths); `total` (host int) is the output's value count."""
    lengths = lengths.long()
    starts = torch.cumsum(lengths, 0) - lengths
    out_lengths = lengths[perm]
    out_starts = torch.cumsum(out_lengths, 0) - out_lengths
    shift = torch.repeat_interleave(starts[perm] - out_starts, out_lengths, output_size=total)
    return values.long()[shift + torch.arange(total, device=values.device)], out_lengths
