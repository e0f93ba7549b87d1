"""`FeatureSchema` (what the data holds, from the dataset manifest) and `ModelConfig` (what to build)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

from gemrec.config import ConfigError, Section, field_error


@dataclass(frozen=True)
class SparseFeature:
    name: str
    num_embeddings: int
    multi_valued: bool = False
    source: str = "user"  # "user" | "item" | "event" (request context), as in the dataset manifest
    hashed: bool = False


def schema_problems(
    sparse_features: tuple[SparseFeature, ...], seq_item_features: tuple[str, ...], labels: tuple[str, ...]
) -> list[str]:
    """What the model needs of the data's features and labels, every violation named (empty: it can be built)."""
    problems = []
    names = [f.name for f in sparse_features]
    if len(set(names)) != len(names):
        problems.append(f"duplicate sparse feature names in {names}")
    for required in ("user_id", "item_id"):
        if required not in names:
            problems.append(f"sparse feature {required!r} is required (have {names})")
    by_name = {f.name: f for f in sparse_features}
    for name in seq_item_features:
        if name not in by_name:
            problems.append(f"seq_item_features names unknown sparse feature {name!r}")
        elif by_name[name].source != "item":
            problems.append(f"seq item feature {name!r} must have source 'item'")
    for f in sparse_features:
        if f.num_embeddings < 1:
            problems.append(f"{f.name!r} needs num_embeddings >= 1, got {f.num_embeddings}")
    if not labels:
        problems.append("at least one label is required")
    return problems


def dense_bins_problems(dense_features: tuple[str, ...], dense_bins: tuple[tuple[float, ...], ...]) -> list[str]:
    """What is wrong with the quantile edges of the dense features (empty: usable, or none given)."""
    if not dense_bins:
        return []
    if len(dense_bins) != len(dense_features):
        return [f"dense_bins has {len(dense_bins)} edge lists for {len(dense_features)} dense features"]
    problems = []
    for name, edges in zip(dense_features, dense_bins):
        rising = all(b > a for a, b in zip(edges[:-1], edges[1:]))
        if len(edges) < 2 or not rising or not all(map(math.isfinite, edges)):
            problems.append(f"dense_bins of {name!r} must be at least 2 finite rising edges, got {list(edges)}")
    return problems


def _manifest_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """`FeatureSchema` keyword arguments from a manifest dict; ValueError when a key is missing or malformed."""
    missing = [k for k in ("sparse_features", "labels") if k not in manifest]
    if missing:
        raise ValueError(f"manifest lacks {missing}")
    try:
        sparse = tuple(
            SparseFeature(
                name=str(f["name"]),
                num_embeddings=int(f["num_embeddings"]),
                multi_valued=bool(f.get("multi_valued", False)),
                source=str(f.get("source", "user")),
                hashed=bool(f.get("hashed", False)),
            )
            for f in manifest["sparse_features"]
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"manifest sparse_features entry is malformed: {err!r}") from err
    dense = tuple(manifest.get("dense_features", ()))
    edges = (manifest.get("dense_bins") or {}).get("edges", {})
    try:
        dense_bins = tuple(tuple(float(e) for e in edges[n]) for n in dense) if edges else ()
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"manifest dense_bins.edges must give a list of numbers for every dense feature: {err!r}"
        ) from err
    return {
        "sparse_features": sparse,
        "seq_item_features": tuple(manifest.get("seq_item_features", ())),
        "dense_features": dense,
        "dense_bins": dense_bins,
        "labels": tuple(manifest["labels"]),
        "actions": tuple(manifest.get("actions", ())),
    }


