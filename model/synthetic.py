"""Random batches that respect a `FeatureSchema`, and the production-shaped schema every benchmark trains on:
for tests, benchmarks and smoke runs (no data needed)."""

from __future__ import annotations

import math

import torch
from gemrec.model.config import FeatureSchema, SparseFeature
from gemrec.model.inputs import JaggedFeatures, ModelInput


def bench_schema(num_users: int = 1_000_000, num_items: int = 1_000_000, num_dense: int = 16) -> FeatureSchema:
    """user/item ids plus side features shaped like an ads model's: what `gemrec bench train|model` and the
    scaling benchmark train on."""
    sparse = (
        SparseFeature("user_id", num_users, source="user"),
        SparseFeature("item_id", num_items, source="item"),
        SparseFeature("item_category", 1000, source="item"),
        SparseFeature("item_brand", 50_000, source="item"),
        SparseFeature("item_tags", 20_000, multi_valued=True, source="item"),
        SparseFeature("user_interests", 1000, multi_valued=True, source="user"),
        SparseFeature("user_segment", 10_000, source="user"),
        SparseFeature("ctx_surface", 16, source="event"),
        SparseFeature("ctx_position", 64, source="event"),
    )
    return FeatureSchema(
        sparse_features=sparse,
        seq_item_features=("item_category", "item_brand"),
        dense_features=tuple(f"dense_{i}" for i in range(num_dense)),
        labels=("click", "convert"),
        actions=("click", "convert", "like", "dwell"),
    )


def lognormal_lengths(batch_size: int, mean: float, sigma: float, cap: int, gen: torch.Generator) -> torch.Tensor:
    """Heavy-tailed history lengths: lognormal with the given mean, clamped to [1, cap]."""
    mu = math.log(mean) - sigma**2 / 2
    return torch.exp(mu + sigma * torch.randn(batch_size, generator=gen)).long().clamp(1, cap)


def random_labels(batch_size: int, num_tasks: int, gen: torch.Generator, rate: float = 0.3) -> torch.Tensor:
    return (torch.rand(batch_size, num_tasks, generator=gen) < rate).float()


def _ids(schema: FeatureSchema, names, rows: int, gen: torch.Generator, max_values: int):
    features = {}
    for name in names:
        f = schema.feature(name)
        lengths = (
            torch.randint(0, max_values + 1, (rows,), generator=gen)
            if f.multi_valued
            else torch.ones(rows, dtype=torch.long)
        )
        values = torch.randint(0, f.num_embeddings, (int(lengths.sum()),), generator=gen)
        features[name] = (values, lengths)
    return JaggedFeatures.from_dict(features, stride=rows)


def random_input(
    schema: FeatureSchema,
    batch_size: int,
    max_seq_len: int,
    *,
    lengths: list[int] | torch.Tensor | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    max_values: int = 3,
) -> ModelInput:
    """A CPU batch; history lengths uniform in [0, max_seq_len] unless `lengths` is given. Draws from `generator`
    when given (a stream of distinct batches), else from a fresh one seeded with `seed`."""
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(0, max_seq_len + 1, (batch_size,), generator=gen)
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    if lengths.shape != (batch_size,) or bool((lengths < 0).any()):
        raise ValueError(f"lengths must be {batch_size} non-negative ints, got {lengths.tolist()}")
    tokens = int(lengths.sum())
    timestamps = torch.randint(1_600_000_000, 1_700_000_000, (batch_size,), generator=gen)
    offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    token_example = torch.repeat_interleave(torch.arange(batch_size), lengths)
    ages = torch.randint(1, 10_000_000, (tokens,), generator=gen)
    return ModelInput(
        sparse_features=_ids(schema, schema.feature_names, batch_size, gen, max_values),
        dense_features=torch.randn(batch_size, schema.num_dense, generator=gen),
        seq_offsets=offsets,
        seq_item_ids=torch.randint(0, schema.feature("item_id").num_embeddings, (tokens,), generator=gen),
        seq_timestamps=timestamps[token_example] - ages,
        seq_actions=(torch.rand(tokens, schema.num_actions, generator=gen) < 0.3).float(),
        seq_item_features=_ids(schema, schema.seq_item_features, tokens, gen, max_values),
        max_seq_len=int(lengths.max()) if batch_size else 0,
        timestamps=timestamps,
    )
