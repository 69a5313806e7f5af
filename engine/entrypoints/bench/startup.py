"""`xlaserve bench startup [--model M] [-- GENERATE FLAGS]`: how long `xlaserve generate` takes from
a cold and a warm start.

Each run is a fresh process, as a user's would be: the first with an empty persistent compilation
cache (cold: every warm-up program compiles), the second with the cache the first left (warm). The
report gives the wall time to the first generated text and the phases the engine logged (checkpoint,
placement, warm-up), and how many programs came from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_PHASES = {
    "checkpoint_s": re.compile(r"start-up: checkpoint ([\d.]+)s"),
    "engine_s": re.compile(r"start-up: checkpoint [\d.]+s, engine ([\d.]+)s"),
    "placement_s": re.compile(r"placed \S+ weights in ([\d.]+)s"),
    "warm_up_s": re.compile(r"warm-up: \d+ programs for .* in ([\d.]+)s"),
    "programs": re.compile(r"warm-up: (\d+) programs"),
    "from_cache": re.compile(r"\((\d+) from the persistent cache"),
}


def run_once(generate_args: list[str], cache_root: str) -> dict:
    """One `xlaserve generate` in a fresh process -> wall seconds and the logged phases."""
    env = dict(os.environ, XLASERVE_CACHE_ROOT=cache_root)
    env.pop("XLASERVE_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, "-m", "xlaserve.entrypoints.cli", "generate", *generate_args]
    t0 = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"xlaserve generate failed:\n{result.stderr[-3000:]}")
    report = {"wall_s": wall}
    for name, pattern in _PHASES.items():
        match = pattern.search(result.stderr)
        if match:
            report[name] = float(match[1]) if name.endswith("_s") else int(match[1])
    return report


def cmd_bench_startup(args: argparse.Namespace) -> int:
    generate_args = [args.prompt, "--max-tokens", str(args.max_tokens), "--temperature", "0"]
    if args.model:
        generate_args += ["--model", args.model]
    generate_args += [a for a in args.engine_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="xlaserve-startup-") as cache_root:
        results = {"cold": run_once(generate_args, cache_root), "warm": run_once(generate_args, cache_root)}
    for name, r in results.items():
        phases = ", ".join(
            f"{k} {v:.1f}" if k.endswith("_s") else f"{k} {v}" for k, v in r.items() if k != "wall_s"
        )
        print(f"{name:>5}: {r['wall_s']:.1f} s wall to the last token ({phases})")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def add_startup_parser(bench_sub) -> None:
    b = bench_sub.add_parser("startup", help="`xlaserve generate` from a cold and a warm compilation cache")
    b.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (the default)")
    b.add_argument("--prompt", default="Hello")
    b.add_argument("--max-tokens", type=int, default=8)
    b.add_argument("--output-json", default=None)
    b.add_argument(
        "engine_args", nargs=argparse.REMAINDER, help="after --: more flags for `xlaserve generate`"
    )
    b.set_defaults(func=cmd_bench_startup)
