"""Headless Chromium driven over the DevTools protocol (CDP), for the playground's browser test.

Debian's `chromium` package is the browser (.ci/run installs it where it can); without one the test
skips. The protocol is JSON over one WebSocket: a command is {"id", "method", "params"} and its answer
the message with the same id; events in between are ignored.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest

_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_path() -> str | None:
    return next(filter(None, map(shutil.which, _NAMES)), None)


class Chromium:
    """One headless browser with one page; `command(method, **params)` runs a CDP command on the page."""

    def __init__(self, user_data_dir: str, timeout_s: float = 60.0):
        from websockets.sync.client import connect

        path = chromium_path()
        if path is None:
            pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [
                path,
                "--headless=new",
                "--no-sandbox",  # root in a container has no user namespace for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={user_data_dir}",
                "--window-size=1200,800",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = self._devtools_port()
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        self._ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self._ids = itertools.count(1)

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if match:
                return int(match.group(1))
        self.close()
        pytest.fail("Chromium did not open its DevTools port")

    def command(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        self._ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=self.timeout_s))
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.command(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float | None = None):
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {expression}")

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.command(
                "Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13
            )

    def screenshot(self, path: str) -> bytes:
        data = base64.b64decode(self.command("Page.captureScreenshot", format="png")["data"])
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return data

    def close(self) -> None:
        ws = getattr(self, "_ws", None)
        if ws is not None:
            ws.close()
        self.proc.kill()
        self.proc.wait()
