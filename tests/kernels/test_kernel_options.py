"""KernelOptions: refused when malformed, carried to every kernel launch (forward and backward), set by bench flags."""

import argparse
import dataclasses

import pytest
import torch
from gemrec.kernels import KernelOptions, gdpa, jagged_attention
from gemrec.kernels import triton_attention as kernels
from kernel_harness import offsets_of


def test_defaults_and_from_dict():
    assert KernelOptions() == KernelOptions(
        tma=True, one_launch=False, resident=True, gluon=True, autotune=True, fp8=False
    )
    assert KernelOptions.from_dict({}) == KernelOptions()
    assert KernelOptions.from_dict({"resident": False, "autotune": False}) == KernelOptions(
        resident=False, autotune=False
    )
    assert KernelOptions.from_dict(KernelOptions(tma=False).to_dict()) == KernelOptions(tma=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().tma = False


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"tmaa": True},
            r"unknown setting kernels.tmaa = True; \[kernels\] takes autotune, fp8, gluon, one_launch, resident",
        ),
        ({"resident": "no"}, r"kernels.resident = 'no': must be true or false"),
        ({"autotune": 0}, r"kernels.autotune = 0: must be true or false"),
    ],
)
def test_bad_tables_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        KernelOptions.from_dict(values)


def test_flags_round_trip():
    for bits in range(1 << len(dataclasses.fields(KernelOptions))):
        assert KernelOptions.from_flags(bits).flags == bits
    assert KernelOptions.from_flags(KernelOptions(gluon=False).flags) == KernelOptions(gluon=False)


def test_ops_refuse_other_option_types():
    off = offsets_of([3])
    q = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="options must be a gemrec.kernels.KernelOptions"):
        jagged_attention(q, q, q, off, off, 3, 3, options={"tma": False})


@pytest.mark.skipif(kernels.INTERPRET, reason="records launches through triton's compiler path")
@pytest.mark.parametrize("options", [KernelOptions(), KernelOptions(one_launch=True, resident=False, tma=False)])
def test_options_reach_every_launch_and_choose_the_kernels(options):
    from gemrec.kernels.aot import record_launches

    off, kv_off = offsets_of([300, 3]), offsets_of([5, 9])
    q = torch.randn(303, 2, 32, requires_grad=True)
    k, v = (torch.randn(14, 2, 32, requires_grad=True) for _ in range(2))

    def call():
        gdpa(q, k, v, off, kv_off, 300, 9, backend="triton", options=options).sum().backward()
        jagged_attention(q, q, q, off, off, 300, 300, causal=True, backend="triton", options=options).sum().backward()

    launches = record_launches(call)
    assert {launch.options for launch in launches} == {options}
    kinds = [launch.kind for launch in launches]
    if options.resident:  # a few keys: resident K/V; self-attention tiled, dQ fused into the dK/dV kernel
        assert kinds == ["fwd_rkv", "bwd_rkv", "fwd", "delta", "dkdv"]
    else:
        assert kinds == ["fwd", "bwd1", "fwd", "bwd1"]
    tma = [c.get("TMA", False) for launch in launches for c in launch.candidates()]
    assert any(tma) == options.tma


def test_bench_flags_build_the_options():
    from gemrec.kernels.cli import kernel_options, register

    root = argparse.ArgumentParser()
    register({"bench": root.add_subparsers()})
    args = root.parse_args(["kernels", "--no-resident", "--one-launch", "--no-autotune"])
    assert kernel_options(args) == KernelOptions(resident=False, one_launch=True, autotune=False)
    assert kernel_options(root.parse_args(["kernels"])) == KernelOptions()
