"""Leave-one-out ranking protocols: metric definitions, ties and masks, candidate sampling, data boundaries."""

import math

import numpy as np
import pytest
import torch
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.s3rec import prepare_s3rec
from gemrec.components.trainer.ranking import ranking_metrics, sample_unseen, target_ranks
from gemrec.components.trainer.seqrec import RankingEvaluator
from gemrec.components.trainer.seqrec_data import SeqRecData


@pytest.fixture(scope="module")
def toy(s3rec_toy, tmp_path_factory):
    raw, sequences = s3rec_toy()
    out = prepare_s3rec(tmp_path_factory.mktemp("toy") / "data", raw, "Toy", max_history=8, progress=False)
    return out, sequences


def raw_ids(ds: Dataset, entity: str) -> np.ndarray:
    import pyarrow.parquet as pq

    return np.array([int(v) for v in pq.read_table(ds.path / "vocab" / f"{entity}s.parquet").column("raw_id")])


def test_metrics_by_hand():
    ranks = np.array([0, 1, 4, 12, 25])
    m = ranking_metrics(ranks)
    assert (
        m["hr@5"] == pytest.approx(3 / 5) and m["hr@10"] == pytest.approx(3 / 5) and m["hr@20"] == pytest.approx(4 / 5)
    )
    assert m["ndcg@5"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(6)) / 5)
    assert m["ndcg@20"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(6) + 1 / math.log2(14)) / 5)
    assert m["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 5 + 1 / 13 + 1 / 26) / 5)
    assert m["users"] == 5
    with pytest.raises(ValueError):
        ranking_metrics(np.array([]))


def test_ranks_count_ties_against_the_target_and_skip_masked():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.1], [3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    target = torch.tensor([0, 2, 1])
    assert target_ranks(scores, target).tolist() == [2, 2, 3]
    masked = torch.tensor([[False, True, False, False], [True, False, False, False], [False, True, False, False]])
    # Row 0: the 0.9 is masked; row 1: the 3.0 is masked; row 2: the target itself is masked: last.
    assert target_ranks(scores, target, masked).tolist() == [1, 1, 3]


def test_sampled_negatives_are_unseen_distinct_and_seeded():
    seen_values = np.array([0, 1, 2, 5, 7, 3])
    seen_offsets = np.array([0, 3, 5, 6])
    a = sample_unseen(seen_values, seen_offsets, 12, 6, seed=1)
    assert a.shape == (3, 6)
    for u in range(3):
        row = set(a[u].tolist())
        assert len(row) == 6 and not row & set(seen_values[seen_offsets[u] : seen_offsets[u + 1]].tolist())
    assert (sample_unseen(seen_values, seen_offsets, 12, 6, seed=1) == a).all()
    assert not (sample_unseen(seen_values, seen_offsets, 12, 6, seed=2) == a).all()
    with pytest.raises(ValueError, match="fewer than 10 unseen"):
        sample_unseen(seen_values, seen_offsets, 12, 10, seed=1)


def test_sampled_negatives_are_uniform():
    users = 20_000
    offsets = np.arange(users + 1) * 2
    values = np.tile([0, 1], users)
    counts = np.bincount(sample_unseen(values, offsets, 10, 3, seed=0).ravel(), minlength=10)
    assert counts[:2].sum() == 0
    expected = users * 3 / 8
    assert np.abs(counts[2:] - expected).max() < 4 * math.sqrt(expected)


def test_leave_one_out_data_has_no_leak(toy):
    path, sequences = toy
    ds = Dataset.open(path)
    data = SeqRecData(ds, max_seq_len=6)
    users, items = raw_ids(ds, "user"), raw_ids(ds, "item")
    for split, cut in (("valid", 2), ("test", 1)):
        t = data.splits[split]
        assert len(t) == len(sequences)
        for row in range(len(t)):
            seq = sequences[users[t.users[row]]]
            assert items[t.items[row]] == seq[-cut]
            assert items[t.history.row(row)].tolist() == seq[:-cut][-6:]  # cut to max_seq_len
            assert items[t.before.row(row)].tolist() == seq[:-cut]  # the full history, for masking
    rng = np.random.default_rng(0)
    for u in range(data.num_users):
        seq = sequences[users[u]]
        train = items[data.train_sequences.row(u)].tolist()
        assert train == seq[:-2]  # the valid and test items never reach training
        negatives = items[data.train_negatives(np.full(200, u), 1, rng)[:, 0]]
        assert not set(negatives.tolist()) & set(train)
    train = data.splits["train"]
    following = train.next_items()  # the ranker's next-item targets: the item after every history token
    for row in range(len(train)):
        seq = sequences[users[train.users[row]]]
        history = items[train.history.row(row)].tolist()
        assert set(history) <= set(seq[:-2])
        at = seq.index(items[train.items[row]])  # toy sequences repeat no item
        assert history == seq[:at][-6:]
        after = following[train.history.offsets[row] : train.history.offsets[row + 1]]
        assert items[after].tolist() == seq[at - len(history) + 1 : at + 1]


def test_sampled99_candidates_are_never_seen(toy):
    path, sequences = toy
    ds = Dataset.open(path)
    data = SeqRecData(ds, max_seq_len=8)
    users, items = raw_ids(ds, "user"), raw_ids(ds, "item")
    evaluator = RankingEvaluator(data, "sampled99", batch_users=16, device=torch.device("cpu"))
    candidates = evaluator._candidates("test")
    assert candidates.shape == (len(sequences), 100)
    for row, user in enumerate(data.splits["test"].users):
        seq = sequences[users[user]]
        assert items[candidates[row, 0]] == seq[-1]
        negatives = set(items[candidates[row, 1:]].tolist())
        assert len(negatives) == 99 and not negatives & set(seq)


class ItemIdScorer:
    """Scores every item by its dense index (higher index = better): ranks can be counted by hand."""

    model = torch.nn.Identity()

    def __init__(self, num_items):
        self.num_items = num_items

    def scores(self, targets, candidates):
        if candidates is None:
            return torch.arange(self.num_items, dtype=torch.float32).repeat(len(targets), 1)
        return torch.from_numpy(candidates).float()


def test_full_ranking_removes_history_items(toy):
    path, _ = toy
    data = SeqRecData(Dataset.open(path), max_seq_len=8)
    evaluator = RankingEvaluator(data, "full", batch_users=7, device=torch.device("cpu"))
    ranks = evaluator.ranks(ItemIdScorer(data.num_items), "test")
    t = data.splits["test"]
    for row in range(len(t)):
        target, before = t.items[row], set(t.before.row(row).tolist())
        expected = sum(1 for j in range(target + 1, data.num_items) if j not in before)
        assert ranks[row] == expected
    sampled = RankingEvaluator(data, "sampled99", batch_users=7, device=torch.device("cpu"))
    ranks = sampled.ranks(ItemIdScorer(data.num_items), "valid")
    candidates = sampled._candidates("valid")
    assert ranks.tolist() == (candidates[:, 1:] >= candidates[:, :1]).sum(1).tolist()
