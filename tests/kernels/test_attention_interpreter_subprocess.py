"""Runs the interpreter suites in fresh interpreters with TRITON_INTERPRET=1 when this process cannot.

Triton picks its interpreter when it is first imported (its own `tl.*` helpers are decorated then), so
once anything in this pytest process imported triton normally the interpreter tests must run elsewhere. The
collected tests are dealt round-robin to one shard per CPU (at most `MAX_SHARDS`), run side by side: this
process only waits.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gemrec.kernels import triton_attention as kernels_module

HERE = Path(__file__).parent
SUITES = ("test_attention_interpreter.py", "test_fp8_interpreter.py", "test_fp8_attention_interpreter.py")
MAX_SHARDS = 4
ENV = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def pytest_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parent.parent), *args]


def collected_ids() -> list[str]:
    proc = subprocess.run(
        pytest_command("--collect-only", *(str(HERE / name) for name in SUITES)),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.skipif(kernels_module.INTERPRET, reason="the interpreter is active here: the tests ran in-process")
def test_interpreter_suite_in_subprocess():
    ids = collected_ids()
    assert len(ids) > 100, ids[:5]
    shards = max(1, min(MAX_SHARDS, len(os.sched_getaffinity(0))))
    procs = [
        subprocess.Popen(
            pytest_command(*ids[i::shards]),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE.parent.parent,
        )
        for i in range(shards)
    ]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-6000:] + err[-3000:]
        assert " passed" in out and "skipped" not in out.splitlines()[-1], out[-2000:]
