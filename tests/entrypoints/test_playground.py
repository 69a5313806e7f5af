"""The chat playground at GET / (the session's server), in headless Chromium over the DevTools protocol:
the page loads with no asset from another origin, shows the model's name once given the API key, and a
message typed and sent with Enter streams back (several updates) the same answer /v1/chat/completions
gives for the same conversation and settings; a screenshot of the page is saved."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from helpers.chromium import Chromium
from helpers.server_harness import MODEL_NAME

SYSTEM = "Answer briefly."
QUESTION = "What is 2+2?"
MAX_TOKENS = 24


def test_page_is_served_open_and_self_contained(server):
    response = httpx.get(server.url + "/", timeout=30)  # no API key: the page holds nothing
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    assert "http://" not in response.text and "https://" not in response.text  # no external assets


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = Chromium(str(tmp_path_factory.mktemp("chromium-profile")))
    yield chromium
    chromium.close()


def test_typed_message_streams_the_chat_routes_answer(server, browser, tmp_path):
    browser.command("Page.navigate", url=server.url + "/")
    browser.wait_for("document.readyState === 'complete' && document.body.dataset.state === 'idle'")
    assert browser.evaluate("document.getElementById('model-name').textContent") == "(API key needed)"
    set_value = (
        "(id, v) => { const e = document.getElementById(id); e.value = v; "
        "e.dispatchEvent(new Event('change')); }"
    )
    for element, value in (
        ("api-key", server.api_key),
        ("system", SYSTEM),
        ("temperature", "0"),
        ("max-tokens", str(MAX_TOKENS)),
    ):
        browser.evaluate(f"({set_value})({json.dumps(element)}, {json.dumps(value)})")
    assert browser.wait_for("document.getElementById('model-name').textContent === 'smollm2' && 'ok'") == "ok"
    # Count the answer bubble's updates: a streamed answer arrives in several.
    browser.evaluate(
        "window.updates = 0; new MutationObserver(() => window.updates++).observe("
        "document.getElementById('messages'), {childList: true, subtree: true, characterData: true}); true"
    )
    browser.evaluate("document.getElementById('prompt').focus()")
    browser.command("Input.insertText", text=QUESTION)
    browser.press_enter()
    browser.wait_for("document.body.dataset.state === 'streaming' || !!document.querySelector('.assistant')")
    browser.wait_for("document.body.dataset.state === 'idle' && !!document.querySelector('.assistant')", 120)
    shown = browser.evaluate(
        "[...document.querySelectorAll('.message')].map(m => [m.className, m.textContent])"
    )
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "temperature": 0,
        "top_p": 1,
        "max_tokens": MAX_TOKENS,
    }
    expected = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    answer = expected.json()["choices"][0]["message"]["content"]
    assert shown == [["message user", QUESTION], ["message assistant", answer]] and answer
    assert browser.evaluate("window.updates") > 2, "the answer did not stream"
    assert browser.evaluate("document.getElementById('prompt').value") == ""
    origins = browser.evaluate("performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
    assert set(origins) <= {server.url}
    folder = os.environ.get("XLASERVE_TEST_ARTIFACTS", str(tmp_path))
    png = browser.screenshot(os.path.join(folder, "playground.png"))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
