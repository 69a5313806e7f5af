"""A real `xlaserve serve` subprocess on 127.0.0.1 for the server tests, and its session fixtures.

The server mirrors conftest's ENGINE_ARGS, so its shapes (and greedy outputs) match the shared
offline `llm`. Both servers of a session share a persistent XLA compilation cache, so the second
one starts faster than the first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.smollm2 import ENGINE_ARGS, smollm2_gguf_path
from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS

API_KEY = "sk-xlaserve-test"
MODEL_NAME = "smollm2"
STARTUP_TIMEOUT_S = 600  # compiles every bucket on a shared 2-core machine
STOP_TIMEOUT_S = 60
# The session server's Responses API store: small, so a test can fill it.
MAX_STORED_RESPONSES = 12
# Flags of the session's server beyond the engine's: tool calls read in hermes' format (SmolLM2 writes
# a list of calls between <tool_call> tags); GET /tokenizer_info served; usage with its prompt tokens'
# prefix-cache hit. It serves gRPC too (its port: ServerProcess.grpc_port).
SESSION_SERVER_FLAGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--max-stored-responses",
    str(MAX_STORED_RESPONSES),
    "--enable-tokenizer-info-endpoint",
    "--enable-prompt-tokens-details",
]


def engine_flags(tiny: bool = False) -> list[str]:
    """ENGINE_ARGS as `xlaserve serve` flags. `tiny`: for a process of a tiny model, under
    TINY_PROCESS_XLA_FLAGS: without SmolLM2's optimization level, a compiler option of every program that
    would override their level 0 (test_serve_formats' four tiny servers: 96 -> 75 CPU s)."""
    flags = []
    for key, value in ENGINE_ARGS.items():
        if tiny and key == "optimization_level":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command() -> list[str]:
    script = shutil.which("xlaserve", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "xlaserve.entrypoints.cli"]


class ServerProcess:
    """`xlaserve serve` in a subprocess; its log goes to a file printed when a check fails."""

    def __init__(
        self,
        log_dir: str,
        cache_dir: str,
        extra_args: list[str] = (),
        api_key: str | None = None,
        model: str = MODEL_NAME,
        env: dict[str, str] | None = None,
        grpc: bool = False,
        ca_cert: str | None = None,
    ):
        """`ca_cert`: the server speaks HTTPS (its --ssl-* flags in `extra_args`) with a certificate this
        CA file vouches for; `verify` is then what httpx clients pass."""
        self.port = _free_port()
        self.grpc_port = _free_port() if grpc else None
        self.url = f"{'http' if ca_cert is None else 'https'}://127.0.0.1:{self.port}"
        self.verify = True if ca_cert is None else ssl.create_default_context(cafile=ca_cert)
        self.api_key = api_key
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        command = [
            *_command(),
            "serve",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            *engine_flags(tiny=TINY_PROCESS_XLA_FLAGS in (env or {}).get("XLA_FLAGS", "")),
            *extra_args,
        ]
        if api_key:
            command += ["--api-key", api_key]
        if self.grpc_port is not None:
            command += ["--grpc-port", str(self.grpc_port)]
        env = {
            **os.environ,
            **(env or {}),
            "XLASERVE_COMPILATION_CACHE_DIR": cache_dir,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("XLASERVE_API_KEY", None)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-num_chars:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"the server did not start within {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def core_pid(self) -> int | None:
        """The engine core process: the server's child started by multiprocessing's spawn."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                    children = [int(pid) for pid in f.read().split()]
            except FileNotFoundError:  # the thread ended since the listing
                continue
            for pid in children:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        if b"spawn_main" in cmdline.read():
                            return pid
                except FileNotFoundError:
                    continue
        return None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send `sig` and wait for the exit code (killing it if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, just not yet reaped
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def running_server(log_dir: str, cache_dir: str, **kwargs):
    """A started ServerProcess (kwargs as its own); on exit SIGTERM must stop it with code 0."""
    proc = ServerProcess(log_dir, cache_dir, **kwargs)
    proc.wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} on SIGTERM:\n{proc.log_tail()}"


@pytest.fixture(scope="session")
def server_cache_dir() -> str:
    """The servers' compilation cache and program store: the suite's own (XLASERVE_CACHE_ROOT, set once
    by conftest before the xdist workers start, so both workers share it). A server whose programs
    another server (or an in-process engine of the same settings) already built, on either worker,
    loads them instead of compiling them again: SmolLM2's 24 programs in ~1 s instead of ~25 s."""
    smollm2_gguf_path()  # skips the server tests when the embedded model is not installed
    from xlaserve.config import default_compilation_cache_dir

    return default_compilation_cache_dir()


@pytest.fixture(scope="session")
def mcp_tool_server():
    """An MCP server the session's server may call (--tool-server), started before it."""
    from helpers.mcp_server import ToolServer

    tool_server = ToolServer()
    yield tool_server
    tool_server.stop()


@pytest.fixture(scope="session")
def dead_tool_server_address() -> str:
    """A --tool-server entry of the session's server where nothing listens."""
    from helpers.mcp_server import free_port

    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="session")
def server(tmp_path_factory, server_cache_dir, mcp_tool_server, dead_tool_server_address):
    """The session's server (with an API key); at teardown SIGTERM must stop it and its core cleanly."""
    # Runtime LoRA updating on (LoRA itself off): the hostile-input suite reaches those endpoints too.
    tool_servers = ["--tool-server", f"{mcp_tool_server.address},{dead_tool_server_address}"]
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("server-logs")),
        server_cache_dir,
        extra_args=SESSION_SERVER_FLAGS + tool_servers,
        api_key=API_KEY,
        env={"XLASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        grpc=True,
    )
    proc.wait_ready()
    core_pid = proc.core_pid()
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} on SIGTERM:\n{proc.log_tail()}"
    assert core_pid is not None and not pid_alive(core_pid), "the engine core outlived the server"


POLL_DEADLINE_S = 60  # liveness bound for waiting on a metric, not a timing assertion


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples, name: str, **labels) -> float:
    return samples[("xlaserve:" + name, tuple(sorted(labels.items())))]


def wait_for_metrics(server, predicate, what: str) -> dict:
    deadline = time.monotonic() + POLL_DEADLINE_S
    while True:
        samples = metrics(server)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {POLL_DEADLINE_S}s; last /metrics: {samples}")
        time.sleep(0.2)
