"""Run one case of tests/helpers/tp_worker.py in a subprocess with 8 fake CPU devices (the device
count is fixed when jax starts) and return the JSON it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def run_worker(mode: str, model_dir: str, arg) -> object:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, WORKER, mode, model_dir, json.dumps(arg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, f"worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT ") :])
