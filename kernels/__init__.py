"""Triton kernels: jagged flash attention (`jagged_attention`) and generalized dot-product attention (`gdpa`)."""

from gemrec.kernels.ops import RelativeBias, attention_flops, attention_pairs, gdpa, jagged_attention

__all__ = ["RelativeBias", "attention_flops", "attention_pairs", "gdpa", "jagged_attention"]
