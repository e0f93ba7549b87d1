"""The FP8 GEMM compiled for Hopper (sm_90) without a GPU, as triton's launcher specializes it on one: a weight
gradient's reduction over an arbitrary token count streams its whole 128-deep blocks through cp.async."""

import re

import pytest
import torch
import triton
from gemrec.kernels import fp8
from gemrec.kernels.triton_attention import INTERPRET

pytestmark = pytest.mark.skipif(INTERPRET, reason="needs triton's compiler, not its interpreter")

CONSTS = {"HAS_BIAS": False, "GROUP_M": False, "GROUP_K": False, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}


def weight_gradient_sass(tokens: int) -> str:
    """SASS of `_gemm_kernel` for dW (1024 x 4096) = dY^T X over `tokens`, its operands allocated as `quantize`'s
    "qt"."""
    from gemrec.kernels.aot import _cuobjdump, compile_jit

    a, b = (fp8.aligned_rows((n, tokens), "cpu", torch.float8_e4m3fn) for n in (1024, 4096))
    c = torch.empty(1024, 4096)
    sa, sb = (torch.empty(-(-tokens // 128), n).mT for n in (1024, 4096))
    dummy = torch.empty(1, dtype=torch.int32)
    args = [a, b, c, sa, sb, dummy, dummy, dummy, 1024, 4096, tokens, *a.stride(), 0, *b.stride(), 0, *c.stride()]
    args += [*sa.stride(), 0, *sb.stride(), 4096, triton.next_power_of_2(tokens)]
    consts = {**CONSTS, "EVEN_K": tokens % 128 == 0, "GROUP_SIZE_M": 8}
    compiled = compile_jit(fp8._gemm_kernel.fn, args, consts, {"num_warps": 8, "num_stages": 3})
    return _cuobjdump(compiled, "--dump-sass")


def test_weight_gradient_gemm_pipelines_whole_blocks_at_any_token_count():
    ragged = weight_gradient_sass(191_237)
    assert len(re.findall(r"LDGSTS\.E\.BYPASS\.128", ragged)) >= 16  # A and B tiles by cp.async, 16 bytes at a time
    assert len(re.findall(r"LDG\.E\.U8", ragged)) <= 128  # byte loads in the masked last block only
