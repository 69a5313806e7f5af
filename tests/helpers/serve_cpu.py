"""CPU seconds of `xlaserve serve` from its exec to the first /health 200, per process (the front end, the
engine core): the suite's server (ServerProcess, engine_flags) on MODEL, started `--runs` times on one
compilation cache, so every run after the first compiles nothing (engine/PERFORMANCE.md, Start-up).

    python tests/helpers/serve_cpu.py /path/to/tiny-llama --tiny --runs 3
    python tests/helpers/serve_cpu.py smollm2 --runs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helpers.server_harness import ServerProcess  # noqa: E402
from helpers.tiny_models import TINY_PROCESS_ENV  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the tiny models' XLA flags (TINY_PROCESS_ENV)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "xlaserve-serve-cpu"))
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="serve-cpu-")
    for run in range(args.runs):
        started = time.monotonic()
        proc = ServerProcess(
            log_dir, args.cache_dir, model=args.model, env=TINY_PROCESS_ENV if args.tiny else None
        )
        proc.wait_ready()
        wall = time.monotonic() - started
        front, core = cpu_seconds(proc.proc.pid), cpu_seconds(proc.core_pid())
        load = os.getloadavg()[0]
        proc.stop()
        print(
            f"run {run}: front end {front:.2f} s, engine core {core:.2f} s, "
            f"together {front + core:.2f} CPU s ({wall:.1f} s wall, load {load:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
