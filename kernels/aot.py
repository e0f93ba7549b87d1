"""The attention kernels compiled ahead of time for a GPU architecture, on a machine without a GPU.

`record_launches(call)` runs an op on CPU tensors with every kernel launch captured instead of executed: the
kernels it would launch, with the arguments and constexprs the real call builds. `compile_launch` compiles one
to a cubin with triton's bundled ptxas (Hopper, sm_90, by default) and `resource_usage` reads its registers,
spill stack and shared memory. `gemrec bench kernels --static` reports these for every candidate tile of every
benchmark config: a first look at register pressure and spills before any GPU time is spent.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
from gemrec.kernels import ops
from gemrec.kernels import triton_attention as kernels
from gemrec.kernels.options import KernelOptions
from triton._C.libtriton import native_specialize_impl
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource

HOPPER = triton.backends.compiler.GPUTarget("cuda", 90, 32)
HOPPER_SHARED_MEMORY = 232448  # bytes one program may use on an H100/H200


@dataclass
class Launch:
    kernel: kernels._Kernel
    args: tuple
    consts: dict
    tma: bool
    options: KernelOptions

    @property
    def kind(self) -> str:
        return self.kernel.kind

    def candidates(self) -> list[dict]:
        tma = self.tma and self.options.tma
        dtype = self.args[0].dtype
        return kernels._candidates(self.kind, self.consts, dtype, tma, HOPPER_SHARED_MEMORY) + kernels.gluon_candidates(
            self.kind, self.consts, dtype, tma, self.options
        )


@contextmanager
def _captured(recorded: list[Launch]):
    if kernels.INTERPRET:
        raise RuntimeError("ahead-of-time compilation needs triton's compiler: unset TRITON_INTERPRET")
    launch, pick = kernels._Kernel.__call__, ops._kernels

    def record(self, grid, args, consts, bucket, options, reset=(), tma=False):
        recorded.append(Launch(self, args, dict(consts), tma, options))

    # Recording replaces the launcher for the duration (and restores it): a deliberate monkeypatch.
    kernels._Kernel.__call__, ops._kernels = record, (lambda q: kernels)  # type: ignore[method-assign]
    try:
        yield
    finally:
        kernels._Kernel.__call__, ops._kernels = launch, pick  # type: ignore[method-assign]


def record_launches(call) -> list[Launch]:
    """Every kernel launch `call()` makes (on CPU tensors, backend="triton"), none executed; outputs are garbage."""
    recorded: list[Launch] = []
    with _captured(recorded):
        call()
    return recorded


def compile_launch(launch: Launch, config: dict | None = None, target=HOPPER):
    """The compiled kernel (cubin in `.asm["cubin"]`) of one launch with a tile config (default: the first
    candidate, what runs untuned where it fits). Arguments are specialized as triton's launcher does on a GPU
    (16-byte aligned pointers and ints divisible by 16 marked so, ints equal to 1 made constants), so loads get
    the same vectorization and the cubin the same registers as the real launch."""
    config = config or launch.candidates()[0]
    fn, tiles = launch.kernel.variant(config)
    const_names = kernels._const_names(fn)
    constexprs = {**launch.consts, **{k: v for k, v in tiles.items() if k not in kernels.COMPILE_OPTIONS}}
    options = {"num_warps": config.get("num_warps", 4), "num_stages": config.get("num_stages", 2)}
    if "maxnreg" in config:
        options["maxnreg"] = config["maxnreg"]
    constants = {name: constexprs[name] for name in const_names}
    return compile_jit(fn, launch.args, constants, options, target, gluon=bool(config.get("GLUON")))


def compile_jit(fn, args, constants: dict, options: dict, target=HOPPER, gluon: bool = False):
    """A `@triton.jit` (or Gluon) function compiled for `target` with its runtime `args` in order (the parameters not
    in `constants`) specialized as triton's launcher does on a GPU: 16-byte aligned pointers and ints divisible by 16
    marked so, ints equal to 1 made constants; constexpr parameters left out of `constants` take their defaults."""
    backend = type(make_backend(target))
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in constants}
    constants = {**constants, **defaults}
    signature, fixed, attrs = {}, dict(constants), {}
    runtime = [name for name in fn.arg_names if name not in constants]
    for name, value in zip(runtime, args):
        kind, spec = native_specialize_impl(backend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            fixed[name] = value
        elif isinstance(spec, str):
            attrs[(fn.arg_names.index(name),)] = backend.parse_attr(spec)
    signature.update(dict.fromkeys(constants, "constexpr"))
    source = GluonASTSource if gluon else triton.compiler.ASTSource
    return triton.compile(source(fn, signature, fixed, attrs), target=target, options=options)


# SASS opcode groups counted over the whole kernel (both loop bodies dominate): fp32 arithmetic of the softmax or
# activation, special-function (exp2/tanh) ops, integer address arithmetic, and spill traffic.
SASS_GROUPS = {
    "fp32": ("FMUL", "FADD", "FFMA", "FMNMX", "FSEL"),
    "mufu": ("MUFU",),
    "int": ("IMAD", "IADD3", "LEA"),
    "spill": ("STL", "LDL"),
}
_SASS_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, flag, cubin.name], capture_output=True, text=True, check=True).stdout


def sass_counts(compiled) -> dict[str, int]:
    """Instructions of the kernel's machine code (SASS) in total and per `SASS_GROUPS` group."""
    opcodes = [
        m.group(1) for line in _cuobjdump(compiled, "--dump-sass").splitlines() if (m := _SASS_OPCODE.match(line))
    ]
    counts = {"total": len(opcodes)}
    for group, names in SASS_GROUPS.items():
        counts[group] = sum(op in names for op in opcodes)
    return counts


