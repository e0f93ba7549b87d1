"""Training recipes: TOML files loaded into typed config sections, checked once at load, overridable with
`section.key=value`.

Each table of a recipe is one `gemrec.config.Section` dataclass: `[model]` -> `gemrec.model.ModelConfig`,
`[kernels]` -> `gemrec.kernels.KernelOptions`, `[parallel]` -> `ParallelConfig`, `[sasrec]` -> `SASRecConfig`,
and `[data]`, `[optim]`, `[train]`, `[checkpoint]`, `[bench]`, `[seqrec]` below. The defaults run; unknown tables,
unknown keys and bad values are refused naming section, key, value and what is allowed. Built-in recipes live in
`recipes/*.toml` beside this file; `--recipe` also takes a path to a TOML file.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from gemrec.components.trainer.parallel.dims import ParallelConfig
from gemrec.config import ConfigError, Section, apply_overrides, build_sections
from gemrec.kernels import KernelOptions
from gemrec.model.config import ModelConfig
from gemrec.model.sasrec import SASRecConfig

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


class RecipeError(ConfigError):
    """A recipe that cannot be found or read."""


@dataclass(frozen=True)
class DataConfig(Section):
    SECTION: ClassVar[str] = "data"

    batch_size: int = 256  # examples per rank per step
    max_seq_len: int = 128  # most recent history tokens kept per example
    eval_batch_size: int = 1024
    eval_max_examples: int = 0  # 0 = the whole eval split
    valid_max_examples: int = 0  # examples of each validation (a fixed random subset); 0 = the whole valid split
    prefetch: int = 2  # batches collated ahead in a background thread (0 = inline)
    device_prefetch: int = 2  # batches pinned and copied to the device ahead of the step (side CUDA stream)
    stall_s: float = 30.0  # --data-addr: a stream that delivers nothing this long is reopened from its cursor
    wait_timeout_s: float = 600.0  # --data-addr: no batch for this long stops training with an error

    def check(self) -> None:
        for key in ("batch_size", "max_seq_len", "eval_batch_size", "device_prefetch", "stall_s", "wait_timeout_s"):
            self.require(getattr(self, key) > 0, key, "must be > 0")
        for key in ("eval_max_examples", "valid_max_examples", "prefetch"):
            self.require(getattr(self, key) >= 0, key, "must be >= 0")


@dataclass(frozen=True)
class OptimConfig(Section):
    SECTION: ClassVar[str] = "optim"

    dense_lr: float = 1e-3  # AdamW over every non-embedding parameter
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    sparse_lr: float = 0.05  # row-wise Adagrad over embedding tables, applied in backward
    sparse_eps: float = 1e-8
    warmup_steps: int = 100
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # from the end of warmup to the last step
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global L2 norm of the dense gradients; 0 = off
    # Decay of an exponential moving average of the weights (`optim.WeightAverage`), updated after every step: the
    # trainer validates, keeps, checkpoints, evaluates and exports the average. 0 = off (the live weights).
    weight_average: float = 0.0

    def check(self) -> None:
        for key in ("dense_lr", "sparse_lr", "weight_decay", "warmup_steps", "grad_clip"):
            self.require(getattr(self, key) >= 0, key, "must be >= 0")
        self.require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        self.require(0.0 <= self.weight_average < 1.0, "weight_average", "must be in [0, 1) (0 = off)")


VALID_METRICS = ("ne", "auc", "log_loss")  # what validation can follow (auc: higher is better)


@dataclass(frozen=True)
class LoopConfig(Section):
    SECTION: ClassVar[str] = "train"

    steps: int = 0  # the most steps (early stopping may end sooner); 0 = derive from epochs
    epochs: float = 1.0  # the most epochs when steps is 0 (early stopping may end sooner)
    seed: int = 0
    deterministic: bool = False  # deterministic algorithms, fixed threads: bit-identical reruns and resumes
    compile: bool = False  # torch.compile the model
    threads: int = 0  # CPU intra-op threads per rank; 0 = cores / local ranks
    # auto: bf16 autocast on GPU, fp32 on CPU; fp8: auto plus the FP8 conversion of [fp8] (docs/precision.md)
    precision: Literal["auto", "bf16", "fp32", "fp8"] = "auto"
    log_every: int = 20
    untimed_steps: int = 0  # left out of the run's QPS, MFU and data waits (compilation): windows ending by then
    # Validation on the dataset's `valid` split (the end of the train period, never the eval period): every
    # `eval_every` steps and at the last one; the best weights (by `valid_metric`) are kept as a checkpoint and
    # restored before the final evaluation on `eval`. 0 = no validation: the last weights are evaluated.
    eval_every: int = 0
    patience: int = 0  # validations in a row without a better valid_metric before training stops; 0 = never
    valid_metric: str = ""  # ne | auc | log_loss, optionally _<label> ("ne_like"); "" = NE of the first label
    # With validation: one logit offset per task fitted on the valid split with the restored best weights (their
    # mean prediction then equals the valid rate), kept in the task heads for the evaluation, export and serving.
    calibrate: bool = True
    local_mfu: bool = True  # measure per-layer local MFU (each layer alone) at the end
    local_mfu_repeats: int = 3
    task_weights: dict[str, float] = field(default_factory=dict)  # label -> loss weight (default 1.0)
    # Members: models trained independently (seeds seed, seed + 1, ...) as concurrent processes that share the
    # machine's cores (`threads` split among them); the prediction is the mean of their logits plus one offset
    # fitted on the valid split (components/trainer/ensemble.py). 1 = one model.
    ensemble: int = 1

    def check(self) -> None:
        self.require(self.ensemble >= 1, "ensemble", "must be >= 1 (1 = one model)")
        self.require(self.steps >= 0, "steps", "must be >= 0 (0 = derive from train.epochs)")
        self.require(self.steps > 0 or self.epochs > 0, "epochs", "must be > 0 when train.steps is 0")
        for key in ("threads", "eval_every", "untimed_steps"):
            self.require(getattr(self, key) >= 0, key, "must be >= 0")
        for key in ("log_every", "local_mfu_repeats"):
            self.require(getattr(self, key) > 0, key, "must be > 0")
        self.require(self.patience >= 0, "patience", "must be >= 0 (0 = never stop early)")
        self.require(self.patience == 0 or self.eval_every > 0, "patience", "needs train.eval_every > 0")
        self.require(
            self.valid_metric == "" or split_valid_metric(self.valid_metric)[0] is not None,
            "valid_metric",
            f"must be one of {', '.join(VALID_METRICS)}, optionally followed by _<label>",
        )


def split_valid_metric(name: str) -> tuple[str | None, str | None]:
    """(metric, label) of a `train.valid_metric`: ("ne", None) for "" (None: the first label); (None, None) when
    it is none of VALID_METRICS."""
    for kind in VALID_METRICS:
        if name in ("", kind):
            return ("ne" if not name else kind), None
        if name.startswith(f"{kind}_") and len(name) > len(kind) + 1:
            return kind, name[len(kind) + 1 :]
    return None, None


@dataclass(frozen=True)
class Fp8Config(Section):
    """How `train.precision = "fp8"` converts the model (components/trainer/precision.py, docs/precision.md)."""

    SECTION: ClassVar[str] = "fp8"

    grad_format: Literal["e4m3", "e5m2"] = "e4m3"  # activations and weights are always e4m3
    scaling: Literal["dynamic", "delayed"] = "dynamic"  # block scales from the current tensor, or per-tensor history
    amax_history: int = 16  # steps of amax history (delayed scaling)
    overrides: dict[str, Literal["bf16", "fp8"]] = field(default_factory=dict)  # module-name glob -> precision
    gemm: Literal["triton", "cublas"] = "triton"  # the MLPs' dense GEMMs on CUDA; experts always run ours
    # the towers that feed the task heads (non-sequence, interaction: their MLPs and MoE experts) stay bf16: on the
    # synthetic set their FP8 cost most of the NE (docs/benchmarks.md); false converts them too
    top_layers_bf16: bool = True
    # the attention layers' forward in FP8 (`KernelOptions.fp8`: QK^T and PV on e4m3, softmax in fp32, bf16
    # backward), by the same overrides; off until its NE is measured (docs/benchmarks.md)
    attention: bool = False

    def check(self) -> None:
        self.require(self.amax_history >= 1, "amax_history", "must be >= 1")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    SECTION: ClassVar[str] = "checkpoint"

    every: int = 200  # steps between checkpoints; 0 = none
    keep: int = 2  # newest checkpoints kept
    # Training stops instead of writing a checkpoint whose parameter norm grew more than this factor since the
    # previous checkpoint (or the start): a diverging update leaves finite but exploded weights.
    max_param_growth: float = 100.0

    def check(self) -> None:
        self.require(self.every >= 0, "every", "must be >= 0 (0 = no checkpoints)")
        self.require(self.keep >= 1, "keep", "must be >= 1")
        self.require(self.max_param_growth > 1, "max_param_growth", "must be > 1")


@dataclass(frozen=True)
class BenchConfig(Section):
    """Synthetic production-shaped batches for the GPU benchmarks (the GPU machine has no dataset)."""

    SECTION: ClassVar[str] = "bench"

    steps: int = 30  # timed steps
    warmup_steps: int = 10
    distinct_batches: int = 4  # generated up front and rotated
    profile_steps: int = 3
    mean_seq_len: float = 256.0  # lognormal history lengths, capped at data.max_seq_len
    length_sigma: float = 1.0
    num_users: int = 1_000_000
    num_items: int = 1_000_000
    num_dense: int = 16

    def check(self) -> None:
        for key in ("steps", "distinct_batches", "num_users", "num_items"):
            self.require(getattr(self, key) > 0, key, "must be > 0")
        for key in ("warmup_steps", "profile_steps", "num_dense"):
            self.require(getattr(self, key) >= 0, key, "must be >= 0")
        self.require(self.mean_seq_len >= 1, "mean_seq_len", "must be >= 1")
        self.require(self.length_sigma >= 0, "length_sigma", "must be >= 0")


RetrievalLoss = Literal["softmax", "sampled", "bce"]
RankerLoss = Literal["bce", "softmax"]


@dataclass(frozen=True)
class SeqRecConfig(Section):
    """`gemrec bench seqrec`: leave-one-out next-item benchmarks (components/trainer/seqrec.py)."""

    SECTION: ClassVar[str] = "seqrec"

    epochs: int = 200  # upper bound: early stopping on validation NDCG@10 ends a run sooner
    patience: int = 5  # validations in a row without a better NDCG@10 before stopping
    eval_every: float = 1.0  # epochs between validations
    batch_size: int = 256  # user sequences (retrieval arms) or positive examples (ranker) per step
    max_seq_len: int = 50  # most recent history items the models see
    ranker_negatives: int = 4  # sampled negatives per positive for the pointwise GEM ranker (sampled99)
    ranker_loss: RankerLoss = "bce"  # bce (each candidate alone) | softmax (each positive against its negatives)
    # Weight of the ranker's auxiliary next-item loss: a full softmax over the catalogue at every history token of
    # its sequence tower (the retrieval head's objective), added to the pointwise loss. 0: off.
    ranker_next_item_weight: float = 0.0
    # Weights of the retrieval head's score (sequence vector . item vector) added to the ranker's logit when
    # scoring candidates; every validation scores each, and the test uses the best (weight, checkpoint) pair.
    ranker_retrieval_weights: tuple[float, ...] = (0.0,)
    # Decay of an exponential moving average of the ranker's weights: the average is validated, kept and tested. 0: off
    ranker_weight_average: float = 0.0
    # The ranker's epochs are 1 + ranker_negatives times longer (every candidate is an example): its own cadence.
    ranker_eval_every: float = 0.25  # epochs between the ranker's validations
    ranker_patience: int = 3  # the ranker's validations without a better NDCG@10 before stopping
    gem_loss: RetrievalLoss = "softmax"  # GEM retrieval head (full)
    sasrec_loss: RetrievalLoss = "bce"  # SASRec baseline (its paper: bce, one negative per position)
    sampled_negatives: int = 512  # negatives shared by a batch for the "sampled" loss
    valid_users: int = 0  # users drawn for each validation (0: all); the test always uses all
    eval_batch_size: int = 256  # users per evaluation batch
    sparse_optimizer: bool = True  # row-wise Adagrad on embedding tables; false: AdamW over every parameter

    def check(self) -> None:
        keys = ("epochs", "patience", "eval_every", "ranker_eval_every", "ranker_patience", "batch_size")
        for key in (*keys, "eval_batch_size", "max_seq_len"):
            self.require(getattr(self, key) > 0, key, "must be > 0")
        for key in ("ranker_negatives", "sampled_negatives"):
            self.require(getattr(self, key) > 0, key, "must be > 0")
        self.require(self.valid_users >= 0, "valid_users", "must be >= 0 (0 = all)")
        self.require(0 <= self.ranker_weight_average < 1, "ranker_weight_average", "must be in [0, 1) (0 = off)")
        self.require(self.ranker_next_item_weight >= 0, "ranker_next_item_weight", "must be >= 0 (0 = off)")
        weights = self.ranker_retrieval_weights
        self.require(len(weights) > 0 and min(weights) >= 0, "ranker_retrieval_weights", "must be >= 0, at least one")


# Recipe table -> its section type, in the order they are logged.
SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "kernels": KernelOptions,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": LoopConfig,
    "fp8": Fp8Config,
    "checkpoint": CheckpointConfig,
    "bench": BenchConfig,
    "sasrec": SASRecConfig,
    "seqrec": SeqRecConfig,
}


@dataclass(frozen=True)
class TrainConfig:
    """A whole recipe: one typed section per table, checked once when built."""

    recipe: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelOptions = field(default_factory=KernelOptions)  # how the attention kernels run (not results)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # multi-rank layout (one rank ignores it)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)  # used when train.precision = "fp8"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sasrec: SASRecConfig = field(default_factory=SASRecConfig)  # the SASRec baseline of `gemrec bench seqrec`
    seqrec: SeqRecConfig = field(default_factory=SeqRecConfig)

    def __post_init__(self) -> None:
        if self.model.rope == "separate" and self.data.max_seq_len > self.model.rotary_max_positions:
            raise ConfigError(
                f"data.max_seq_len = {self.data.max_seq_len} exceeds model.rotary_max_positions = "
                f"{self.model.rotary_max_positions} (the tables of model.rope = 'separate'): raise "
                "model.rotary_max_positions, use model.rope = 'fused' or shorten the histories"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], recipe: str = "custom") -> TrainConfig:
        return cls(recipe=recipe, **build_sections(raw, SECTIONS))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, **{name: getattr(self, name).to_dict() for name in SECTIONS}}

    def flat(self) -> dict[str, Any]:
        """`section.key -> value` for every setting (MLflow params)."""
        return {
            "recipe": self.recipe,
            **{f"{name}.{key}": value for name in SECTIONS for key, value in getattr(self, name).to_dict().items()},
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


def recipe_name(recipe: str) -> str:
    """What names a recipe's config, runs, run folders and registered model: a built-in's name or a TOML file's stem,
    anything but letters, digits, `_`, `.` and `-` replaced by `-` (MLflow model names refuse `/` and `:`)."""
    return re.sub(r"[^\w.-]+", "-", Path(recipe).stem if recipe.endswith(".toml") else recipe)


def balance_linear_weight(config: TrainConfig) -> float:
    """The data service's rank-balancing `linear_weight` for this recipe's model: its sequence layers' per-token
    work against their attention (`balance.transformer_linear_weight`); the default for a model without one."""
    from gemrec.components.data_service.balance import DEFAULT_LINEAR_WEIGHT, transformer_linear_weight

    model = config.model
    if model.arch != "gem":
        return DEFAULT_LINEAR_WEIGHT
    return transformer_linear_weight(model.d_model, model.mlp_ratio, model.seq_causal)


def load_recipe(name: str, overrides: Iterable[str] = (), arch: str | None = None) -> TrainConfig:
    """The recipe `name` (built-in or a .toml path) with `section.key=value` overrides, checked once."""
    path = recipe_path(name)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(f"recipe {path} is not valid TOML: {err}") from err
    raw = apply_overrides(raw, overrides)
    if arch is not None:
        raw.setdefault("model", {})["arch"] = arch
    return TrainConfig.from_dict(raw, recipe=recipe_name(str(path)))
