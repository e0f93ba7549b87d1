"""The data service, its client and `Batch` without torchrec (the GPU machine has none): a real server and
client in a process where `import torchrec` fails stream the same batches as with torchrec, and the model
trains on them."""

import json

import torch
from gemrec.components.common.grpc_server import Server, ServerOptions
from gemrec.components.data_service.client import DataClient
from gemrec.components.data_service.dataset import Dataset
from gemrec.components.data_service.service import DataLoaderCore, register
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

STREAM = dict(split="eval", batch_size=96, max_seq_len=64, epoch=0, seed=3, shuffle=True)

SCRIPT = """
    import json
    import sys

    import torch
    from gemrec.components.data_service.client import DataClient
    from gemrec.jagged import JaggedFeatures
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.data_service.service import DataLoaderCore, register
    from gemrec.components.common.grpc_server import Server, ServerOptions
    from gemrec.components.trainer.data import to_model_input
    from gemrec.model import FeatureSchema, ModelConfig, build_model, loss

    dataset_dir, out, stream = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ds = Dataset.open(dataset_dir)
    server = Server(ServerOptions(port=0, max_workers=4), register(DataLoaderCore(ds)))
    model = build_model(ModelConfig(embedding_backend="torch", d_model=16, embedding_dim=8, num_heads=2),
                        FeatureSchema.from_manifest(ds.manifest))
    saved = []
    try:
        for batch in DataClient(f"127.0.0.1:{server.port}", **stream):
            assert isinstance(batch.sparse_features, JaggedFeatures), type(batch.sparse_features)
            inp = to_model_input(batch)  # the trainer's adapter
            assert isinstance(inp.sparse_features, JaggedFeatures) and isinstance(inp.seq_item_features, JaggedFeatures)
            out_ = model(inp)
            loss(out_, batch.labels).backward()
            assert torch.isfinite(out_.logits).all()
            saved.append({
                "tensors": {k: getattr(batch, k).clone() for k in ("user_ids", "seq_offsets", "seq_item_ids")},
                "jagged": {k: (f.keys(), f.values().clone(), f.lengths().clone(), f.stride())
                           for k, f in (("sparse", batch.sparse_features), ("seq", batch.seq_item_features))},
            })
    finally:
        server.stop(0)
    torch.save(saved, out)
"""


def test_data_service_streams_and_trains_without_torchrec(synth_dataset, tmp_path, run_without_torchrec):
    out = tmp_path / "batches.pt"
    run_without_torchrec(SCRIPT, str(synth_dataset), str(out), json.dumps(STREAM))
    without = torch.load(out)

    ds = Dataset.open(synth_dataset)
    server = Server(ServerOptions(port=0, max_workers=4), register(DataLoaderCore(ds)))
    try:
        with_torchrec = list(DataClient(f"127.0.0.1:{server.port}", **STREAM))
    finally:
        server.stop(0)
    assert len(without) == len(with_torchrec) == -(-ds.num_examples("eval") // STREAM["batch_size"])
    for got, want in zip(without, with_torchrec):
        assert isinstance(want.sparse_features, KeyedJaggedTensor)
        for name, tensor in got["tensors"].items():
            torch.testing.assert_close(tensor, getattr(want, name), rtol=0, atol=0)
        for name, kjt in (("sparse", want.sparse_features), ("seq", want.seq_item_features)):
            keys, values, lengths, stride = got["jagged"][name]
            assert keys == kjt.keys() and stride == kjt.stride()
            torch.testing.assert_close(values, kjt.values(), rtol=0, atol=0)
            torch.testing.assert_close(lengths, kjt.lengths(), rtol=0, atol=0)