def resource_usage(compiled) -> dict[str, int]:
    """registers per thread, spill stack bytes per thread, shared memory bytes per block (cuobjdump's view)."""
    dump = _cuobjdump(compiled, "--dump-resource-usage")
    fields = dict(
        item.split(":", 1)
        for line in dump.splitlines()
        if "REG:" in line
        for item in line.split()
        if ":" in item and item.split(":", 1)[1].isdigit()
    )
    return {
        "registers": int(fields["REG"]),
        "stack_bytes": int(fields["STACK"]),
        "shared_bytes": compiled.metadata.shared,
    }


def static_report(config_names: list[str], options: KernelOptions = KernelOptions(), progress=print) -> list[dict]:
    """For each benchmark config and variant: every kernel its fwd+bwd launches with `options` (plus the one-launch
    backward where it applies, if `options` leave it off) x every candidate tile config, compiled for sm_90, with its
    registers, spill stack and shared memory."""
    from gemrec.kernels.bench import CONFIGS, make_case, run_ours

    rows = []
    for name in config_names:
        cfg = CONFIGS[name]
        for variant in cfg.variants:
            case = make_case(cfg, 0, torch.device("cpu"), num_seqs=min(cfg.num_seqs, 8))

            def fwd_bwd(options, variant=variant, case=case):
                leaves = [t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v)]
                run_ours(variant, case, "triton", *leaves, options=options).sum().backward()

            launches = record_launches(functools.partial(fwd_bwd, options))
            if all(launch.kind != "bwd1" for launch in launches):  # the one-launch backward too, where it applies
                one_launch = dataclasses.replace(options, one_launch=True)
                launches += [
                    launch
                    for launch in record_launches(functools.partial(fwd_bwd, one_launch))
                    if launch.kind == "bwd1"
                ]
            for launch in launches:
                for tiles in launch.candidates():
                    compiled = compile_launch(launch, tiles)
                    usage = {**resource_usage(compiled), "sass": sass_counts(compiled)}
                    row = {
                        "config": name,
                        "variant": variant.name,
                        "kernel": launch.kind,
                        "fuse_dq": launch.consts.get("FUSE_DQ"),
                        "tiles": tiles,
                        **usage,
                    }
                    progress(format_static_row(row))
                    rows.append(row)
    return rows


def format_static_row(row: dict) -> str:
    tiles = " ".join(f"{k}={v}" for k, v in row["tiles"].items())
    fused = "" if row["fuse_dq"] is None else f" fuse_dq={row['fuse_dq']}"
    return (
        f"{row['config']:8s} {row['variant']:12s} {row['kernel']:5s}{fused:14s} {tiles:52s} "
        f"regs {row['registers']:3d}  spill stack {row['stack_bytes']:5d} B  shared {row['shared_bytes']:6d} B  "
        "sass " + " ".join(f"{k} {v}" for k, v in row["sass"].items())
    )
