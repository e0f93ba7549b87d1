"""Training recipes: TOML files loaded into dataclasses whose defaults run, overridable with `key=value`.

A recipe names sections that mirror the dataclasses below; `[model]` is handed to
`gemrec.model.ModelConfig` as keyword arguments (the model package validates it). Built-in recipes live
in `recipes/*.toml` beside this file; `--recipe` also takes a path to a TOML file.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


class RecipeError(ValueError):
    """A recipe that cannot be found or does not fit the config dataclasses."""


@dataclass
class DataConfig:
    batch_size: int = 256  # examples per rank per step
    max_seq_len: int = 128  # most recent history tokens kept per example
    eval_batch_size: int = 1024
    eval_max_examples: int = 0  # 0 = the whole eval split
    prefetch: int = 2  # batches collated ahead in a background thread (0 = inline)


@dataclass
class OptimConfig:
    dense_lr: float = 1e-3  # AdamW over every non-embedding parameter
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    sparse_lr: float = 0.05  # row-wise Adagrad over embedding tables, applied in backward
    sparse_eps: float = 1e-8
    warmup_steps: int = 100
    decay: str = "cosine"  # cosine | linear | constant, from the end of warmup to the last step
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global L2 norm of the dense gradients; 0 = off


@dataclass
class LoopConfig:
    steps: int = 0  # 0 = derive from epochs
    epochs: float = 1.0
    seed: int = 0
    deterministic: bool = False  # deterministic algorithms, fixed threads: bit-identical reruns and resumes
    compile: bool = False  # torch.compile the model
    threads: int = 0  # CPU intra-op threads per rank; 0 = cores / local ranks
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    log_every: int = 20
    eval_every: int = 0  # 0 = only at the end
    local_mfu: bool = True  # measure per-layer local MFU (each layer alone) at the end
    local_mfu_repeats: int = 3
    task_weights: dict[str, float] = field(default_factory=dict)  # label -> loss weight (default 1.0)


@dataclass
class CheckpointConfig:
    every: int = 200  # steps between checkpoints; 0 = none
    keep: int = 2  # newest checkpoints kept


@dataclass
class BenchConfig:
    """Synthetic production-shaped batches for `gpu_bench` (the GPU machine has no dataset)."""

    steps: int = 30  # timed steps
    warmup_steps: int = 10
    distinct_batches: int = 4  # generated up front and rotated
    profile_steps: int = 3
    mean_seq_len: float = 256.0  # lognormal history lengths, capped at data.max_seq_len
    length_sigma: float = 1.0
    num_users: int = 1_000_000
    num_items: int = 1_000_000
    num_dense: int = 16


@dataclass
class SeqRecConfig:
    """`gemrec bench seqrec`: leave-one-out next-item benchmarks (components/trainer/seqrec.py)."""

    epochs: int = 200  # upper bound: early stopping on validation NDCG@10 ends a run sooner
    patience: int = 5  # validations in a row without a better NDCG@10 before stopping
    eval_every: float = 1.0  # epochs between validations
    batch_size: int = 256  # user sequences (retrieval arms) or positive examples (ranker) per step
    max_seq_len: int = 50  # most recent history items the models see
    ranker_negatives: int = 4  # sampled negatives per positive for the pointwise GEM ranker (sampled99)
    gem_loss: str = "softmax"  # GEM retrieval head (full): softmax | sampled | bce
    sasrec_loss: str = "bce"  # SASRec baseline: bce (its paper: one negative per position) | softmax | sampled
    sampled_negatives: int = 512  # negatives shared by a batch for the "sampled" loss
    valid_users: int = 0  # users drawn for each validation (0: all); the test always uses all
    eval_batch_size: int = 256  # users per evaluation batch
    sparse_optimizer: bool = True  # row-wise Adagrad on embedding tables; false: AdamW over every parameter


@dataclass
class TrainConfig:
    recipe: str = "custom"
    model: dict[str, Any] = field(default_factory=lambda: {"arch": "gem"})  # -> gemrec.model.ModelConfig
    parallel: dict[str, Any] = field(default_factory=dict)  # -> trainer.parallel.ParallelConfig (multi-rank)
    sasrec: dict[str, Any] = field(default_factory=dict)  # -> gemrec.model.sasrec.SASRecConfig (bench seqrec)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    seqrec: SeqRecConfig = field(default_factory=SeqRecConfig)

    @property
    def arch(self) -> str:
        return str(self.model.get("arch", "gem"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value` for every setting (MLflow params)."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            if isinstance(values, dict):
                for key, value in values.items():
                    out[f"{section}.{key}"] = value
            else:
                out[section] = values
        return out


SECTIONS = {
    "data": DataConfig,
    "optim": OptimConfig,
    "train": LoopConfig,
    "checkpoint": CheckpointConfig,
    "bench": BenchConfig,
    "seqrec": SeqRecConfig,
}


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def recipe_path(name: str) -> Path:
    """A built-in recipe name or a path to a TOML file."""
    builtin = RECIPES_DIR / f"{name}.toml"
    if builtin.exists():
        return builtin
    path = Path(name)
    if path.suffix == ".toml" and path.is_file():
        return path
    raise RecipeError(
        f"unknown recipe {name!r}: built-in recipes are {', '.join(available_recipes())}, "
        "or pass a path to a .toml file"
    )


def _coerce(value: Any, template: Any, where: str) -> Any:
    """Check a TOML value against the type of the dataclass default it replaces."""
    if isinstance(template, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(template, int) and not isinstance(template, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(template, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(template, str):
        if not isinstance(value, str):
            raise RecipeError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise RecipeError(f"{where} must be a table, got {value!r}")
        return dict(value)
    if isinstance(template, tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            raise RecipeError(f"{where} must be a list of {len(template)} values, got {value!r}")
        return tuple(_coerce(v, t, where) for v, t in zip(value, template))
    return value


def _build_section(cls: type, values: dict[str, Any], section: str) -> Any:
    if not isinstance(values, dict):
        raise RecipeError(f"[{section}] must be a table")
    defaults = cls()
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise RecipeError(
            f"unknown setting(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
            f"[{section}] takes {', '.join(sorted(known))}"
        )
    kwargs = {k: _coerce(v, getattr(defaults, k), f"{section}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value`; the value is read as a TOML literal, else kept as a string."""
    if "=" not in text:
        raise RecipeError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise RecipeError(f"override key {key!r} must be section.key (e.g. train.steps)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def build_config(raw: dict[str, Any], recipe: str = "custom", overrides: list[str] = ()) -> TrainConfig:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        (section, key), value = parse_override(text)
        raw.setdefault(section, {})[key] = value
    unknown = sorted(set(raw) - set(SECTIONS) - {"model", "parallel", "sasrec"})
    if unknown:
        raise RecipeError(
            f"unknown section(s) {', '.join(unknown)}; recipes take "
            f"{', '.join(['model', 'parallel', 'sasrec', *SECTIONS])}"
        )
    model = dict(raw.get("model", {}))
    model.setdefault("arch", "gem")
    if model["arch"] not in ("gem", "dlrm"):
        raise RecipeError(f"model.arch must be 'gem' or 'dlrm', got {model['arch']!r}")
    sections = {name: _build_section(cls, raw.get(name, {}), name) for name, cls in SECTIONS.items()}
    parallel, sasrec = raw.get("parallel", {}), raw.get("sasrec", {})
    for name, table in (("parallel", parallel), ("sasrec", sasrec)):
        if not isinstance(table, dict):
            raise RecipeError(f"[{name}] must be a table")
    config = TrainConfig(recipe=recipe, model=model, parallel=dict(parallel), sasrec=dict(sasrec), **sections)
    validate(config)
    return config


def validate(config: TrainConfig) -> None:
    checks = [
        (config.data.batch_size > 0, "data.batch_size must be > 0"),
        (config.data.max_seq_len > 0, "data.max_seq_len must be > 0"),
        (config.data.eval_batch_size > 0, "data.eval_batch_size must be > 0"),
        (config.train.steps > 0 or config.train.epochs > 0, "train.steps or train.epochs must be > 0"),
        (config.train.log_every > 0, "train.log_every must be > 0"),
        (config.train.precision in ("auto", "bf16", "fp32"), "train.precision must be auto, bf16 or fp32"),
        (config.optim.decay in ("cosine", "linear", "constant"), "optim.decay must be cosine, linear or constant"),
        (config.optim.dense_lr >= 0 and config.optim.sparse_lr >= 0, "learning rates must be >= 0"),
        (0.0 <= config.optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]"),
        (config.checkpoint.keep >= 1, "checkpoint.keep must be >= 1"),
        (config.seqrec.epochs > 0 and config.seqrec.patience > 0, "seqrec.epochs and seqrec.patience must be > 0"),
        (config.seqrec.eval_every > 0, "seqrec.eval_every must be > 0"),
        (config.seqrec.batch_size > 0 and config.seqrec.eval_batch_size > 0, "seqrec batch sizes must be > 0"),
        (config.seqrec.max_seq_len > 0, "seqrec.max_seq_len must be > 0"),
        (config.seqrec.ranker_negatives > 0, "seqrec.ranker_negatives must be > 0"),
        (config.seqrec.sampled_negatives > 0, "seqrec.sampled_negatives must be > 0"),
        (config.seqrec.valid_users >= 0, "seqrec.valid_users must be >= 0"),
        (
            {config.seqrec.gem_loss, config.seqrec.sasrec_loss} <= {"softmax", "sampled", "bce"},
            "seqrec.gem_loss and seqrec.sasrec_loss must be softmax, sampled or bce",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise RecipeError(message)
    from gemrec.model.sasrec import SASRecConfig

    try:
        SASRecConfig.from_dict(config.sasrec)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"[sasrec]: {err}") from err
    model = _model_config(config)
    if model.rotary and config.data.max_seq_len > model.rotary_max_positions:
        raise RecipeError(
            f"data.max_seq_len {config.data.max_seq_len} exceeds model.rotary_max_positions "
            f"{model.rotary_max_positions}: raise model.rotary_max_positions or shorten the histories"
        )
    from gemrec.components.trainer.parallel.integration import ParallelConfigError, parallel_config

    try:  # also on one rank, where the table is not used: a typo there should not wait for a multi-GPU run
        parallel_config(config.parallel)
    except (ParallelConfigError, TypeError, ValueError) as err:
        raise RecipeError(f"[parallel]: {err}") from err


def _model_config(config: TrainConfig):
    """The recipe's `gemrec.model.ModelConfig` (imported here: the model package imports torch)."""
    from gemrec.model.config import ModelConfig

    try:
        return ModelConfig.from_dict(config.model)
    except (TypeError, ValueError) as err:
        raise RecipeError(f"[model]: {err}") from err


def balance_linear_weight(config: TrainConfig) -> float:
    """The data service's rank-balancing `linear_weight` for this recipe's model: its sequence layers' per-token
    work against their attention (`balance.transformer_linear_weight`); the default for a model without one."""
    from gemrec.components.data_service.balance import DEFAULT_LINEAR_WEIGHT, transformer_linear_weight

    model = _model_config(config)
    if model.arch != "gem":
        return DEFAULT_LINEAR_WEIGHT
    return transformer_linear_weight(model.d_model, model.mlp_ratio, model.seq_causal)


def load_recipe(name: str, overrides: list[str] = (), arch: str | None = None) -> TrainConfig:
    path = recipe_path(name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"recipe {path} is not valid TOML: {err}") from err
    overrides = list(overrides)
    if arch is not None:
        overrides.append(f'model.arch="{arch}"')
    return build_config(raw, recipe=path.stem, overrides=overrides)