@dataclass(frozen=True)
class FeatureSchema:
    sparse_features: tuple[SparseFeature, ...]
    seq_item_features: tuple[str, ...] = ()
    dense_features: tuple[str, ...] = ()
    labels: tuple[str, ...] = ("label",)
    actions: tuple[str, ...] = ()
    # Per dense feature, rising quantile edges of its train-split values (the manifest's dense_bins): the bins
    # of the piecewise-linear encoding (model.dense_encoding = "ple"). Empty: the dataset has none.
    dense_bins: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        problems = schema_problems(self.sparse_features, self.seq_item_features, self.labels)
        problems += dense_bins_problems(self.dense_features, self.dense_bins)
        if problems:
            raise ValueError("feature schema: " + "; ".join(problems))

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> FeatureSchema:
        """Build from a dataset `manifest.json` dict (see docs/contracts.md)."""
        return cls(**_manifest_fields(manifest))

    @classmethod
    def manifest_problems(cls, manifest: dict[str, Any]) -> list[str]:
        """Every problem that keeps `from_manifest` from building a schema of this manifest (none: it builds)."""
        try:
            fields = _manifest_fields(manifest)
        except ValueError as err:
            return [str(err)]
        return schema_problems(
            fields["sparse_features"], fields["seq_item_features"], fields["labels"]
        ) + dense_bins_problems(fields["dense_features"], fields["dense_bins"])

    @property
    def feature_names(self) -> list[str]:
        return [f.name for f in self.sparse_features]

    @property
    def num_tasks(self) -> int:
        return len(self.labels)

    @property
    def num_dense(self) -> int:
        return len(self.dense_features)

    @property
    def num_actions(self) -> int:
        return len(self.actions)

    def feature(self, name: str) -> SparseFeature:
        for f in self.sparse_features:
            if f.name == name:
                return f
        raise KeyError(f"feature schema has no sparse feature {name!r}")


Arch = Literal["gem", "dlrm", "gbdt"]  # gbdt: trees on the dense features (components/trainer/gbdt.py)
SeqMask = Literal["full", "window", "block"]
Rope = Literal["fused", "separate", "none"]


