"""Where the suite's time goes: per test, its wall time, its CPU time and what XLA compiled in it.

On when `XLASERVE_SUITE_PROFILE` names a folder (tests/conftest.py registers this plugin then): each
process (an xdist worker, or the one process) writes `<folder>/<worker>.jsonl`, one line per test
phase with `nodeid`, `phase`, `wall_s`, `cpu_s` (this process and the subprocesses it waited for:
servers and fake-mesh workers count when they exit), `compiles` and `compile_s` (XLA backend
compiles in this process, as `jax.monitoring` reports them). CPU time is what a loaded machine
distorts least, so profiles taken beside other work still rank the tests rightly.

    XLASERVE_SUITE_PROFILE=/tmp/prof python -m pytest -q -n 2 --dist loadgroup
    python tests/helpers/suite_profile.py /tmp/prof      # the ranking, by module and by test
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import pytest

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class SuiteProfile:
    def __init__(self, folder: str, worker: str):
        os.makedirs(folder, exist_ok=True)
        self._out = open(os.path.join(folder, f"{worker}.jsonl"), "a")
        self._compiles = 0
        self._compile_s = 0.0
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == _COMPILE_EVENT:
            self._compiles += 1
            self._compile_s += duration

    def _measure(self, item, phase: str):
        times, wall = os.times(), time.perf_counter()
        compiles, compile_s = self._compiles, self._compile_s
        yield
        after = os.times()
        cpu = sum(after[:4]) - sum(times[:4])
        record = {
            "nodeid": item.nodeid,
            "phase": phase,
            "wall_s": round(time.perf_counter() - wall, 3),
            "cpu_s": round(cpu, 3),
            "compiles": self._compiles - compiles,
            "compile_s": round(self._compile_s - compile_s, 3),
        }
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._measure(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._measure(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._measure(item, "teardown")


def log_compiled_modules(folder: str) -> None:
    """With XLASERVE_SUITE_PROFILE_HLO=1 too: one line per XLA compile in this process, in
    `<folder>/hlo-<pid>.jsonl`, with a digest of the module's text, its name, its device count and its
    compile time, so that `report` can say how much compile time went to programs compiled before."""
    import hashlib

    from jax._src import compiler

    original = compiler.backend_compile_and_load
    out = open(os.path.join(folder, f"hlo-{os.getpid()}.jsonl"), "a")

    def logged(backend, module, executable_devices, options, host_callbacks):
        t0 = time.perf_counter()
        result = original(backend, module, executable_devices, options, host_callbacks)
        text = module.operation.get_asm(enable_debug_info=False)
        record = {
            "hash": hashlib.sha256(f"{len(executable_devices)}|{text}".encode()).hexdigest()[:16],
            "name": str(module.operation.attributes["sym_name"]).strip('"'),
            "devices": len(executable_devices),
            "s": round(time.perf_counter() - t0, 3),
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        return result

    compiler.backend_compile_and_load = logged


def register(config) -> None:
    folder = os.environ.get("XLASERVE_SUITE_PROFILE")
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        config.pluginmanager.register(SuiteProfile(folder, worker), "xlaserve-suite-profile")
        if os.environ.get("XLASERVE_SUITE_PROFILE_HLO"):
            log_compiled_modules(folder)


def report(folder: str, top: int = 40) -> str:
    """The modules and tests ranked by CPU time, with their compile counts and seconds."""
    by_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    by_test: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for name in sorted(os.listdir(folder)):
        if name.startswith("hlo-"):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                r = json.loads(line)
                for key, table in ((r["nodeid"].split("::", 1)[0], by_module), (r["nodeid"], by_test)):
                    row = table[key]
                    row[0] += r["wall_s"]
                    row[1] += r["cpu_s"]
                    row[2] += r["compiles"]
                    row[3] += r["compile_s"]
    lines = []
    for title, table in (("modules", by_module), ("tests", by_test)):
        total = [sum(row[i] for row in table.values()) for i in range(4)]
        lines.append(
            f"== {title} by CPU time (total: wall {total[0] / 60:.1f} min, CPU {total[1] / 60:.1f} min, "
            f"{int(total[2])} compiles taking {total[3] / 60:.1f} min)"
        )
        lines.append(f"{'cpu_s':>8} {'wall_s':>8} {'compiles':>8} {'compile_s':>9}  name")
        for key, row in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"{row[1]:8.1f} {row[0]:8.1f} {int(row[2]):8d} {row[3]:9.1f}  {key}")
    return "\n".join(lines + _repeated_compiles(folder))


def _repeated_compiles(folder: str) -> list[str]:
    """The compiles of a module already compiled elsewhere in the run (same text, same device count):
    what a store keyed by the program's text would have loaded instead."""
    seen: dict[str, int] = defaultdict(int)
    repeat_s: dict[str, float] = defaultdict(float)
    total, total_s, repeats, saved_s = 0, 0.0, 0, 0.0
    for name in sorted(os.listdir(folder)):
        if not name.startswith("hlo-"):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                r = json.loads(line)
                total, total_s = total + 1, total_s + r["s"]
                if seen[r["hash"]]:
                    repeats, saved_s = repeats + 1, saved_s + r["s"]
                    repeat_s[r["name"]] += r["s"]
                seen[r["hash"]] += 1
    if not total:
        return []
    lines = [
        f"== repeated compiles: {repeats} of {total} compiles ({saved_s / 60:.1f} of {total_s / 60:.1f} min) "
        "compiled a module's text compiled before in the run; by program name:"
    ]
    for name, s in sorted(repeat_s.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"{s:8.1f}  {name}")
    return lines


if __name__ == "__main__":
    print(report(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
