import json

import numpy as np
import pytest

TOY_ITEMS = 150


def toy_sequences(users: int, seed: int) -> dict[int, list[int]]:
    """Each user walks the catalog: item i is followed by item i + 1 (wrapping), 5 to 14 items long."""
    rng = np.random.default_rng(seed)
    out = {}
    for user in range(1, users + 1):
        start, length = int(rng.integers(TOY_ITEMS)), int(rng.integers(5, 15))
        out[user] = [1 + (start + i) % TOY_ITEMS for i in range(length)]
    return out


@pytest.fixture(scope="module")
def s3rec_toy(tmp_path_factory):
    """`make(users, seed) -> (raw folder with Toy.txt and Toy_item2attributes.json, {user: items})`: made-up
    data in S3-Rec's format (TOY_ITEMS items, attributes i % 5 and i % 3)."""

    def make(users: int = 60, seed: int = 3):
        raw = tmp_path_factory.mktemp("s3rec-raw")
        sequences = toy_sequences(users, seed)
        (raw / "Toy.txt").write_text("".join(f"{u} {' '.join(map(str, s))}\n" for u, s in sequences.items()))
        attributes = {str(i): [1 + i % 5, 6 + i % 3] for i in range(1, TOY_ITEMS + 1)}
        (raw / "Toy_item2attributes.json").write_text(json.dumps(attributes))
        return raw, sequences

    return make


@pytest.fixture(scope="session")
def train_tiny():
    """`train_tiny(dataset, run_dir, tracking_uri, *overrides, resume=False, log_model=False) -> summary`: the `tiny`
    recipe with the overrides (256 eval examples, no local MFU probe) trained in this process; MLflow only when a
    tracking_uri is given."""
    from gemrec.components.trainer.config import load_recipe
    from gemrec.components.trainer.run import run_training

    def train(dataset, run_dir, tracking_uri, *overrides, resume=False, log_model=False):
        return run_training(
            load_recipe("tiny", ["data.eval_max_examples=256", "train.local_mfu=false", *overrides]),
            dataset=dataset,
            data_addr=None,
            run_dir=run_dir,
            tracking_uri=tracking_uri,
            experiment="tiny",
            metrics_out=None,
            resume=resume,
            progress=False,
            log_model=log_model,
            tracking=tracking_uri is not None,
        )

    return train
