"""Sparse/dense pipelining: the next batch's host-to-device copy and embedding input all-to-all run while the
current batch computes (what TorchRec's `TrainPipelineSparseDist` does for models it can FX-trace; the gemrec
model builds its lookup batch inside `forward`, examples and history tokens together, so the batch is captured
by running the model's own `embeddings` module up to the sharded lookup instead of by tracing).

    batches ──copy (side stream)──▶ batch i+1 ──input_dist (async all-to-all)──▶ queued on the sharded tables
                                    batch i   ──forward/backward/optimizer──▶ the sharded tables pop their queue

A sharded table whose next call does not match the queued input (a different batch) drops the stale entry and
runs the normal synchronous path, so the pipeline can never change results, only timing.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from gemrec.components.trainer.data import DeviceFeed, TrainingInput, to_model_input
from gemrec.components.trainer.parallel import sharding
from gemrec.model import DLRMModel, GEMModel
from torch import nn

if TYPE_CHECKING:
    from gemrec.components.trainer.parallel.parallelize import Parallelized


def _same_batch(a, b) -> bool:
    """Same keys, lengths and ids (lengths alone repeat across batches of single-valued features)."""
    return (
        list(a.keys()) == list(b.keys())
        and a.lengths().shape == b.lengths().shape
        and a.values().shape == b.values().shape
        and torch.equal(a.lengths(), b.lengths())
        and torch.equal(a.values(), b.values())
    )


class _Captured(Exception):
    def __init__(self, features):
        super().__init__("lookup input captured")
        self.features = features


def gem_lookup_call(model: GEMModel | DLRMModel) -> Callable:
    """How the gemrec models call their `embeddings` module for one `ModelInput` (gem: with the history)."""
    embeddings = model.embeddings

    def call(inp) -> None:
        if isinstance(model, DLRMModel):
            embeddings(inp.sparse_features, batch_size=inp.batch_size)
        else:
            embeddings(inp.sparse_features, inp.seq_item_ids, inp.seq_item_features, batch_size=inp.batch_size)

    return call


class SparseDistPipeline:
    def __init__(self, model: nn.Module, lookup_call: Callable, device: torch.device):
        """`model`: the parallelized model (its sharded tables are found inside); `lookup_call(batch)` runs the
        part of the model's forward that leads to the sharded lookups (see `gem_lookup_call`)."""
        self.tables = sharding.sharded_embedding_modules(model)
        self.lookup_call = lookup_call
        self.device = device
        self.hits = self.misses = 0
        self._capturing = False
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        for table in self.tables:
            table._gemrec_queue = deque()
            table.forward = types.MethodType(self._forward(type(table).forward), table)
            # Runs after the equal-stride padding hook: captures exactly what the lookup would see.
            table.register_forward_pre_hook(self._capture_hook)

    def _capture_hook(self, module, args):
        if self._capturing:
            raise _Captured(args[0])

    def _forward(self, plain_forward):
        pipeline = self

        def forward(table, features):
            queue = table._gemrec_queue
            while queue:
                captured, ctx, pending = queue.popleft()
                if _same_batch(captured, features):
                    pipeline.hits += 1
                    return table.compute_and_output_dist(ctx, pending.wait().wait())
                pending.wait().wait()  # stale: finish its collective so every rank stays in step
            pipeline.misses += 1
            return plain_forward(table, features)

        return forward

    def start(self, batch) -> None:
        """Capture the lookup input of `batch` (already on the device) and start its input all-to-all."""
        if not self.tables:
            return
        self._capturing = True
        try:
            with torch.no_grad():
                self.lookup_call(batch)
        except _Captured as captured:
            features = captured.features
        else:
            raise RuntimeError("the lookup call of the sparse pipeline never reached a sharded table")
        finally:
            self._capturing = False
        table = self.tables[0]
        ctx = table.create_context()
        table._gemrec_queue.append((features, ctx, table.input_dist(ctx, features)))

    def _to_device(self, batch, move: Callable):
        if self._copy_stream is None:
            return move(batch)
        with torch.cuda.stream(self._copy_stream):
            return move(batch)

    def __call__(
        self, batches: Iterable, move: Callable | None = None, lookup_input: Callable = lambda item: item
    ) -> Iterator:
        """Yield the batches moved to the device (`move(item)`, default `item.to(device)`); when batch i is
        yielded, batch i+1 is already moved and its embedding input all-to-all is in flight.
        `lookup_input(moved_item)` is what `lookup_call` takes (the model input inside a larger item)."""
        move = move or (lambda item: item.to(self.device, non_blocking=True))
        iterator = iter(batches)
        try:
            current = self._to_device(next(iterator), move)
        except StopIteration:
            return
        self._wait_copy()
        self.start(lookup_input(current))
        for upcoming in iterator:
            upcoming = self._to_device(upcoming, move)
            self._wait_copy()
            self.start(lookup_input(upcoming))
            yield current
            current = upcoming
        yield current

    def _wait_copy(self) -> None:
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)


def training_inputs(
    parallel: Parallelized | None, stream: Iterable, device: torch.device, depth: int = 2
) -> Generator[TrainingInput, None, None]:
    """The train loop's batches: read from `stream` (with its state after each) in a background thread, pinned and
    copied to the device `depth` ahead by `DeviceFeed`, so the copies overlap the steps before them.

    With sharded tables (`parallel` made them) the next batch's embedding input all-to-all also runs during the
    current step (`SparseDistPipeline`). Either way the stream is read ahead: `state` is the stream's resume state
    right after *this* batch, what a checkpoint taken after training it must hold."""

    def with_state():
        for batch in stream:
            info = getattr(stream, "last_info", None)
            yield batch, (stream.state(), info.build_cpu_s if info is not None else 0.0)

    feed = DeviceFeed(with_state(), device, depth)

    def inputs():
        for host, on_device, (state, build_cpu_s) in feed:
            yield TrainingInput(
                host,
                to_model_input(host),
                to_model_input(on_device),
                on_device.labels,
                state,
                build_cpu_s,
                feed.in_flight,
            )

    model = parallel.module if parallel is not None else None
    tables = sharding.sharded_embedding_modules(model) if model is not None and sharding.has_torchrec() else []
    try:
        if not tables or not isinstance(model, (GEMModel, DLRMModel)):
            yield from inputs()
        else:  # the feed has copied: the pipeline starts each batch's input all-to-all one step ahead
            pipeline = SparseDistPipeline(model, gem_lookup_call(model), device)
            yield from pipeline(inputs(), move=lambda item: item, lookup_input=lambda item: item.device)
    finally:
        feed.close()
