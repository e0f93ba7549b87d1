"""`KernelOptions`: how the Triton attention kernels run, chosen by argument (never by environment variables).

Every option but `fp8` changes speed, not results (beyond rounding): they select tile candidates and kernel variants;
`fp8` rounds the forward's matrix-product operands to e4m3 (about 2-3% relative error against exact). The
recipe's `[kernels]` table is `KernelOptions.from_dict` (a `gemrec.config.Section`: checked like every config
section); `gemrec bench kernels` has a flag per field.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import ClassVar

from gemrec.config import Section


@dataclass(frozen=True)
class KernelOptions(Section):
    """tma: tensor-descriptor (TMA) tile candidates where the layout allows them.
    one_launch: the whole backward of small problems (below `ONE_LAUNCH_MAX_WORK`) as one kernel launch (delta
      and dQ in-kernel); off by default: on the H200 its device time was no better than the separate launches.
    resident: the resident-side kernels where one side fits a tile (cross-attention to a few keys, PMA seeds: the
      short side stays loaded, one-kernel backward).
    gluon: the warp-specialized Gluon forward tiles on Hopper (sm_90), where they cover the call.
    autotune: time every candidate tile on the first call of each tuning key; off: the first candidate.
    fp8: the forward's QK^T and PV on e4m3 operands with per-block scales, softmax/activation in fp32
      (`fp8_attention.py`; the reference backend runs its emulation); the backward stays bf16. No RoPE."""

    SECTION: ClassVar[str] = "kernels"

    tma: bool = True
    one_launch: bool = False
    resident: bool = True
    gluon: bool = True
    autotune: bool = True
    fp8: bool = False

    @property
    def flags(self) -> int:
        """The options as one int (a bit per field, in field order): what the custom ops take."""
        return sum(1 << i for i, f in enumerate(fields(self)) if getattr(self, f.name))

    @staticmethod
    @functools.cache
    def from_flags(flags: int) -> KernelOptions:
        return KernelOptions(**{f.name: bool(flags >> i & 1) for i, f in enumerate(fields(KernelOptions))})
