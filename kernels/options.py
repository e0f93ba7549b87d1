"""`KernelOptions`: how the Triton attention kernels run, chosen by argument (never by environment variables).

Every option changes speed, not results (beyond rounding): they select tile candidates and kernel variants. The
recipe's `[kernels]` table is `KernelOptions.from_dict`; `gemrec bench kernels` has a flag per field.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class KernelOptions:
    """tma: tensor-descriptor (TMA) tile candidates where the layout allows them.
    one_launch: the whole backward of small problems (below `ONE_LAUNCH_MAX_WORK`) as one kernel launch (delta
      and dQ in-kernel); off by default: on the H200 its device time was no better than the separate launches.
    resident: the resident-side kernels where one side fits a tile (cross-attention to a few keys, PMA seeds: the
      short side stays loaded, one-kernel backward).
    gluon: the warp-specialized Gluon forward tiles on Hopper (sm_90), where they cover the call.
    autotune: time every candidate tile on the first call of each tuning key; off: the first candidate."""

    tma: bool = True
    one_launch: bool = False
    resident: bool = True
    gluon: bool = True
    autotune: bool = True

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"kernels.{f.name}: {value!r} is not allowed; expected true or false")

    @classmethod
    def from_dict(cls, values: dict) -> KernelOptions:
        """From a recipe's `[kernels]` table; an unknown key or a non-boolean value is refused, naming it."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"kernels: unknown key(s) {unknown}; allowed keys: {', '.join(allowed)}")
        return cls(**values)

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)

    @property
    def flags(self) -> int:
        """The options as one int (a bit per field, in field order): what the custom ops take."""
        return sum(1 << i for i, f in enumerate(fields(self)) if getattr(self, f.name))

    @staticmethod
    @functools.cache
    def from_flags(flags: int) -> KernelOptions:
        return KernelOptions(**{f.name: bool(flags >> i & 1) for i, f in enumerate(fields(KernelOptions))})
