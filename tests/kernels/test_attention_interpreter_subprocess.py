"""Runs test_attention_interpreter.py in a fresh interpreter with TRITON_INTERPRET=1 when this process cannot.

Triton picks its interpreter when it is first imported (its own `tl.*` helpers are decorated then), so
once anything in this pytest process imported triton normally the interpreter tests must run elsewhere.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gemrec.kernels import triton_attention as kernels_module

HERE = Path(__file__).parent


@pytest.mark.skipif(kernels_module.INTERPRET, reason="the interpreter is active here: the tests ran in-process")
def test_interpreter_suite_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(HERE.parent.parent),
            str(HERE / "test_attention_interpreter.py"),
            str(HERE / "test_fp8_interpreter.py"),
            str(HERE / "test_fp8_attention_interpreter.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
