"""ParallelDims/ParallelConfig validation and the pure helpers of the parallel package (no process group)."""

import pytest
import torch
from gemrec.components.trainer.parallel import ParallelConfig, ParallelConfigError, ParallelDims
from gemrec.components.trainer.parallel.balance import (
    communication_breakdown,
    is_communication,
    uncovered_length,
    union_length,
)
from gemrec.components.trainer.parallel.expert_parallel import source_major_to_expert_major
from gemrec.components.trainer.parallel.parallelize import fsdp_blocks
from gemrec.config import ConfigError
from torch import nn


@pytest.mark.parametrize(
    "world, kwargs, shape",
    [
        (2, {}, (1, 2, 1, 2)),
        (2, {"dp_replicate": 2}, (2, 1, 1, 2)),
        (4, {"dp_replicate": 2}, (2, 2, 1, 4)),
        (4, {"ep": 2}, (1, 4, 2, 4)),
        (8, {"dp_replicate": 2, "ep": 4, "sparse_shard": 4}, (2, 4, 4, 4)),
    ],
)
def test_shapes(world, kwargs, shape):
    dims = ParallelDims(world, **kwargs)
    assert (dims.dp_replicate, dims.dp_shard, dims.ep, dims.sparse_shard) == shape
    assert dims.dp_shard_mod_ep * dims.ep == dims.dp_shard
    assert dims.sparse_replicate * dims.sparse_shard == world
    assert dims.sparse_2d == (dims.sparse_shard < world)


@pytest.mark.parametrize(
    "world, kwargs, message",
    [
        (4, {"dp_replicate": 3}, "4 / 3 is not an integer (4 % 3 = 1)"),
        (4, {"dp_replicate": 2, "dp_shard": 3}, "dp_replicate x dp_shard = 2 x 3 = 6, but the world size is 4"),
        (4, {"ep": 3}, "ep (3) borrows ranks from dp_shard (4) and must divide it: 4 % 3 = 1"),
        (4, {"sparse_shard": 3}, "sparse_shard (3) to divide the world size (4): 4 % 3 = 1"),
        (4, {"ep": 0}, "ep must be >= 1, got 0"),
        (0, {}, "world size must be >= 1"),
    ],
)
def test_invalid_layouts_show_the_arithmetic(world, kwargs, message):
    with pytest.raises(ParallelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(world, **kwargs)


def test_config_validation():
    ParallelConfig(sharding_types=["row_wise", "table_wise"], param_dtype="bfloat16")
    for bad, message in [
        ({"activation_checkpoint": "some"}, "parallel.activation_checkpoint = 'some': must be one of 'none', 'full'"),
        ({"sharding_types": ["diagonal"]}, r"parallel.sharding_types = \['diagonal'\]: must be a list of values in"),
        ({"param_dtype": "float7"}, "parallel.param_dtype = 'float7': must be one of 'bfloat16'"),
        ({"dmp_sync_interval": 0}, "parallel.dmp_sync_interval = 0: must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig(**bad)


def test_from_config_resolves_auto():
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, ep=2), world_size=8)
    assert (dims.dp_shard, dims.dp_shard_mod_ep, dims.sparse_shard) == (4, 2, 8)
    assert "world 8 = dp_replicate 2 x dp_shard 4" in dims.describe()


def test_source_major_to_expert_major():
    # 2 sources x 3 experts; rows labelled (source, expert, index).
    blocks = torch.tensor([[2, 0, 1], [1, 3, 0]])
    rows = [(s, e, i) for s in range(2) for e in range(3) for i in range(int(blocks[s, e]))]
    order = source_major_to_expert_major(blocks).tolist()
    regrouped = [rows[i] for i in order]
    assert regrouped == sorted(rows, key=lambda r: (r[1], r[0], r[2]))


def test_interval_arithmetic():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert uncovered_length([(0, 4)], [(1, 2), (3, 5)]) == 2  # [0,1) and [2,3)
    assert uncovered_length([(0, 1)], []) == 1
    assert uncovered_length([], [(0, 1)]) == 0
    assert is_communication("ncclDevKernel_AllGather_RING_LL") and is_communication("c10d::allreduce_")
    assert not is_communication("aten::mm")


def test_fsdp_blocks_are_the_outermost_module_list_elements():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(3, 4)
            self.tower = nn.ModuleList(
                [nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])), nn.Identity(), nn.Linear(4, 4)]
            )
            self.head = nn.Module()
            self.head.towers = nn.ModuleList([nn.Linear(4, 1)])

    net = Net()
    names = [name for name, _ in fsdp_blocks(net)]
    assert names == ["tower.0", "tower.2", "head.towers.0"]  # Identity has no parameters; nested lists stay inside
    assert [name for name, _ in fsdp_blocks(net, skip={id(net.head)})] == ["tower.0", "tower.2"]


def test_training_inputs_carry_the_stream_state_after_each_batch(movielens_dataset):
    """The train loop checkpoints this state, not the stream's own, which may be read ahead."""
    from gemrec.components.data_service.dataset import Dataset
    from gemrec.components.trainer.data import DatasetStream
    from gemrec.components.trainer.parallel.pipeline import training_inputs

    stream = DatasetStream(Dataset.open(movielens_dataset), batch_size=8, max_seq_len=16, seed=0, prefetch=0)
    inputs = training_inputs(None, stream, torch.device("cpu"), depth=2)
    items = [next(inputs) for _ in range(3)]
    assert [item.state["position"] for item in items] == [1, 2, 3]
    first = items[0]
    assert first.batch.batch_size == first.host.batch_size == first.device.batch_size == 8
    assert torch.equal(first.host.seq_item_ids, first.batch.seq_item_ids) and first.build_cpu_s == 0.0
    inputs.close()


def test_recipe_parallel_table_is_checked():
    assert ParallelConfig.from_dict({"dp_replicate": 2, "ep": 2}).ep == 2
    assert ParallelConfig.from_dict({"param_dtype": ""}).param_dtype is None  # TOML has no null
    with pytest.raises(ConfigError, match=r"unknown setting parallel.dp_shards = 2; \[parallel\] takes .*dp_shard"):
        ParallelConfig.from_dict({"dp_shards": 2})


def test_communication_breakdown_names_the_exposed_collectives():
    from types import SimpleNamespace

    def kernel(name, start_us, end_us):
        return SimpleNamespace(
            name=name,
            device_type=torch.autograd.DeviceType.CUDA,
            time_range=SimpleNamespace(start=start_us, end=end_us),
        )

    events = [
        kernel("gemm", 0, 1000),
        kernel("ncclDevKernel_AllGather", 500, 1200),
        kernel("gemm", 1100, 2000),
        kernel("ncclDevKernel_AllReduce", 2000, 5000),
        kernel("ncclDevKernel_AllGather", 1500, 1900),
    ]
    result = communication_breakdown(events)
    by_name = {r["name"]: r for r in result["by_name"]}
    assert by_name["ncclDevKernel_AllGather"]["count"] == 2
    assert by_name["ncclDevKernel_AllGather"]["exposed_ms"] == pytest.approx(0.1)  # 1000..1100
    assert by_name["ncclDevKernel_AllReduce"]["exposed_ms"] == pytest.approx(3.0)
    assert result["by_name"][0]["name"] == "ncclDevKernel_AllReduce"
    assert result["most_exposed"][0] == {
        "name": "ncclDevKernel_AllReduce",
        "start_ms": pytest.approx(2.0),
        "ms": pytest.approx(3.0),
        "exposed_ms": pytest.approx(3.0),
    }
