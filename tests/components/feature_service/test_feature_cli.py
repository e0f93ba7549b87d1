"""`gemrec serve materialize|features|data` argument handling, in-process."""

import json

import pytest
from gemrec.cli import main
from gemrec.components.feature_service.store import MemoryStore, RedisStore


def test_materialize_then_redis_store_serves(movielens_dataset, redis_url, capsys):
    assert main(["serve", "materialize", "--dataset", str(movielens_dataset), "--redis-url", redis_url]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["fields"] > 0 and report["prefix"].startswith("gemrec:")
    checksum = MemoryStore(movielens_dataset).schema.dataset_checksum
    assert RedisStore(redis_url, checksum).lookup("item", [3], ["item_id"])["item_id"][0].tolist() == [3]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "features", "--dataset", "{empty}"], "not a dataset directory"),
        (["serve", "features", "--dataset", "{ml}", "--tls-cert", "x.pem"], "--tls-cert and --tls-key go together"),
        (["serve", "features", "--dataset", "{ml}", "--tls-cert", "x.pem", "--tls-key", "y.pem"], "TLS file not found"),
        (["serve", "features", "--dataset", "{ml}", "--port", "70000"], "--port must be in"),
        (
            ["serve", "features", "--dataset", "{ml}", "--store", "redis", "--redis-url", "redis://127.0.0.1:1/0"],
            "cannot use redis",
        ),
        (["serve", "data", "--dataset", "{empty}"], "not a complete dataset"),
        (
            ["serve", "data", "--dataset", "{ml}", "--features", "127.0.0.1:1", "--features-timeout-s", "0.5"],
            "is not reachable",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(movielens_dataset, tmp_path, capsys, argv, message):
    argv = [a.format(empty=tmp_path, ml=movielens_dataset) for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
