"""Two jax.distributed processes of a helper script on loopback (the suite's multi-host cases): the
script runs as `python SCRIPT ARG_JSON` with `node_rank` 0 and 1 in the argument, process 0 prints its
result as one `RESULT {json}` line, and process 1 follows its steps until process 0 releases it (a
script may build several engines in turn, process 1 following each: helpers/multihost_process.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from helpers.tiny_models import FAST_COMPILE_XLA_FLAGS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices_per_process: int) -> dict[str, str]:
    """The environment of a helper script's process: `devices_per_process` CPU devices, compiled as the
    fake-mesh worker compiles (tp_worker.py)."""
    flags = f"--xla_force_host_platform_device_count={devices_per_process} {FAST_COMPILE_XLA_FLAGS}"
    return dict(os.environ, XLA_FLAGS=flags)


def process_command(script: str, arg: dict) -> list[str]:
    """helpers/`script` run with `arg` (its node_rank and port among them)."""
    return [sys.executable, os.path.join(os.path.dirname(__file__), script), json.dumps(arg)]


def run_two_processes(script: str, arg: dict, devices_per_process: int, timeout_s: float = 600) -> dict:
    """helpers/`script`'s two processes of `devices_per_process` CPU devices each (the fake-mesh worker's
    compile flags, tp_worker.py): process 0's result, once both have exited cleanly (process 0 within
    `timeout_s`)."""
    env = process_env(devices_per_process)
    arg = {**arg, "port": free_port()}

    def command(node_rank: int) -> list[str]:
        return process_command(script, {**arg, "node_rank": node_rank})

    follower = subprocess.Popen(
        command(1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    leader = subprocess.run(
        command(0), env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    _, follower_err = follower.communicate(timeout=120)
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_err[-3000:]
    line = next(line for line in leader.stdout.splitlines() if "RESULT " in line)
    return json.loads(line.split("RESULT ", 1)[1])


def engine_of_two(model: str, arg: dict, **engine):
    """In a script `run_two_processes` runs: process 0's LLM over both processes (`arg`'s node_rank and
    port), or None in process 1 once it has followed process 0's steps to the end."""
    from xlaserve import LLM
    from xlaserve.entrypoints.llm import serve_follower

    engine |= {
        "nnodes": 2,
        "node_rank": arg["node_rank"],
        "master_addr": "127.0.0.1",
        "master_port": arg["port"],
    }
    if arg["node_rank"]:
        serve_follower(model, **engine)
        return None
    return LLM(model, **engine)
