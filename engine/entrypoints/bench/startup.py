"""`xlaserve bench startup [--model M] [-- GENERATE FLAGS]`: how long `xlaserve generate` takes from
a cold and a warm start.

Each run is a fresh process, as a user's would be: the first with an empty persistent compilation
cache (cold: every warm-up program compiles), the second with the cache the first left (warm). The
report gives the wall time to the last generated token and the phases the command logged (imports,
checkpoint, placement, warm-up, the first token after the engine was ready), and how many programs
were loaded ahead of time (worker/program_store.py), how many compiled, and of those how many XLA's
persistent cache held.

`--serve` then starts `xlaserve serve` twice and reports how long each takes until its /health answers
200: the first compiles the server's own programs (`generate` sizes its engine to one request, cli.py,
so its cache does not hold them), the second is the warm start (the issue's target: within 10 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

_PHASES = {
    "imports_s": re.compile(r"start-up: imports ([\d.]+)s"),
    "checkpoint_s": re.compile(r"start-up: checkpoint ([\d.]+)s"),
    "engine_s": re.compile(r"start-up: checkpoint [\d.]+s, engine ([\d.]+)s"),
    "placement_s": re.compile(r"placed \S+ weights in ([\d.]+)s"),
    "warm_up_s": re.compile(r"warm-up: \d+ programs for .* in ([\d.]+)s"),
    "programs": re.compile(r"warm-up: (\d+) programs"),
    "loaded": re.compile(r"\((\d+) loaded ahead of time"),
    "compiled": re.compile(r"(\d+) compiled, "),
    "from_cache": re.compile(r"(\d+) from the persistent cache"),
    "first_token_s": re.compile(r"first token ([\d.]+)s after the engine was ready"),
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(generate_args: list[str], cache_root: str) -> dict:
    """One `xlaserve generate` in a fresh process -> wall seconds and the logged phases."""
    env = dict(os.environ, XLASERVE_CACHE_ROOT=cache_root)
    env.pop("XLASERVE_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, "-m", "xlaserve.entrypoints.cli", "generate", *generate_args]
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"xlaserve generate failed:\n{result.stderr[-3000:]}")
    # CPU seconds (user + system) of the run: on a machine shared with other work, wall time moves
    # with the load and this does not (on an idle machine, wall >= cpu / cores).
    report = {"wall_s": wall, "cpu_s": _children_cpu_s() - cpu0}
    for name, pattern in _PHASES.items():
        match = pattern.search(result.stderr)
        if match:
            report[name] = float(match[1]) if name.endswith("_s") else int(match[1])
    return report


# `xlaserve generate`'s own flags (cli.py) and how many values each takes: `--serve` drops them.
_GENERATE_ONLY_FLAGS = {"--raw": 0, "--max-tokens": 1, "--temperature": 1, "--top-p": 1, "--top-k": 1,
                        "--min-p": 1, "--sampling-seed": 1, "--repetition-penalty": 1,
                        "--stop": 1}  # fmt: skip


def engine_flags_only(args: list[str]) -> list[str]:
    """The flags after `--` less those only `generate` takes, for `xlaserve serve`."""
    kept, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in _GENERATE_ONLY_FLAGS:
            i += 1 + (_GENERATE_ONLY_FLAGS[name] if "=" not in args[i] else 0)
            continue
        kept.append(args[i])
        i += 1
    return kept


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_healthy(serve_args: list[str], cache_root: str, timeout_s: float = 300.0) -> dict:
    """`xlaserve serve` in a fresh process -> seconds until GET /health answers 200."""
    env = dict(os.environ, XLASERVE_CACHE_ROOT=cache_root)
    env.pop("XLASERVE_COMPILATION_CACHE_DIR", None)
    port = _free_port()
    command = [sys.executable, "-m", "xlaserve.entrypoints.cli", "serve", *serve_args, "--port", str(port)]
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody reads the log while it runs
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"xlaserve serve exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        return {"healthy_s": time.perf_counter() - t0}
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"xlaserve serve did not answer /health within {timeout_s:.0f} s")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def cmd_bench_startup(args: argparse.Namespace) -> int:
    generate_args = [args.prompt, "--max-tokens", str(args.max_tokens), "--temperature", "0"]
    if args.model:
        generate_args += ["--model", args.model]
    engine_args = [a for a in args.engine_args if a != "--"]
    generate_args += engine_args
    with tempfile.TemporaryDirectory(prefix="xlaserve-startup-") as cache_root:
        results = {"cold": run_once(generate_args, cache_root), "warm": run_once(generate_args, cache_root)}
        if args.serve:
            # On the cache the generate runs filled (the same engine flags): a server's warm start.
            serve_args = (["--model", args.model] if args.model else []) + engine_flags_only(engine_args)
            results["serve_warm"] = serve_until_healthy(serve_args, cache_root)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    results["load_average"] = load
    for name in ("cold", "warm"):
        r = results[name]
        logged = {k: v for k, v in r.items() if k not in ("wall_s", "cpu_s")}
        phases = ", ".join(f"{k} {v:.1f}" if k.endswith("_s") else f"{k} {v}" for k, v in logged.items())
        print(f"{name:>5}: {r['wall_s']:.1f} s wall to the last token, {r['cpu_s']:.1f} s of CPU ({phases})")
    if "serve_warm" in results:
        print(f"serve: /health answered 200 after {results['serve_warm']['healthy_s']:.1f} s (warm cache)")
    print(f"load average: {load}")
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
        "--serve", action="store_true", help="also time `xlaserve serve` (warm cache) until /health answers"
    )
    b.add_argument(
        "engine_args", nargs=argparse.REMAINDER, help="after --: more flags for `xlaserve generate`"
    )
    b.set_defaults(func=cmd_bench_startup)
