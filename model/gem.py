"""The two architectures: `gem` (sequence + non-sequence towers, PMA, MoE interaction) and `dlrm`.

gem, per batch of B examples with T history tokens in total:

    embeddings      one sparse lookup: example features (B, F, E) and history tokens (T, 1 + S, E)
    seq_input       token = proj(item + side-feature embeddings) + action encoding + time-since-target
    seq_tower       N pre-norm layers of jagged self-attention (softmax or SiLU, causal or not, full, windowed or
                    block-local, rotary fused into the kernels or separate) + MLP
    pma             K learned seeds attend over each sequence -> (B, K, d) summary tokens
    feature_input   one token per sparse feature plus one for the dense features -> (B, F', d)
    nonseq_tower    self-attention among feature tokens, cross-attention from them into the sequence, MLP
    interaction     layers over [feature tokens, summaries]; every `moe_every`-th FFN is a mixture of experts
    heads           shared trunk over the flattened tokens, one small tower and logit per task

dlrm: embeddings + bottom MLP for dense features, pairwise dot interaction, top MLP, the same heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import assert_never, cast

import torch
import torch.nn.functional as F
from gemrec.kernels import KernelOptions
from gemrec.model.config import FeatureSchema, ModelConfig
from gemrec.model.embeddings import SparseEmbeddings
from gemrec.model.inputs import ModelInput, ModelOutput
from gemrec.model.layers import (
    PMA,
    FewRowsEmbedding,
    Jagged,
    JaggedAttention,
    Rotary,
    SeqLayer,
    TokenLayer,
    add,
    linear_flops,
)
from gemrec.model.moe import MoEFeedForward
from torch import nn


def _check_input(inp: ModelInput, schema: FeatureSchema, with_sequence: bool) -> None:
    batch = inp.batch_size
    if inp.dense_features.dim() != 2 or tuple(inp.dense_features.shape) != (batch, schema.num_dense):
        raise ValueError(
            f"dense_features must be ({batch}, {schema.num_dense}) for dense features "
            f"{list(schema.dense_features)}, got {tuple(inp.dense_features.shape)}"
        )
    if inp.sparse_features.stride() != batch:
        raise ValueError(f"sparse_features has stride {inp.sparse_features.stride()}, expected batch size {batch}")
    if not with_sequence:
        return
    tokens, histories = inp.num_tokens, inp.num_histories
    if inp.history_index is None and histories != batch:
        raise ValueError(f"seq_offsets must be ({batch + 1},), got {tuple(inp.seq_offsets.shape)}")
    if inp.history_index is not None:
        if tuple(inp.history_index.shape) != (batch,):
            raise ValueError(f"history_index must be ({batch},), got {tuple(inp.history_index.shape)}")
        index = inp.history_index
        if index.device.type == "cpu" and batch and (int(index.min()) < 0 or int(index.max()) >= histories):
            raise ValueError(f"history_index must be in [0, {histories}) (the histories of seq_offsets)")
    if tuple(inp.seq_timestamps.shape) != (tokens,):
        raise ValueError(f"seq_timestamps must be ({tokens},) like seq_item_ids, got {tuple(inp.seq_timestamps.shape)}")
    if inp.seq_actions.dim() != 2 or tuple(inp.seq_actions.shape) != (tokens, schema.num_actions):
        raise ValueError(
            f"seq_actions must be ({tokens}, {schema.num_actions}) for actions {list(schema.actions)}, "
            f"got {tuple(inp.seq_actions.shape)}"
        )
    if inp.seq_offsets.device.type == "cpu":  # cheap there; on an accelerator it would cost a host sync
        lengths = inp.seq_lengths()
        if int(inp.seq_offsets[0]) != 0 or int(inp.seq_offsets[-1]) != tokens or bool((lengths < 0).any()):
            raise ValueError(
                f"seq_offsets must rise from 0 to the {tokens} history tokens, got {inp.seq_offsets.tolist()}"
            )
        if batch and int(lengths.max()) > inp.max_seq_len:
            raise ValueError(f"max_seq_len {inp.max_seq_len} is below the longest history ({int(lengths.max())})")


class TaskHeads(nn.Module):
    """Shared trunk, then one tower and one logit per task, plus the task's logit offset: a buffer (0 in training)
    that the trainer fits on the valid split once training ends (`Trainer.calibrate`), so the exported model and
    whatever serves it predict calibrated probabilities."""

    # buffers (registered in __init__)
    logit_offset: torch.Tensor  # (num_tasks,)

    def __init__(self, in_dim: int, hidden: int, labels: tuple[str, ...], parents: Mapping[str, str] | None = None):
        super().__init__()
        num_tasks = len(labels)
        self.register_buffer("logit_offset", torch.zeros(num_tasks))
        self.chain = _task_chain(labels, parents or {})
        self.trunk = nn.Linear(in_dim, hidden)
        tower = max(hidden // 2, 1)
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, tower), nn.GELU(), nn.Linear(tower, 1)) for _ in range(num_tasks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.trunk(x))
        logits = torch.cat([tower(h) for tower in self.towers], dim=1)
        if self.chain:
            logits = _chained_logits(logits.float(), self.chain).to(h.dtype)
        return logits + self.logit_offset.to(h.dtype)

    def flops(self, batch: int) -> tuple[int, int]:
        parts = [linear_flops(batch, self.trunk.in_features, self.trunk.out_features)]
        for tower in self.towers:
            linears = [m for m in cast(nn.Sequential, tower) if isinstance(m, nn.Linear)]
            parts += [linear_flops(batch, m.in_features, m.out_features) for m in linears]
        return add(*parts)


def _task_chain(labels: tuple[str, ...], parents: Mapping[str, str]) -> list[tuple[int, int | None]]:
    """(task, parent task or None) of every task, parents before their children; [] when no task has a parent."""
    if not parents:
        return []
    for child, parent in parents.items():
        for role, name in (("label", child), ("parent", parent)):
            if name not in labels:
                raise ValueError(
                    f"model.task_parents: {role} {name!r} ({child} -> {parent}) is not one of the dataset's labels "
                    f"({', '.join(labels)}); name this dataset's labels or set model.task_parents = {{}}"
                )
    order: list[tuple[int, int | None]] = []
    placed: set[str] = set()
    while len(order) < len(labels):
        ready = [n for n in labels if n not in placed and (n not in parents or parents[n] in placed)]
        if not ready:
            cycle = ", ".join(f"{c} -> {p}" for c, p in parents.items() if c not in placed)
            raise ValueError(f"model.task_parents has a cycle: {cycle}")
        for name in ready:
            placed.add(name)
            order.append((labels.index(name), labels.index(parents[name]) if name in parents else None))
    return order


def _chained_logits(raw: torch.Tensor, chain: list[tuple[int, int | None]]) -> torch.Tensor:
    """Logits of p_task = sigmoid(raw_task) * p_parent along `chain` (fp32 in, fp32 out)."""
    log_p: list[torch.Tensor | None] = [None] * raw.shape[1]
    out = list(raw.unbind(1))
    for task, parent in chain:
        own = F.logsigmoid(raw[:, task])
        if parent is None:
            log_p[task] = own
            continue
        parent_log_p = log_p[parent]
        assert parent_log_p is not None  # _task_chain puts parents first
        joint = (own + parent_log_p).clamp(max=-1e-7)
        log_p[task] = joint
        out[task] = joint - torch.log(-torch.expm1(joint))  # log p - log(1 - p)
    return torch.stack(out, dim=1)


class CrossNetwork(nn.Module):
    """DCN-v2 cross layers of low rank (Wang et al. 2021): x_(l+1) = x_0 * (U_l V_l x_l + b_l) + x_l, each layer one
    more degree of explicit multiplicative feature crossing beside the MLPs' implicit one."""

    def __init__(self, dim: int, layers: int, rank: int):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(dim, rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(rank, dim) for _ in range(layers))
        for _, up in self.layers():
            nn.init.zeros_(up.weight)  # starts as a rescaling, x_(l+1) = x_0 * b_l + x_l (b_l drawn as nn.Linear's)

    def layers(self) -> list[tuple[nn.Linear, nn.Linear]]:
        """(V_l, U_l) of every layer."""
        return list(zip(cast(list[nn.Linear], self.down), cast(list[nn.Linear], self.up)))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in self.layers():
            x = x0 * up(down(x)) + x
        return x

    def flops(self, batch: int) -> tuple[int, int]:
        return add(*[linear_flops(batch, m.in_features, m.out_features) for pair in self.layers() for m in pair])


