"""`gemrec bench seqrec`: leave-one-out next-item benchmarks against the published sequential-recommendation tables.

Protocols (definitions in `ranking.py`):
- `sampled99`: the target among 99 sampled unseen items. Arm `gem` is the pointwise GEM ranker (the model's
  CTR forward: user, candidate item and its attributes, the history with target-aware tokens), trained on the
  observed next items as positives and `seqrec.ranker_negatives` sampled negatives each (`seqrec.ranker_loss`:
  binary cross-entropy per candidate, or the softmax cross-entropy of each positive against its negatives), plus,
  weighted by `seqrec.ranker_next_item_weight`, the retrieval head's next-item softmax over the catalogue at every
  history token of the same sequence tower (multi-task: the tower and the item embeddings also learn what follows).
  Candidates are scored by the ranker's logit plus a weight times that retrieval head's score; the weight is chosen
  with the checkpoint on validation among `seqrec.ranker_retrieval_weights` (default 0: the ranker alone).
- `full`: the target among all items, history items removed. Arm `gem` is GEM's retrieval head: the causal
  sequence tower's output at the last history token, dot product with the item vectors
  (`GEMModel.sequence_vectors` / `item_vectors`), trained on next-item prediction at every position with
  `seqrec.gem_loss` (full softmax, sampled softmax or BCE).
- Arm `sasrec`, under either protocol: the SASRec baseline (`gemrec.model.sasrec`), trained with
  `seqrec.sasrec_loss` (its paper's BCE with one negative per position by default).

Every arm trains with the trainer's pieces: its optimizers (row-wise Adagrad on embedding tables, AdamW on the
rest), the one `train_step`, its loss guard (`first_nonfinite`) and its `EarlyStopping`: validation on the `valid`
split every `seqrec.eval_every` epochs (the ranker: `ranker_eval_every`), a stop after `seqrec.patience`
(`ranker_patience`) validations without a better NDCG@10, and the test on the `test` split with the best validated
weights (with `seqrec.ranker_weight_average`, an exponential moving average of the ranker's weights is what is
validated, kept and tested). Everything goes to one MLflow run (params, per-validation metrics, test metrics, a PNG
of the metrics, the results JSON). The loop itself is this file's, not the `Trainer`'s: one process, batches of
users' sequences (not the data service's `Batch` stream), ranking metrics instead of NE/AUC, and the best weights
kept in memory (a run of minutes writes no checkpoints).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gemrec.components.common import jagged
from gemrec.components.trainer.config import TrainConfig
from gemrec.components.trainer.evaluate import EarlyStopping
from gemrec.components.trainer.ranking import KS, SAMPLED_NEGATIVES, ranking_metrics, sample_unseen, target_ranks
from gemrec.components.trainer.seqrec_data import Jagged, SeqRecData, Targets
from gemrec.components.trainer.tracking import (
    Tracker,
    finite_or_none,
    metric_key,
    resolve_tracking_uri,
    write_summary,
)
from gemrec.components.trainer.trainer import TrainingError, first_nonfinite
from gemrec.components.trainer.training import autocast_for, set_determinism
from gemrec.provenance import git_commit
from tqdm import tqdm

log = logging.getLogger(__name__)

PROTOCOLS = ("sampled99", "full")
ARMS = ("gem", "sasrec")
CANDIDATE_SEEDS = {"valid": 12346, "test": 12345}  # sampled-99 candidates: fixed, the same for every arm and run

# Published numbers (test split) the results are compared with; see docs/benchmarks.md for the sources.
PUBLISHED = {
    ("Beauty", "sampled99"): {
        "S3-Rec": {"hr@5": 0.4502, "ndcg@5": 0.3407, "hr@10": 0.5506, "ndcg@10": 0.3732, "mrr": 0.3340},
        "SASRec": {"hr@5": 0.3741, "ndcg@5": 0.2848, "hr@10": 0.4696, "ndcg@10": 0.3156, "mrr": 0.2852},
    },
    ("Sports_and_Outdoors", "sampled99"): {
        "S3-Rec": {"hr@5": 0.4267, "ndcg@5": 0.3104, "hr@10": 0.5614, "ndcg@10": 0.3538, "mrr": 0.3071},
        "SASRec": {"hr@5": 0.3466, "ndcg@5": 0.2497, "hr@10": 0.4622, "ndcg@10": 0.2869, "mrr": 0.2520},
    },
    ("Beauty", "full"): {
        "ICLRec": {"hr@10": 0.0744, "ndcg@10": 0.0403},
        "S3-Rec": {"hr@10": 0.0647, "ndcg@10": 0.0327},
        "SASRec": {"hr@10": 0.0605, "ndcg@10": 0.0318},
    },
    ("Sports_and_Outdoors", "full"): {"ICLRec": {"hr@10": 0.0437, "ndcg@10": 0.0238}},
}


class RetrievalArm:
    """A model with `sequence_vectors` / `item_vectors`, trained on next-item prediction at every position."""

    def __init__(self, name: str, model, data: SeqRecData, loss: str, config: TrainConfig, device: torch.device):
        self.name, self.model, self.data, self.loss_kind = name, model, data, loss
        self.config, self.device = config.seqrec, device
        self.catalog = data.catalog(device)
        lengths = data.train_sequences.lengths
        self.users = np.flatnonzero(lengths >= 2)  # a single train event predicts nothing

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.users) / self.config.batch_size))

    def batches(self, rng: np.random.Generator):
        """(history input, next item of every history token, user of every token) per batch of users."""
        sequences = self.data.train_sequences
        order = rng.permutation(self.users)
        for start in range(0, len(order), self.config.batch_size):
            users = order[start : start + self.config.batch_size]
            lengths = np.minimum(sequences.lengths[users], self.config.max_seq_len + 1)
            ends = sequences.offsets[users + 1]
            inputs = Jagged.from_lengths(sequences.values[jagged.ranges(ends - lengths, lengths - 1)], lengths - 1)
            targets = sequences.values[jagged.ranges(ends - lengths + 1, lengths - 1)]
            yield self.data.model_input(inputs), targets, np.repeat(users, lengths - 1)

    def step_args(self, batch, rng: np.random.Generator):
        """(input, labels, objective) of `train_step`: the next-item loss of every history token."""
        from gemrec.model.retrieval import bce_loss, sampled_softmax_loss, softmax_loss

        inp, targets, users = batch
        targets_t = torch.from_numpy(targets).to(self.device)
        negatives: torch.Tensor | None = None
        if self.loss_kind == "sampled":
            negatives = torch.from_numpy(rng.integers(self.data.num_items, size=self.config.sampled_negatives))
        elif self.loss_kind == "bce":
            negatives = torch.from_numpy(self.data.train_negatives(users, 1, rng)[:, 0])
        negatives = negatives.to(self.device) if negatives is not None else None

        def objective(model, inp) -> torch.Tensor:
            hidden = model.sequence_vectors(inp).float()
            items = model.item_vectors(*self.catalog).float()
            if negatives is None:  # the full softmax needs no negatives
                return softmax_loss(hidden, items, targets_t)
            if self.loss_kind == "sampled":
                hits = negatives[None, :] == targets_t[:, None]
                return sampled_softmax_loss(hidden, items[targets_t], items[negatives], hits)
            return bce_loss(hidden, items[targets_t], items[negatives])

        return inp.to(self.device), None, objective

    @torch.no_grad()
    def scores(self, targets: Targets, candidates: np.ndarray | None) -> torch.Tensor:
        return retrieval_scores(self.model, self.data, self.catalog, targets, candidates, self.device)


def retrieval_scores(model, data: SeqRecData, catalog, targets: Targets, candidates: np.ndarray | None, device):
    """The retrieval head's scores: the sequence vector at the last history token · the item vectors of the
    candidates (U, C), or of the whole catalogue (U, items) when `candidates` is None."""
    inp = data.model_input(targets.history).to(device)
    hidden = model.sequence_vectors(inp).float()
    lengths = inp.seq_lengths()
    last = hidden[(inp.seq_offsets[1:] - 1).clamp(min=0)] * (lengths > 0)[:, None]
    items = model.item_vectors(*catalog).float()
    if candidates is None:
        return last @ items.t()
    chosen = items[torch.from_numpy(candidates).to(device)]
    return (chosen * last[:, None, :]).sum(-1)


class RankerArm:
    """The pointwise GEM ranker: P(candidate is the next item | user, history), binary cross-entropy."""

    def __init__(self, name: str, model, data: SeqRecData, config: TrainConfig, device: torch.device):
        self.name, self.model, self.data, self.config, self.device = name, model, data, config.seqrec, device
        self.mixes = self.config.ranker_retrieval_weights
        self.catalog = data.catalog(device) if self.config.ranker_next_item_weight or any(self.mixes) else None
        self.mix = self.mixes[0]  # the weight `scores` adds the retrieval head's score with (chosen on validation)

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(len(self.data.splits["train"]) / self.config.batch_size))

    def _input(self, targets: Targets, candidates: np.ndarray):
        """One example per candidate. Without target-aware tokens a user's candidates share one pass of the
        sequence tower (`history_index`); with them each candidate gets its own copy of the history."""
        rows = np.repeat(np.arange(len(targets)), candidates.shape[1])
        if self.model.config.target_aware:
            return self.data.model_input(targets.history.take(rows), targets.users[rows], candidates.reshape(-1))
        return self.data.model_input(targets.history, targets.users[rows], candidates.reshape(-1), history_index=rows)

    def batches(self, rng: np.random.Generator):
        """(input, labels, next-item targets) per batch of positives, each followed by its sampled negatives; the
        targets (with `ranker_next_item_weight`, else None): the histories alone and the item after every token."""
        train = self.data.splits["train"]
        order = rng.permutation(len(train))
        k = self.config.ranker_negatives
        for start in range(0, len(order), self.config.batch_size):
            positives = train.take(order[start : start + self.config.batch_size])
            negatives = self.data.train_negatives(positives.users, k, rng)
            candidates = np.concatenate([positives.items[:, None], negatives], axis=1)
            labels = np.zeros(candidates.shape, dtype=np.float32)
            labels[:, 0] = 1.0
            next_items = None
            if self.config.ranker_next_item_weight and len(positives.history.values):
                next_items = (self.data.model_input(positives.history), torch.from_numpy(positives.next_items()))
            yield self._input(positives, candidates), torch.from_numpy(labels.reshape(-1, 1)), next_items

    def step_args(self, batch, rng: np.random.Generator):
        """(input, labels, objective) of `train_step`: the model's own multi-task BCE, or (ranker_loss softmax)
        each positive (column 0 of its group) against its own negatives, on the same pointwise scores; plus the
        weighted next-item softmax of the sequence tower (`ranker_next_item_weight`)."""
        from gemrec.model.gem import loss
        from gemrec.model.retrieval import softmax_loss

        inp, labels, next_items = batch
        cfg = self.config
        if cfg.ranker_loss == "bce" and next_items is None:
            return inp.to(self.device), labels.to(self.device), None
        labels, group, catalog = labels.to(self.device), cfg.ranker_negatives + 1, self.catalog
        if next_items is not None:
            history, targets = next_items[0].to(self.device), next_items[1].to(self.device)

        def objective(model, inp) -> torch.Tensor:
            out = model(inp)
            if cfg.ranker_loss == "bce":
                total = loss(out, labels)
            else:
                groups = out.logits[:, 0].float().view(-1, group)
                first = torch.zeros(len(groups), dtype=torch.long, device=groups.device)
                total = F.cross_entropy(groups, first) + out.aux_loss
            if next_items is not None and catalog is not None:
                hidden = model.sequence_vectors(history).float()
                items = model.item_vectors(*catalog).float()
                total = total + cfg.ranker_next_item_weight * softmax_loss(hidden, items, targets)
            return total

        return inp.to(self.device), None, objective

    @torch.no_grad()
    def scores(self, targets: Targets, candidates: np.ndarray | None) -> torch.Tensor:
        return self.mixed_scores(targets, candidates, (self.mix,))[0]

    @torch.no_grad()
    def mixed_scores(self, targets: Targets, candidates: np.ndarray | None, mixes: tuple[float, ...]) -> torch.Tensor:
        """(len(mixes), U, C): the ranker's logit plus each weight times the retrieval head's score."""
        if candidates is None:
            raise ValueError("the pointwise ranker scores sampled candidates; full ranking uses GEM's retrieval head")
        logits = self.model(self._input(targets, candidates).to(self.device)).logits[:, 0].float()
        logits = logits.view(candidates.shape)
        if not any(mixes):
            return logits.expand(len(mixes), *logits.shape)
        retrieval = retrieval_scores(self.model, self.data, self.catalog, targets, candidates, self.device)
        weights = torch.tensor(mixes, device=logits.device)[:, None, None]
        return logits + weights * retrieval


def build_arm(name: str, protocol: str, config: TrainConfig, data: SeqRecData, device: torch.device):
    from gemrec.model import build_model
    from gemrec.model.sasrec import SASRec

    if name == "sasrec":
        sasrec = SASRec(config.sasrec, data.schema).to(device)
        return RetrievalArm(name, sasrec, data, config.seqrec.sasrec_loss, config, device)
    model = build_model(config.model, data.schema, config.kernels).to(device)
    if protocol == "full":
        return RetrievalArm(name, model, data, config.seqrec.gem_loss, config, device)
    return RankerArm(name, model, data, config, device)


class RankingEvaluator:
    """Ranks of the `valid` or `test` targets under one protocol, timed (`seconds`: the last call's wall time);
    sampled candidates are drawn once. (`evaluate.Evaluator` is the trainer's NE/AUC evaluation.)"""

    def __init__(self, data: SeqRecData, protocol: str, batch_users: int, device: torch.device):
        self.data, self.protocol, self.batch_users, self.device = data, protocol, batch_users, device
        self.candidates: dict[str, np.ndarray] = {}
        self.seconds = 0.0

    def _candidates(self, split: str) -> np.ndarray:
        if split not in self.candidates:
            targets = self.data.splits[split]
            seen = self.data.user_items.take(targets.users)
            negatives = sample_unseen(
                seen.values, seen.offsets, self.data.num_items, SAMPLED_NEGATIVES, CANDIDATE_SEEDS[split]
            )
            self.candidates[split] = np.concatenate([targets.items[:, None], negatives], axis=1)
        return self.candidates[split]

    def metrics(self, arm, split: str, rows: np.ndarray | None = None) -> dict:
        """`ranking_metrics` of the arm's ranks of `split` (its `rows` only when given)."""
        start = time.perf_counter()
        ranks = self.ranks(arm, split, rows)
        self.seconds = time.perf_counter() - start
        return ranking_metrics(ranks)

    def mix_metrics(self, arm: RankerArm, split: str, rows: np.ndarray | None = None) -> dict[float, dict]:
        """`ranking_metrics` per retrieval weight of the ranker (`arm.mixes`), from one scoring pass."""
        start = time.perf_counter()
        ranks = self.ranks(arm, split, rows, arm.mixes)
        self.seconds = time.perf_counter() - start
        return {mix: ranking_metrics(r) for mix, r in zip(arm.mixes, ranks)}

    def ranks(self, arm, split: str, rows: np.ndarray | None = None, mixes: tuple[float, ...] | None = None):
        """0-based ranks of the targets (U,); with `mixes` (a ranker's retrieval weights) one row per weight."""
        targets = self.data.splits[split]
        rows = np.arange(len(targets)) if rows is None else rows
        candidates = self._candidates(split) if self.protocol == "sampled99" else None
        arm.model.eval()
        out = []
        try:
            for start in range(0, len(rows), self.batch_users):
                chunk = rows[start : start + self.batch_users]
                part = targets.take(chunk)
                if candidates is not None:
                    if mixes is None:
                        scores = arm.scores(part, candidates[chunk])[None]
                    else:
                        scores = arm.mixed_scores(part, candidates[chunk], mixes)
                    target = torch.zeros(len(chunk), dtype=torch.long, device=scores.device)
                    ranks = np.stack([target_ranks(s, target).cpu().numpy() for s in scores])
                    out.append(ranks if mixes is not None else ranks[0])
                    continue
                scores = arm.scores(part, None)
                masked = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
                user_rows = np.repeat(np.arange(len(chunk)), part.before.lengths)
                masked[torch.from_numpy(user_rows), torch.from_numpy(part.before.values)] = True
                target = torch.from_numpy(part.items).to(scores.device)
                out.append(target_ranks(scores, target, masked).cpu().numpy())
        finally:
            arm.model.train()
        return np.concatenate(out, axis=-1)


def arm_metrics(arm: str, split: str, metrics: dict) -> dict[str, float]:
    """MLflow names of an arm's ranking metrics on a split (`gem/valid_ndcg_at_10`), the user count left out."""
    return {f"{arm}/{split}_{metric_key(k)}": v for k, v in metrics.items() if k != "users"}


def by_ndcg(item: tuple[float, dict]) -> float:
    return item[1]["ndcg@10"]


def train_arm(arm, evaluator: RankingEvaluator, config: TrainConfig, tracker: Tracker, device: torch.device) -> dict:
    """Train with early stopping on validation NDCG@10, then test the best weights; the arm's results."""
    from gemrec.components.trainer.optim import Optimizers, WeightAverage, apply_sparse_optimizer
    from gemrec.model import train_step

    cfg = config.seqrec
    rng = np.random.default_rng(config.train.seed)
    model = arm.model
    sparse_kind = apply_sparse_optimizer(model, config.optim) if cfg.sparse_optimizer else "none (AdamW on all)"
    steps_per_epoch = arm.steps_per_epoch
    optimizers = Optimizers(model, config.optim, cfg.epochs * steps_per_epoch)
    _, autocast = autocast_for(config.train.precision, device)
    ranker = isinstance(arm, RankerArm)
    decay = cfg.ranker_weight_average if ranker else 0.0
    average = WeightAverage(model, decay) if decay else None
    evaluated = average.applied if average is not None else contextlib.nullcontext  # the weights validated
    eval_every, patience = (cfg.ranker_eval_every, cfg.ranker_patience) if ranker else (cfg.eval_every, cfg.patience)
    early = EarlyStopping("ndcg@10", True, max(1, round(eval_every * steps_per_epoch)), patience)
    valid_rows = None
    if cfg.valid_users and cfg.valid_users < len(evaluator.data.splits["valid"]):
        pick = np.random.default_rng(CANDIDATE_SEEDS["valid"])
        valid_rows = np.sort(pick.choice(len(evaluator.data.splits["valid"]), cfg.valid_users, replace=False))
    params = sum(p.numel() for p in model.parameters())
    log.info(
        "%s (%s, %.2fM params): %d steps/epoch, validation every %d steps, sparse optimizer %s",
        arm.name,
        type(model).__name__,
        params / 1e6,
        steps_per_epoch,
        early.every,
        sparse_kind,
    )
    history: list[dict] = []
    best_state: dict[str, torch.Tensor] | None = None
    mix = best_mix = 0.0
    step, losses, eval_seconds = 0, list[torch.Tensor](), 0.0
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc=f"{arm.name}", unit="step", mininterval=2.0, dynamic_ncols=True)
    model.train()
    started = time.perf_counter()
    for batch in itertools.chain.from_iterable(arm.batches(rng) for _ in range(cfg.epochs)):
        inp, labels, objective = arm.step_args(batch, rng)
        result = train_step(
            model, inp, labels, autocast=autocast, optimizer_step=optimizers.clip_and_step, objective=objective
        )
        if average is not None:
            average.update()
        step += 1
        losses.append(result.loss)
        bar.update(1)
        if not early.due(step, last=False):
            continue
        bad = first_nonfinite(losses, step - len(losses) + 1)
        if bad is not None:
            raise TrainingError(f"{arm.name}: loss is {bad[1]} at step {bad[0]}")
        mean_loss = float(torch.stack(losses).float().mean())
        losses = []
        with autocast(), evaluated():
            if ranker:  # the ranker's retrieval weight is chosen here too: the best NDCG@10 over `arm.mixes`
                mix, metrics = max(evaluator.mix_metrics(arm, "valid", valid_rows).items(), key=by_ndcg)
            else:
                metrics = evaluator.metrics(arm, "valid", valid_rows)
            if early.update(step, metrics["ndcg@10"]):  # the validated weights are the ones kept
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best_mix = mix
        eval_seconds += evaluator.seconds
        chosen = {"retrieval_weight": mix} if ranker else {}
        record = {"step": step, "epoch": step / steps_per_epoch, "train_loss": mean_loss, **metrics, **chosen}
        history.append(record)
        logged = arm_metrics(arm.name, "valid", metrics) | {f"{arm.name}/{k}": v for k, v in chosen.items()}
        tracker.log_metrics(logged | {f"{arm.name}/train_loss": mean_loss}, step=step)
        bar.set_postfix(loss=f"{mean_loss:.4f}", ndcg10=f"{metrics['ndcg@10']:.4f}", best=f"{early.best:.4f}")
        log.info(
            "%s epoch %.2f: loss %.4f, valid HR@10 %.4f NDCG@10 %.4f (best %.4f at epoch %.2f)",
            arm.name,
            record["epoch"],
            mean_loss,
            metrics["hr@10"],
            metrics["ndcg@10"],
            early.best,
            early.best_step / steps_per_epoch,
        )
        if early.stop:
            break
    bar.close()
    train_seconds = time.perf_counter() - started - eval_seconds
    if best_state is None:
        raise TrainingError(f"{arm.name}: no validation ran (the validation interval is longer than seqrec.epochs)")
    model.load_state_dict(best_state)
    if ranker:
        arm.mix = best_mix
    with autocast():
        test = evaluator.metrics(arm, "test")
    tracker.log_metrics(arm_metrics(arm.name, "test", test), step=step)
    log.info("%s test: %s", arm.name, ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != "users"))
    return {
        "test": test,
        **({"retrieval_weight": best_mix} if ranker else {}),
        "valid_best": next(h for h in history if h["step"] == early.best_step),
        "best_epoch": early.best_step / steps_per_epoch,
        "epochs": step / steps_per_epoch,
        "steps": step,
        "params": params,
        "train_seconds": train_seconds,
        "valid_seconds": eval_seconds,
        "test_seconds": evaluator.seconds,
        "history": history,
    }


