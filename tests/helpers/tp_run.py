"""One long-lived subprocess with 8 fake CPU devices (the device count is fixed when jax starts) that
runs the cases of tests/helpers/tp_worker.py, and its session fixture `tp_worker`.

jax and xlaserve import once per session instead of once per case, and the worker's in-process
compilation caches carry from one case to the next. A case that raises comes back as an assertion
failure with its traceback, and the worker goes on serving; a case past its timeout kills the worker,
and the next case starts a fresh one."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")
CASE_TIMEOUT_S = 600  # the first case also pays for jax's import, on a shared 2-core machine


class TPWorker:
    """The client of one tp_worker.py process: `run(mode, model_dir, arg)` returns the case's result."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._num_requests = 0
        fd, self._log_path = tempfile.mkstemp(prefix="tp-worker-", suffix=".log")
        os.close(fd)

    def _start(self) -> None:
        env = dict(os.environ, XLA_FLAGS="")  # the worker sets its own (tp_worker.py)
        # stderr goes to a file in append mode: it never fills up and blocks the worker, and the
        # tail written during one case can be read back for its failure message.
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc.stdout, self._replies), daemon=True).start()

    @staticmethod
    def _read(stdout, replies: queue.Queue) -> None:
        for line in stdout:
            replies.put(line)
        replies.put(None)  # the worker exited

    def _log_since(self, offset: int) -> str:
        with open(self._log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()[-4000:]

    def run(self, mode: str, model_dir: str, arg, timeout_s: float = CASE_TIMEOUT_S) -> object:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self._num_requests += 1
        request_id = self._num_requests
        log_offset = os.path.getsize(self._log_path)
        request = {"id": request_id, "mode": mode, "model_dir": model_dir, "arg": arg}
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.close(kill=True)  # still busy with the case: it would not read the end of its input
            raise AssertionError(
                f"{mode}: no result in {timeout_s} s\n{self._log_since(log_offset)}"
            ) from None
        except BrokenPipeError:
            line = None
        if line is None:
            self._proc.wait()
            raise AssertionError(
                f"{mode}: the worker exited ({self._proc.returncode})\n{self._log_since(log_offset)}"
            )
        tag, reply_id, body = line.split(" ", 2)
        assert (tag, int(reply_id)) == ("RESULT", request_id), line[:200]
        reply = json.loads(body)
        assert "error" not in reply, f"{mode} raised in the worker:\n{reply['error']}"
        return reply["ok"]

    def close(self, kill: bool = False) -> None:
        if self._proc is not None and self._proc.poll() is None:
            if not kill:
                self._proc.stdin.close()  # end of input: the worker returns
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    kill = True
            if kill:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def remove_log(self) -> None:
        os.remove(self._log_path)


@pytest.fixture(scope="session")
def tp_worker():
    worker = TPWorker()
    yield worker
    worker.close()
    worker.remove_log()


# The tiny models that several fake-mesh modules load, written once per session.


@pytest.fixture(scope="session")
def tiny_llama_2kv(tmp_path_factory) -> str:
    """8 query heads over 2 KV heads: tensor parallel 4 and 8 replicate the KV heads, as vLLM does."""
    from helpers.tiny_models import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_2kv")), num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny_llama_257(tmp_path_factory) -> str:
    """A vocabulary of 257 tokens: TP 2 pads it to 320, 63 padding ids whose (zero) logits would be
    sampled if unmasked."""
    from helpers.tiny_models import save_tiny_llama

    return save_tiny_llama(
        str(tmp_path_factory.mktemp("tiny_llama_257")), vocab_size=257, num_key_value_heads=2
    )