class TimeEncoding(nn.Module):
    """Encodes seconds between a history event and the target event (log buckets or continuous)."""

    # buffers (registered in __init__)
    freqs: torch.Tensor

    def __init__(self, kind: str, dim: int, buckets: int):
        super().__init__()
        self.kind = kind
        if kind == "log_bucket":
            self.buckets = buckets
            self.table = FewRowsEmbedding(buckets, dim)
            nn.init.normal_(self.table.weight, std=0.02)
        else:
            self.register_buffer("freqs", torch.exp(torch.linspace(0.0, math.log(64.0), dim // 2)), persistent=False)
            self.proj = nn.Linear(2 * (dim // 2), dim)

    def forward(self, seconds: torch.Tensor) -> torch.Tensor:
        log_dt = torch.log1p(seconds.clamp(min=0).float())
        if self.kind == "log_bucket":
            # Half-octave buckets: bucket b covers dt in [2^(b/2) - 1, 2^((b+1)/2) - 1) seconds.
            bucket = (2.0 * log_dt / math.log(2.0)).long().clamp(max=self.buckets - 1)
            return self.table(bucket)
        angles = (log_dt / 25.0)[:, None] * self.freqs
        return self.proj(torch.cat([angles.sin(), angles.cos()], dim=-1))

    def flops(self, tokens: int) -> tuple[int, int]:
        if self.kind == "log_bucket":
            return self.table.flops(tokens)
        return linear_flops(tokens, self.proj.in_features, self.proj.out_features, input_grad=False)


def recency_bucket(events_before_target: torch.Tensor, buckets: int) -> torch.Tensor:
    """Exact for the 16 most recent events, then quarter-octaves: 16 + floor(4 * log2(n / 16))."""
    n = events_before_target.clamp(min=0)
    far = 16 + (4 * torch.log2(n.clamp(min=16).float() / 16)).long()
    return torch.where(n < 16, n, far).clamp(max=buckets - 1)


class SeqInput(nn.Module):
    """History token vectors: item and side-feature embeddings, action, time and recency encodings.

    Time is seconds before the target event; recency is the token's rank from the end of its history
    (0 = the most recent event), so "the last k events" is visible to attention from outside the sequence.
    With `target_aware`, each token also gets Linear(token embeddings * target item embeddings), the
    element-wise products with the same tables' embeddings of the example's target item (DIN-style):
    "same item / same category as the target" becomes a linear read-out for every layer above.
    """

    def __init__(self, schema: FeatureSchema, config: ModelConfig):
        super().__init__()
        width = (1 + len(schema.seq_item_features)) * config.embedding_dim
        self.token_proj = nn.Linear(width, config.d_model)
        self.target_proj = nn.Linear(width, config.d_model, bias=False) if config.target_aware else None
        self.action_proj = nn.Linear(schema.num_actions, config.d_model, bias=False) if schema.num_actions else None
        self.time = TimeEncoding(config.time_encoding, config.d_model, config.num_time_buckets)
        self.recency = FewRowsEmbedding(config.recency_buckets, config.d_model) if config.recency_buckets else None
        if self.recency is not None:
            nn.init.normal_(self.recency.weight, std=0.02)

    def forward(self, token_emb, seq_actions, seconds_before_target, events_before_target, target_emb=None):
        """token_emb, target_emb: (T, 1 + num_seq_features, dim); target_emb is the token's example's target
        (None for a history without a target: retrieval)."""
        x = self.token_proj(token_emb.flatten(1))
        if self.target_proj is not None and target_emb is not None:
            x = x + self.target_proj((token_emb * target_emb).flatten(1))
        if self.action_proj is not None:
            x = x + self.action_proj(seq_actions.to(x.dtype))
        if self.recency is not None:
            x = x + self.recency(recency_bucket(events_before_target, self.recency.num_embeddings))
        return x + self.time(seconds_before_target)

    def flops(self, tokens: int) -> tuple[int, int]:
        parts = [
            linear_flops(tokens, self.token_proj.in_features, self.token_proj.out_features),
            self.time.flops(tokens),
        ]
        if self.recency is not None:
            parts.append(self.recency.flops(tokens))
        if self.target_proj is not None:
            parts.append(linear_flops(tokens, self.target_proj.in_features, self.target_proj.out_features))
        if self.action_proj is not None:
            parts.append(linear_flops(tokens, self.action_proj.in_features, self.action_proj.out_features, False))
        return add(*parts)


class PiecewiseLinearTokens(nn.Module):
    """One token per dense feature: its piecewise-linear encoding over the feature's quantile bins, then a linear map
    of its own (Gorishniy et al. 2022, "On Embeddings for Numerical Features in Tabular Deep Learning").

    With edges e_0 < ... < e_n, component t of the encoding is (x - e_t) / (e_(t+1) - e_t) clipped to [0, 1]; the
    first is not clipped below and the last not above, so values outside the train range extrapolate linearly. The
    token sum_t enc_t W_t + b is a learned piecewise-linear curve in R^d with a knot at every edge.
    """

    # buffers (registered in __init__), (F, bins) each
    left: torch.Tensor
    inv_span: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    used: torch.Tensor

    def __init__(self, bins: tuple[tuple[float, ...], ...], dim: int):
        super().__init__()
        num, width = len(bins), max(len(edges) - 1 for edges in bins)
        left = torch.zeros(num, width, dtype=torch.float64)
        span = torch.ones(num, width, dtype=torch.float64)
        low, high = torch.zeros(num, width), torch.ones(num, width)
        used = torch.zeros(num, width)
        for f, edges in enumerate(bins):
            e = torch.tensor(edges, dtype=torch.float64)
            n = len(edges) - 1
            left[f, :n], span[f, :n], used[f, :n] = e[:-1], e[1:] - e[:-1], 1.0
            low[f, 0], high[f, n - 1] = -math.inf, math.inf
        self.register_buffer("left", left.float())
        self.register_buffer("inv_span", (1.0 / span).float())
        self.register_buffer("low", low)
        self.register_buffer("high", high)
        self.register_buffer("used", used)
        self.weight = nn.Parameter(torch.randn(num, width, dim) * width**-0.5)
        self.bias = nn.Parameter(torch.zeros(num, dim))

    def encode(self, dense: torch.Tensor) -> torch.Tensor:
        """(B, F) -> (B, F, bins): the piecewise-linear encoding, zero in the bins a feature does not have."""
        enc = (dense.float().unsqueeze(-1) - self.left) * self.inv_span
        return torch.maximum(torch.minimum(enc, self.high), self.low) * self.used

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        """(B, F) -> (B, F, dim)."""
        return torch.einsum("bft,ftd->bfd", self.encode(dense).to(self.weight.dtype), self.weight) + self.bias

    def flops(self, batch: int) -> tuple[int, int]:
        num, width, dim = self.weight.shape
        return linear_flops(batch * num, width, dim, input_grad=False)


class FeatureTokens(nn.Module):
    """One d_model token per sparse feature (a projection per feature), then the dense features: one token through a
    linear map of all of them (`dense_encoding = "linear"`) or one token per feature (`"ple"`)."""

    def __init__(self, schema: FeatureSchema, config: ModelConfig):
        super().__init__()
        num, emb, d = len(schema.sparse_features), config.embedding_dim, config.d_model
        self.weight = nn.Parameter(torch.empty(num, emb, d))
        self.bias = nn.Parameter(torch.zeros(num, d))
        nn.init.normal_(self.weight, std=emb**-0.5)
        self.dense_proj = self.dense_ple = None
        if schema.num_dense and config.dense_encoding == "ple":
            if not schema.dense_bins:
                raise ValueError(
                    "model.dense_encoding = 'ple' needs the dataset's quantile bins of its dense features "
                    "(manifest dense_bins): prepare the dataset again with this version of gemrec"
                )
            self.dense_ple = PiecewiseLinearTokens(schema.dense_bins, d)
        elif schema.num_dense:
            self.dense_proj = nn.Linear(schema.num_dense, d)
        dense_tokens = schema.num_dense if self.dense_ple is not None else min(schema.num_dense, 1)
        self.num_tokens = num + dense_tokens

    def forward(self, example_emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        tokens = torch.einsum("bfe,fed->bfd", example_emb, self.weight.to(example_emb.dtype)) + self.bias
        if self.dense_proj is not None:
            tokens = torch.cat([tokens, self.dense_proj(dense.to(tokens.dtype)).unsqueeze(1)], dim=1)
        if self.dense_ple is not None:
            tokens = torch.cat([tokens, self.dense_ple(dense).to(tokens.dtype)], dim=1)
        return tokens

    def flops(self, batch: int) -> tuple[int, int]:
        num, emb, d = self.weight.shape
        parts = [linear_flops(batch * num, emb, d)]
        if self.dense_proj is not None:
            parts.append(linear_flops(batch, self.dense_proj.in_features, d, input_grad=False))
        if self.dense_ple is not None:
            parts.append(self.dense_ple.flops(batch))
        return add(*parts)


class GEMModel(nn.Module):
    def __init__(self, config: ModelConfig, schema: FeatureSchema, kernel_options: KernelOptions | None = None):
        super().__init__()
        self.config, self.schema = config, schema
        d, heads = config.d_model, config.num_heads
        hidden = int(config.mlp_ratio * d)
        self.embeddings = SparseEmbeddings(schema, config)
        self.seq_input = SeqInput(schema, config)
        separate, (window, block) = config.rope == "separate", config.seq_mask
        self.rotary = Rotary(d // heads, config.rotary_base, config.rotary_max_positions) if separate else None
        self.seq_dropout = nn.Dropout(config.dropout)
        self.seq_tower = nn.ModuleList(
            SeqLayer(
                d,
                heads,
                hidden,
                config.seq_attention,
                config.seq_causal,
                config.dropout,
                window=window,
                block=block,
                rope_base=config.fused_rope_base,
            )
            for _ in range(config.seq_layers)
        )
        self.seq_norm = nn.LayerNorm(d)
        self.pma = PMA(d, heads, hidden, config.pma_seeds, config.seq_attention, config.init_std)
        self.feature_input = FeatureTokens(schema, config)
        self.nonseq_tower = nn.ModuleList(
            TokenLayer(d, heads, hidden, cross=True, kind="softmax", moe=None) for _ in range(config.nonseq_layers)
        )
        self.interaction = nn.ModuleList(
            TokenLayer(d, heads, hidden, cross=False, kind="softmax", moe=self._moe(i))
            for i in range(config.interaction_layers)
        )
        self.num_tokens = self.feature_input.num_tokens + config.pma_seeds
        self.final_norm = nn.LayerNorm(d)
        self.cross = None
        if config.head_cross_layers:
            self.cross = CrossNetwork(self.num_tokens * d, config.head_cross_layers, config.head_cross_rank)
        self.heads = TaskHeads(self.num_tokens * d, config.head_hidden, schema.labels, config.task_parents)
        for module in self.modules():
            if isinstance(module, JaggedAttention):
                module.backend, module.kernel_options = config.attention_backend, kernel_options

    def _moe(self, layer: int) -> MoEFeedForward | None:
        c = self.config
        if not c.moe_every or (layer + 1) % c.moe_every:
            return None
        return MoEFeedForward(c.d_model, c.moe_hidden, c.moe_num_experts, c.moe_top_k, c.init_std)

    def _token_example(self, inp: ModelInput) -> torch.Tensor:
        """The history (= example, unless examples share histories) of every history token, (T,)."""
        histories = torch.arange(inp.num_histories, device=inp.seq_offsets.device)
        return torch.repeat_interleave(histories, inp.seq_lengths(), output_size=inp.num_tokens)

    @staticmethod
    def _history_timestamps(inp: ModelInput) -> torch.Tensor:
        """The target time of every history: its examples' (candidates of one request share it; latest wins)."""
        if inp.history_index is None:
            return inp.timestamps
        out = inp.timestamps.new_zeros(inp.num_histories)
        return out.scatter_reduce(0, inp.history_index, inp.timestamps, "amax", include_self=False)

    @staticmethod
    def _per_example(seq: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor):
        """The token rows of history index[i] for every example i: (rows of seq, offsets (B+1,))."""
        lengths = (offsets[1:] - offsets[:-1])[index]
        out_offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        total = int(out_offsets[-1])
        shift = torch.repeat_interleave(offsets[:-1][index] - out_offsets[:-1], lengths, output_size=total)
        return seq.index_select(0, shift + torch.arange(total, device=seq.device)), out_offsets

    def _sequence(self, inp: ModelInput, token_emb, token_example, target_emb) -> torch.Tensor:
        """The sequence tower's output per history token, (T, d_model)."""
        offsets, max_len, tokens = inp.seq_offsets, inp.max_seq_len, inp.num_tokens
        device = offsets.device
        positions = torch.arange(tokens, device=device) - offsets[token_example]
        rope = self.rotary(positions, max_len) if self.rotary is not None else None
        from_end = offsets[1:][token_example] - 1 - torch.arange(tokens, device=device)
        seconds = self._history_timestamps(inp)[token_example] - inp.seq_timestamps
        seq = self.seq_dropout(self.seq_input(token_emb, inp.seq_actions, seconds, from_end, target_emb))
        for layer in self.seq_tower:
            seq = layer(seq, offsets, max_len, rope)
        return self.seq_norm(seq)

    def sequence_vectors(self, inp: ModelInput) -> torch.Tensor:
        """Retrieval: the sequence tower's output at every history token, (T, d_model), from the history alone.

        With a causal tower token t sees tokens <= t only, so it can be trained to predict token t + 1 and the
        last token of a history is the user vector; score items with `item_vectors`. There is no target item, so
        the target-aware term of the tokens is left out; the non-sequence features are not read.
        """
        _check_input(inp, self.schema, with_sequence=True)
        token_emb = self.embeddings.tokens(inp.seq_item_ids, inp.seq_item_features)
        return self._sequence(inp, token_emb, self._token_example(inp), None)

    def item_vectors(self, item_ids: torch.Tensor, item_features=None) -> torch.Tensor:
        """Retrieval: items as the vectors `sequence_vectors` is scored against, (N, d_model): the projection
        history tokens get of their item and side-feature embeddings (input and output items tied, as SASRec).
        `item_features`: the schema's `seq_item_features` of these items, stride N."""
        return self.seq_input.token_proj(self.embeddings.tokens(item_ids, item_features).flatten(1))

    def forward(self, inp: ModelInput) -> ModelOutput:
        _check_input(inp, self.schema, with_sequence=True)
        batch = inp.batch_size
        offsets, max_len = inp.seq_offsets, inp.max_seq_len
        device = offsets.device
        shared = inp.history_index is not None
        if shared and self.seq_input.target_proj is not None:
            raise ValueError(
                "examples sharing a history (history_index) need model.target_aware=false: "
                "target-aware history tokens differ per example"
            )
        example_emb, token_emb = self.embeddings(
            inp.sparse_features, inp.seq_item_ids, inp.seq_item_features, batch_size=batch
        )
        token_example = self._token_example(inp)
        target_emb = None
        if self.seq_input.target_proj is not None:
            target_emb = example_emb.index_select(1, self.embeddings.token_columns).index_select(0, token_example)
        seq = self._sequence(inp, token_emb, token_example, target_emb)
        summaries = self.pma(seq, offsets, max_len, inp.num_histories)
        if inp.history_index is not None:  # towers ran once per history: each candidate reads its history's tokens
            summaries = summaries.index_select(0, inp.history_index)
            seq, offsets = self._per_example(seq, offsets, inp.history_index)
        x = self.feature_input(example_emb, inp.dense_features)
        for layer in self.nonseq_tower:
            x, _ = layer(x, seq, offsets, max_len)
        z = torch.cat([x, summaries.to(x.dtype)], dim=1)
        aux = torch.zeros((), device=device)
        for layer in self.interaction:
            z, layer_aux = layer(z)
            if layer_aux is not None:
                aux = aux + self.config.moe_aux_loss_weight * layer_aux
        flat = self.final_norm(z).flatten(1)
        logits = self.heads(self.cross(flat) if self.cross is not None else flat)
        return ModelOutput(logits=logits.float(), aux_loss=aux)

    def flops(self, inp: ModelInput) -> dict[str, tuple[int, int]]:
        batch = inp.batch_size
        seq = Jagged(inp.seq_lengths().tolist())  # per history
        lengths = inp.seq_lengths() if inp.history_index is None else inp.seq_lengths()[inp.history_index]
        example_seq = Jagged(lengths.tolist())  # per example
        counts = {"seq_input": self.seq_input.flops(seq.tokens)}
        # (a ModuleList types its items as Module: cast to the layers it was built with)
        for i, layer in enumerate(cast(list[SeqLayer], self.seq_tower)):
            counts[f"seq_tower.{i}"] = layer.flops(seq)
        counts["pma"] = self.pma.flops(seq)
        counts["feature_input"] = self.feature_input.flops(batch)
        for i, token_layer in enumerate(cast(list[TokenLayer], self.nonseq_tower)):
            counts[f"nonseq_tower.{i}"] = token_layer.flops(batch, self.feature_input.num_tokens, example_seq)
        for i, token_layer in enumerate(cast(list[TokenLayer], self.interaction)):
            counts[f"interaction.{i}"] = token_layer.flops(batch, self.num_tokens, None)
        if self.cross is not None:
            counts["cross"] = self.cross.flops(batch)
        counts["heads"] = self.heads.flops(batch)
        return counts


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers)


def _mlp_flops(mlp: nn.Sequential, rows: int, input_grad: bool) -> tuple[int, int]:
    linears = [m for m in mlp if isinstance(m, nn.Linear)]
    return add(*[linear_flops(rows, m.in_features, m.out_features, input_grad or i > 0) for i, m in enumerate(linears)])


class DotInteraction(nn.Module):
    """Pairwise dot products of the feature vectors (upper triangle), concatenated with the vectors."""

    # buffers (registered in __init__)
    pair_rows: torch.Tensor
    pair_cols: torch.Tensor

    def __init__(self, num_vectors: int):
        super().__init__()
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.num_vectors = num_vectors
        self.num_pairs = rows.numel()

    def forward(self, vectors: torch.Tensor) -> torch.Tensor:
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return torch.cat([dots, vectors.flatten(1)], dim=1)

    def flops(self, batch: int, dim: int) -> tuple[int, int]:
        n = self.num_vectors
        dot = 2 * batch * n * n * dim
        return dot, 2 * dot


class DLRMModel(nn.Module):
    """DLRM baseline: embeddings, bottom MLP on dense features, pairwise dot interaction, top MLP."""

    def __init__(self, config: ModelConfig, schema: FeatureSchema):
        super().__init__()
        self.config, self.schema = config, schema
        emb = config.embedding_dim
        self.embeddings = SparseEmbeddings(schema, config)
        self.bottom_mlp = _mlp([schema.num_dense, *config.dlrm_bottom_mlp, emb]) if schema.num_dense else None
        self.num_vectors = len(schema.sparse_features) + (1 if schema.num_dense else 0)
        n = self.num_vectors
        self.interaction = DotInteraction(n)
        top_in = n * (n - 1) // 2 + n * emb
        self.top_mlp = _mlp([top_in, *config.dlrm_top_mlp])
        self.heads = TaskHeads(
            config.dlrm_top_mlp[-1] if config.dlrm_top_mlp else top_in,
            config.head_hidden,
            schema.labels,
            config.task_parents,
        )

    def forward(self, inp: ModelInput) -> ModelOutput:
        _check_input(inp, self.schema, with_sequence=False)
        vectors, _ = self.embeddings(inp.sparse_features, batch_size=inp.batch_size)
        if self.bottom_mlp is not None:
            dense = self.bottom_mlp(inp.dense_features.to(vectors.dtype))
            vectors = torch.cat([dense.unsqueeze(1), vectors], dim=1)
        top = self.top_mlp(self.interaction(vectors))
        logits = self.heads(top)
        return ModelOutput(logits=logits.float(), aux_loss=torch.zeros((), device=logits.device))

    def flops(self, inp: ModelInput) -> dict[str, tuple[int, int]]:
        batch, emb = inp.batch_size, self.config.embedding_dim
        counts = {}
        if self.bottom_mlp is not None:
            counts["bottom_mlp"] = _mlp_flops(self.bottom_mlp, batch, input_grad=False)
        counts["interaction"] = self.interaction.flops(batch, emb)
        counts["top_mlp"] = _mlp_flops(self.top_mlp, batch, input_grad=True)
        counts["heads"] = self.heads.flops(batch)
        return counts


def build_model(config: ModelConfig, schema: FeatureSchema, kernel_options: KernelOptions | None = None) -> nn.Module:
    """The model named by `config.arch`, on the default device; parameters drawn from torch's RNG. `kernel_options`
    (the recipe's `[kernels]` table) go to every attention call's Triton kernels; None: their defaults."""
    if config.arch == "gem":
        return GEMModel(config, schema, kernel_options)
    if config.arch == "dlrm":
        return DLRMModel(config, schema)
    if config.arch == "gbdt":
        raise ValueError("the gbdt arm is no torch model: `gemrec train --model gbdt` fits trees on the dense features")
    assert_never(config.arch)  # ModelConfig refuses any other arch; the type checker proves every one is built


def model_flops(model: nn.Module, inp: ModelInput) -> dict[str, tuple[int, int]]:
    """Matmul FLOPs per layer `{module name: (forward, backward)}` for this input's real jagged lengths."""
    if not isinstance(model, (GEMModel, DLRMModel)):
        raise TypeError(f"model_flops needs a gemrec model (GEMModel or DLRMModel), got {type(model).__name__}")
    return model.flops(inp)


def loss(output: ModelOutput, labels: torch.Tensor, task_weights=None) -> torch.Tensor:
    """Weighted sum over tasks of the mean binary cross-entropy, plus the model's auxiliary loss. `task_weights`: a
    tensor on the logits' device (the trainer's; a Python list costs a synchronizing host-to-device copy a step)."""
    logits = output.logits
    if labels.shape != logits.shape:
        raise ValueError(f"labels must have the logits' shape {tuple(logits.shape)}, got {tuple(labels.shape)}")
    per_task = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(0)
    if task_weights is None:
        weights = torch.ones_like(per_task)
    else:
        weights = torch.as_tensor(task_weights, dtype=per_task.dtype, device=per_task.device)
        if weights.shape != per_task.shape:
            raise ValueError(f"task_weights must have {per_task.numel()} entries, got {tuple(weights.shape)}")
    return (per_task * weights).sum() + output.aux_loss