def plot_results(results: dict, published: dict):
    """Validation NDCG@10 over epochs per arm, and test HR@10 / NDCG@10 beside the published numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results["arms"].items():
        curves.plot([h["epoch"] for h in r["history"]], [h["ndcg@10"] for h in r["history"]], "o-", ms=3, label=name)
    curves.set_xlabel("epoch")
    curves.set_ylabel("valid NDCG@10")
    curves.set_title(f"{results['dataset']} ({results['protocol']})")
    curves.legend()
    rows = [(f"{n} (ours)", r["test"]) for n, r in results["arms"].items()]
    rows += [(f"{n} (published)", m) for n, m in published.items()]
    x = np.arange(len(rows))
    for i, key in enumerate(("hr@10", "ndcg@10")):
        values = [m.get(key, np.nan) for _, m in rows]
        bars.bar(x + (i - 0.5) * 0.4, values, 0.4, label=key.upper())
    bars.set_xticks(x, [name for name, _ in rows], rotation=20, ha="right")
    bars.set_ylabel("test")
    bars.legend()
    fig.tight_layout()
    return fig


def results_table(results: dict, published: dict) -> str:
    keys = [*(f"hr@{k}" for k in KS), *(f"ndcg@{k}" for k in KS), "mrr"]
    lines = [
        "| model | " + " | ".join(k.upper() for k in keys) + " | best epoch | train s |",
        "|---" * (len(keys) + 3) + "|",
    ]
    for name, r in results["arms"].items():
        cells = " | ".join(f"{r['test'][k]:.4f}" for k in keys)
        lines.append(f"| {name} (ours) | {cells} | {r['best_epoch']:.1f} | {r['train_seconds']:.0f} |")
    for name, m in published.items():
        cells = " | ".join(f"{m[k]:.4f}" if k in m else "-" for k in keys)
        lines.append(f"| {name} (published) | {cells} | - | - |")
    return "\n".join(lines)


def run_seqrec_bench(
    dataset: Path,
    protocol: str,
    config: TrainConfig,
    arms: list[str],
    *,
    tracking_uri: str | None,
    experiment: str,
    tracking: bool,
    device: str,
    metrics_out: Path | None,
) -> dict:
    """Train and test every arm on one protocol; the results (also written to `metrics_out` and MLflow)."""
    from gemrec.components.data_service.dataset import Dataset

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        raise ValueError(f"arms must be among {ARMS}, got {arms}")
    started = time.perf_counter()
    load_start = os.getloadavg()
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    if dev.type == "cpu":
        torch.set_num_threads(config.train.threads or os.cpu_count() or 1)
    data = SeqRecData(Dataset.open(dataset), config.seqrec.max_seq_len)
    published = PUBLISHED.get((str(data.name), protocol), {})
    uri = resolve_tracking_uri(tracking_uri)
    tracker = Tracker(tracking, uri, experiment, run_name=f"seqrec-{protocol}-{data.name}-{config.recipe}")
    try:
        tracker.log_params(
            {**config.flat(), "protocol": protocol, "arms": ",".join(arms), "dataset": data.name, "device": str(dev)}
        )
        tracker.set_tags({"git_commit": git_commit(), "dataset_checksum": data.checksum, "recipe": config.recipe})
        evaluator = RankingEvaluator(data, protocol, config.seqrec.eval_batch_size, dev)
        arm_results = {}
        for name in arms:
            set_determinism(config.train.seed, config.train.deterministic)  # each arm's weights from the seed
            arm = build_arm(name, protocol, config, data, dev)
            arm_results[name] = train_arm(arm, evaluator, config, tracker, dev)
        headline = arm_results[arms[0]]["test"]
        results = {
            "protocol": protocol,
            "dataset": data.name,
            "recipe": config.recipe,
            "arm": arms[0],
            **{k: v for k, v in headline.items()},
            "arms": arm_results,
            "published": published,
            "seed": config.train.seed,
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "machine": platform.node(),
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "wall_seconds": time.perf_counter() - started,
            "git_commit": git_commit(),
            "dataset_checksum": data.checksum,
            "mlflow": {"tracking_uri": uri, "experiment": experiment, "run_id": tracker.run_id},
        }
        if tracker.enabled:
            import matplotlib.pyplot as plt

            fig = plot_results(results, published)
            tracker.log_figure(fig, "plots/seqrec_metrics.png")
            plt.close(fig)
            tracker.log_dict(finite_or_none(results), "metrics/seqrec.json")
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish()
    if metrics_out is not None:
        write_summary(Path(metrics_out), results)
    results["table"] = results_table(results, published)
    return results
