"""`python -m xlaserve.kernels.cuda_compile` in a fresh process, for the kernels' sm_90 compile tests:
Triton compiles or interprets per process, depending on TRITON_INTERPRET when it is first imported
(conftest sets it for the interpreter tests)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_in_subprocess(kernel: str, *shapes: str) -> str:
    """Compile `kernel` for sm_90 on the shapes whose names contain one of `shapes`; its stdout (one
    'ok   KERNEL sm_90 SHAPE' line per compiled shape). Fails the test on a non-zero exit."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("compiling for sm_90 on CPU needs the triton package (the test extra)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "xlaserve.kernels.cuda_compile", "--kernel", kernel]
    for shape in shapes:
        cmd += ["--shape", shape]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
