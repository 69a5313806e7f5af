"""The server's front end spawns the engine core before it imports jax or transformers, so that
those imports (~1 s) overlap the core's start (api_server._serve): AsyncLLM itself must not pull
them in."""

from __future__ import annotations

import subprocess
import sys


def test_async_llm_imports_neither_jax_nor_transformers():
    code = (
        "import sys\n"
        "import xlaserve.engine.async_llm\n"
        "print(sorted(m for m in ('jax', 'transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
