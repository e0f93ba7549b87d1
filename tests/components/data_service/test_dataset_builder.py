"""The builder against a naive reference on random event logs full of ties, duplicates and disorder."""

import numpy as np
from gemrec.components.data_service.builder import EventLog, SplitConfig, build_dataset
from gemrec.components.data_service.dataset import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

event = st.tuples(st.integers(0, 4), st.integers(0, 5), st.integers(0, 12), st.integers(0, 1))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=st.lists(event, min_size=1, max_size=40),
    max_seq_len=st.integers(0, 6),
    eval_fraction=st.sampled_from([0.0, 0.3]),
)
def test_histories_match_a_naive_reference(tmp_path_factory, events, max_seq_len, eval_fraction):
    users, items, stamps, clicks = (np.array(column) for column in zip(*events))
    stamps = stamps + 1_000  # any int64 epoch works
    log = EventLog(
        users=users,
        items=items,
        timestamps=stamps,
        labels={"click": clicks},
        actions={"click": clicks.astype(np.float32), "row": np.arange(len(events), dtype=np.float32)},
    )
    split = SplitConfig(eval_fraction=eval_fraction, by="events")
    if eval_fraction and np.all(stamps >= split.cutoff_for(stamps)):
        return  # every event would be eval: the builder refuses an empty train split (tested elsewhere)
    ds = Dataset.open(
        build_dataset(tmp_path_factory.mktemp("b") / "ds", name="t", events=log, split=split, progress=False)
    )

    # Reference: the last input row of each (user, item, timestamp) wins; timelines sorted by (ts, item).
    kept = {}
    for row, (u, i, t, c) in enumerate(events):
        kept[(u, i, t + 1_000)] = (row, c)
    timeline = {u: sorted((t, i, row, c) for (uu, i, t), (row, c) in kept.items() if uu == u) for u in set(users)}
    unsorted = 0
    last_seen = {}
    for u, _, t, _ in events:
        unsorted += u in last_seen and t < last_seen[u]
        last_seen[u] = t
    m = ds.manifest
    assert m["counts"] == {
        "input_events": len(events),
        "duplicates_dropped": len(events) - len(kept),
        "unsorted_input_rows": unsorted,
    }
    cutoff = m["split"]["cutoff"]
    seen = 0
    for split_name in ds.splits:
        n = ds.num_examples(split_name)
        if n == 0:
            continue
        b = ds.collate(split_name, np.arange(n), max_seq_len)
        offsets = b.seq_offsets.numpy()
        rows = b.seq_actions.numpy()[:, 1].astype(int)
        for k in range(n):
            user = int(np.unique(users)[int(b.user_ids[k])])  # dense index -> raw id (sorted vocabulary)
            target = int(b.timestamps[k])
            assert (target >= cutoff) == (split_name == "eval")
            history = [r for t, _, r, _ in timeline[user] if t < target][-max_seq_len:] if max_seq_len else []
            assert rows[offsets[k] : offsets[k + 1]].tolist() == history
        seen += n
    assert seen == len(kept)