@dataclass(frozen=True)
class ModelConfig(Section):
    """Every knob of the model (the recipe's `[model]` table); the defaults build a small model that runs on a CPU."""

    SECTION: ClassVar[str] = "model"

    arch: Arch = "gem"
    embedding_backend: Literal["torchrec", "torch"] = "torchrec"  # "torch": no torchrec import
    embedding_dim: int = 32  # every table's row size
    # Probability that training hides an example's user_id / item_id embedding (history tokens' item ids too):
    # the model learns to predict from features and history when an id is unknown. A table with id dropout
    # starts at zero, so an id never trained on (a new user or item) reads as a hidden one.
    user_id_dropout: float = 0.0
    item_id_dropout: float = 0.0
    # Dense features into the feature tokens: "linear" = all of them through one linear map into one token; "ple" =
    # one token per feature, a piecewise-linear encoding over its train-split quantile bins (the dataset's
    # dense_bins) then a linear map per feature: each token a learned nonlinear curve of its feature.
    dense_encoding: Literal["linear", "ple"] = "linear"
    d_model: int = 64  # token width inside the towers
    num_heads: int = 4
    mlp_ratio: float = 4.0
    # Sequence tower over the jagged history.
    seq_layers: int = 2
    seq_attention: Literal["softmax", "silu"] = "softmax"  # silu: pointwise SiLU, normalised by the key count
    seq_causal: bool = True
    dropout: float = 0.0  # on the sequence tower's input tokens and residual branches (training only)
    attention_backend: Literal["auto", "reference"] = "auto"  # auto: Triton kernels on CUDA; reference: PyTorch
    # Which earlier tokens a history token sees (the kernels' masks): all; those within seq_window positions; those
    # of its own seq_block-token block. Each size is read only by its mask, so a recipe can carry both.
    seq_attention_mask: SeqMask = "full"
    seq_window: int | None = None
    seq_block: int | None = None
    # Rotary positions in the sequence tower: rotated inside the attention kernels (fused), by the model before
    # them from cos/sin tables (separate), or none. Older recipes' `rotary = true | false` reads as separate | none.
    rope: Rope = "separate"
    rotary_base: float = 10000.0
    rotary_max_positions: int = 32768  # longest sequence the separate rotary's tables cover
    time_encoding: Literal["log_bucket", "continuous"] = "log_bucket"  # of the time since the target event
    num_time_buckets: int = 64
    recency_buckets: int = 32  # embedding of each token's rank from the end of its history; 0 = off
    target_aware: bool = True  # history tokens see their target item's embeddings (element-wise products)
    # PMA: K learned seed queries -> K summary tokens per sequence.
    pma_seeds: int = 4
    # Non-sequence tower: self-attention among feature tokens, then cross-attention into the sequence.
    nonseq_layers: int = 1
    # Interaction stack over [feature tokens, PMA summaries]; FFNs are MoE on every `moe_every`-th layer.
    interaction_layers: int = 2
    moe_every: int = 2  # layer i uses MoE when (i + 1) % moe_every == 0; 0 = no MoE
    moe_num_experts: int = 4
    moe_top_k: int = 2
    moe_hidden: int = 128
    moe_aux_loss_weight: float = 0.01
    # Task heads.
    head_hidden: int = 128
    # child label -> parent label: the child's probability is the parent's times a learned conditional (ESMM, Ma et
    # al. 2018: pCTCVR = pCTR x pCVR), for labels nested in another (love implies like); both models' heads.
    task_parents: dict[str, str] = field(default_factory=dict)
    # gem: DCN-v2 cross layers (low rank) on the flattened tokens before the heads' trunk: x <- x0 * (U V x + b) + x,
    # explicit multiplicative crosses of every pair of token entries; 0 = none.
    head_cross_layers: int = 0
    head_cross_rank: int = 32
    # DLRM baseline.
    dlrm_bottom_mlp: tuple[int, ...] = (64,)
    dlrm_top_mlp: tuple[int, ...] = (128, 64)
    # GBDT baseline (scikit-learn HistGradientBoosting), early-stopped on the valid split.
    gbdt_max_iter: int = 300
    gbdt_learning_rate: float = 0.1
    gbdt_max_leaf_nodes: int = 31
    init_std: float = 0.02

    def check(self) -> None:
        positive = (
            "embedding_dim",
            "d_model",
            "num_heads",
            "pma_seeds",
            "num_time_buckets",
            "head_hidden",
            "rotary_max_positions",
        )
        for name in positive:
            self.require(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("dropout", "user_id_dropout", "item_id_dropout"):
            self.require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        self.require(self.gbdt_max_iter >= 1, "gbdt_max_iter", "must be >= 1")
        self.require(self.gbdt_max_leaf_nodes >= 2, "gbdt_max_leaf_nodes", "must be >= 2")
        self.require(self.gbdt_learning_rate > 0, "gbdt_learning_rate", "must be > 0")
        self.require(self.head_cross_rank >= 1, "head_cross_rank", "must be >= 1")
        for name in (
            "seq_layers",
            "nonseq_layers",
            "interaction_layers",
            "moe_every",
            "recency_buckets",
            "head_cross_layers",
        ):
            self.require(getattr(self, name) >= 0, name, "must be >= 0")
        self.require(self.d_model % self.num_heads == 0, "d_model", f"must be divisible by num_heads {self.num_heads}")
        self.require(
            self.rope == "none" or (self.d_model // self.num_heads) % 2 == 0,
            "d_model",
            f"rotary positions (rope = {self.rope!r}) need an even head dim (d_model / num_heads {self.num_heads})",
        )
        self.require(self.rotary_base > 0, "rotary_base", "must be > 0")
        for mask, key in (("window", "seq_window"), ("block", "seq_block")):
            size = getattr(self, key)
            self.require(size is None or size >= 1, key, "must be >= 1 (or unset)")
            self.require(
                self.seq_attention_mask != mask or size is not None,
                key,
                f"seq_attention_mask = {mask!r} needs model.{key} (a size >= 1)",
            )
        self.require(
            not self.moe_every or 1 <= self.moe_top_k <= self.moe_num_experts,
            "moe_top_k",
            f"must be in [1, moe_num_experts = {self.moe_num_experts}]",
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> Self:
        """As `Section.from_dict`; an older recipe's `rotary = true | false` is read as `rope = "separate" | "none"`,
        and refused when it contradicts a `rope` given beside it."""
        if not isinstance(values, Mapping) or "rotary" not in values:
            return super().from_dict(values)
        values = dict(values)
        rotary = values.pop("rotary")
        if not isinstance(rotary, bool):
            raise field_error(cls.SECTION, "rotary", rotary, "must be true or false (the older spelling of model.rope)")
        rope = values.setdefault("rope", "separate" if rotary else "none")
        if (rope != "none") != rotary:
            raise ConfigError(
                f"model.rotary = {str(rotary).lower()} contradicts model.rope = {rope!r}: "
                "rotary is the older spelling of rope (true = 'separate', false = 'none'); set only model.rope"
            )
        return super().from_dict(values)

    @property
    def seq_mask(self) -> tuple[int | None, int | None]:
        """(window, block): the kernels' mask keywords of the sequence tower's self-attention (None: off)."""
        return (
            self.seq_window if self.seq_attention_mask == "window" else None,
            self.seq_block if self.seq_attention_mask == "block" else None,
        )

    @property
    def fused_rope_base(self) -> float | None:
        """The kernels' `rope_base` of the sequence tower's self-attention (None unless rope = "fused")."""
        return self.rotary_base if self.rope == "fused" else None
