"""Triton kernels: jagged flash attention (`jagged_attention`) and generalized dot-product attention (`gdpa`).

Layout: q `(total_q, heads, head_dim)`, k/v `(total_kv, heads, head_dim)`, offsets `(B+1,)` of any integer
dtype (read as given, no conversion); sequence i owns rows `offsets[i]:offsets[i+1]`. `max_q_len`/`max_kv_len` are host
ints that must bound the real lengths (checked for CPU offsets; CUDA calls trust them, no sync).

- Sharing (PMA seeds, shared context): a 2-entry `q_offsets` with B > 1 key sequences means one query
  sequence attends to every key sequence; the kernels index the same q rows for all B (no B copies), the
  output has `B * len_q` rows and dq is reduced over B. A 2-entry `kv_offsets` shares one key/value
  sequence the same way.
- Causal, bottom-right aligned: query i of a length-Lq sequence sees keys j <= i + (Lkv - Lq). For
  self-attention that is j <= i; for 32 seeds over 1000 keys, seed 31 sees all keys and seed 0 the first
  969; a query that sees no key outputs zeros.
- Scores: `scale * q.k + attn_bias[row, h, j] + rel.position[h, bucket(|i + Lkv - Lq - j|)] +
  rel.time[h, bucket(|ts_q - ts_k|)]`; `attn_bias` is `(output rows, H, max_kv_len)` (dense, per query
  row, meant for short key sequences); the bucket tables are learnable and indexed in-kernel (see
  `RelativeBias`); every bias gets its gradient, and no `[B, H, N, N]` tensor is ever built.
- `jagged_attention`: softmax. `gdpa`: `act(scores) v * norm`, act in silu, gelu, gelu_tanh, relu, relu2;
  norm 1/kv_len (per sequence), 1/max_kv_len (HSTU) or none.
- Masks and RoPE, by keyword (positions 0-based per sequence, a query at i + Lkv - Lq): `window=W` (causal: keys
  pos - W < j <= pos; not causal: |pos - j| < W), `block=b` (pos // b == j // b, and j <= pos when causal),
  `rope_base=theta` (q and k rotated rotate-half by their positions inside the kernels, gradients w.r.t. the
  unrotated q, k). The tiled kernels skip key tiles a window or block leaves out and mask only edge tiles; blocks of
  64 and 128 (head dims up to 128) run on their own kernels (`block_attention.py`). FLOPs count only the pairs a mask
  lets through (`attention_pairs`, closed form per sequence).
- Backends: "auto" runs the Triton kernels on CUDA tensors with head dims 16..256 and the pure-torch reference
  (`reference.py`: length-grouped, fast on CPU, what every test compares against) otherwise; "triton" on CPU
  tensors needs TRITON_INTERPRET=1 set before triton is first imported; "reference" always the reference.
- The Triton path is the custom ops `gemrec::attention_fwd` / `gemrec::attention_bwd` (fake impls for
  `torch.compile(fullgraph=True)`, FLOP formulas for `FlopCounterMode` counting real pairs only),
  autotuned on (bucketed max length, head dim, variant). How it runs is chosen by `options=KernelOptions(...)`
  (tma, one_launch, resident, gluon, autotune, fp8: the FP8 forward of `fp8_attention.py`; see `options.py`), passed
  down to the kernel choice and the autotuner: no environment variable changes kernel behaviour (TRITON_INTERPRET is
  Triton's own).
  Eager calls on plain tensors skip the custom-op dispatch and launch the kernels straight from Python.
"""

from gemrec.kernels.ops import RelativeBias, attention_flops, attention_pairs, gdpa, jagged_attention
from gemrec.kernels.options import KernelOptions

__all__ = ["KernelOptions", "RelativeBias", "attention_flops", "attention_pairs", "gdpa", "jagged_attention"]
