"""A feature service restarted on another dataset under a running data service: the stream stops with
FAILED_PRECONDITION naming both checksums; no batch with the other dataset's side features is delivered."""

import json
import shutil

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.data_service.builder import dataset_checksum
from gemrec.components.data_service.client import DataClient
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.service import DataLoaderCore, register
from gemrec.components.feature_service.client import DatasetMismatch, FeatureClient
from gemrec.components.feature_service.service import FeatureServiceCore
from gemrec.components.feature_service.service import register as register_features
from gemrec.components.feature_service.store import MemoryStore

ARGS = dict(split="eval", rank=0, world_size=1, batch_size=256, max_seq_len=20, epoch=0, seed=3)


@pytest.fixture(scope="module")
def other_dataset(movielens_dataset, tmp_path_factory):
    """The same ids and shapes with other item tags (rows shifted by one): another prepared dataset."""
    out = tmp_path_factory.mktemp("other") / "movielens-other"
    shutil.copytree(movielens_dataset, out)
    items = pq.read_table(out / "items.parquet")
    tags = items["item_tags"].combine_chunks()
    shifted = pa.concat_arrays([tags.slice(1), tags.slice(0, 1)])
    pq.write_table(
        items.set_column(items.schema.get_field_index("item_tags"), "item_tags", shifted), out / "items.parquet"
    )
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["dataset_checksum"] = dataset_checksum(out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _feature_server(dataset, port: int) -> Server:
    return Server(ServerOptions(port=port), register_features(FeatureServiceCore(MemoryStore(dataset))))


def test_client_refuses_features_of_another_dataset(movielens_dataset, other_dataset):
    server = _feature_server(other_dataset, 0)
    want = Dataset.open(movielens_dataset).manifest["dataset_checksum"]
    try:
        with FeatureClient(f"127.0.0.1:{server.port}", expect_checksum=want) as client:
            for call in (lambda: client.lookup("item", [1]), lambda: client.user_history([0], [2**31], 5)):
                with pytest.raises(DatasetMismatch, match=want.split(":")[1][:12]) as err:
                    call()
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(0)


def test_stream_stops_when_the_feature_service_switches_datasets(movielens_dataset, other_dataset, free_port):
    ds = Dataset.open(movielens_dataset)
    features_address = f"127.0.0.1:{free_port}"
    feature_server = _feature_server(movielens_dataset, free_port)
    features = FeatureClient(features_address, expect_checksum=ds.manifest["dataset_checksum"])
    data_server = Server(ServerOptions(port=0), register(DataLoaderCore(ds, features, prefetch=1, workers=1)))
    local_server = Server(ServerOptions(port=0), register(DataLoaderCore(ds)))
    try:
        remote = iter(DataClient(f"127.0.0.1:{data_server.port}", **ARGS, prefetch=1, backoff_s=0.05))
        local = iter(DataClient(f"127.0.0.1:{local_server.port}", **ARGS))
        got = next(remote)
        assert torch.equal(got.sparse_features.values(), next(local).sparse_features.values())
        feature_server.stop(0)
        feature_server = _feature_server(other_dataset, free_port)
        with pytest.raises(grpc.RpcError) as err:
            for got in remote:  # batches built before the switch are still right; then the stream stops
                want = next(local)
                assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "another dataset" in err.value.details()
    finally:
        for server in (data_server, local_server, feature_server):
            server.stop(0)
        features.close()
