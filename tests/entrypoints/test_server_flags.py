"""`xlaserve serve`'s vLLM flags of how it answers: --tokenizer (a tokenizer class shipped as code, run
by --trust-remote-code), --tokenizer-mode, the --ssl-* flags, --root-path, --response-role,
--enable-prompt-tokens-details, --enable-force-include-usage, --enable-request-id-headers (and a body's
request_id), --enable-server-load-tracking (GET /load) and --max-log-len. One server carries them all,
over HTTPS with a certificate made here; bad TLS files fail the start before any engine does."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re
import time

import httpx
import openai
import pytest

from helpers.server_harness import MODEL_NAME, ServerProcess
from xlaserve.entrypoints.cli import main
from xlaserve.models.tokenizer import load_tokenizer

API_KEY = "sk-flags"
ROOT_PATH = "/proxy"
ROLE = "bot"
EXTRA_TOKEN = "<|xlaserve_extra|>"  # the --tokenizer copy's one difference from the model's
MAX_LOG_LEN = 12
# The --tokenizer copy's class, shipped beside it as code (tokenizer_config.json's auto_map).
REMOTE_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class RemoteTokenizer(PreTrainedTokenizerFast):
    pass
"""
BLOCK_SIZE = 16  # the engine's default
DEADLINE_S = 30  # liveness bound when polling, not a timing assertion


def _write_self_signed(directory) -> tuple[str, str]:
    """A key and a self-signed certificate for 127.0.0.1, as PEM files (key path, certificate path)."""
    x509 = pytest.importorskip(
        "cryptography.x509", reason="TLS tests make their certificate with cryptography"
    )
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    return _write_self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """The model's tokenizer with one special token more, and the directory it is saved in, whose
    tokenizer class is code the directory ships: only --trust-remote-code loads it."""
    tokenizer = load_tokenizer(MODEL_NAME)
    tokenizer.add_special_tokens({"additional_special_tokens": [EXTRA_TOKEN]})
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    (path / "remote_tokenizer.py").write_text(REMOTE_TOKENIZER)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings |= {
        "tokenizer_class": "RemoteTokenizer",
        "auto_map": {"AutoTokenizer": [None, "remote_tokenizer.RemoteTokenizer"]},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return tokenizer, str(path)


@pytest.fixture(scope="module")
def flags_server(tmp_path_factory, server_cache_dir, tls_files, other_tokenizer):
    key, cert = tls_files
    flags = [
        "--tokenizer",
        other_tokenizer[1],
        "--trust-remote-code",
        "--tokenizer-mode",
        "hf",
        "--max-log-len",
        str(MAX_LOG_LEN),
        "--ssl-keyfile",
        key,
        "--ssl-certfile",
        cert,
        "--root-path",
        ROOT_PATH,
        "--response-role",
        ROLE,
        "--enable-prompt-tokens-details",
        "--enable-force-include-usage",
        "--enable-request-id-headers",
        "--enable-server-load-tracking",
    ]
    proc = ServerProcess(
        str(tmp_path_factory.mktemp("flags-server")),
        server_cache_dir,
        extra_args=flags,
        api_key=API_KEY,
        ca_cert=cert,
    )
    proc.wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, f"exit code {code} on SIGTERM:\n{proc.log_tail()}"


@pytest.fixture(scope="module")
def http(flags_server):
    with httpx.Client(
        base_url=flags_server.url, headers=flags_server.headers, verify=flags_server.verify, timeout=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def client(flags_server):
    """The official client, over an httpx client that trusts the server's certificate."""
    with httpx.Client(verify=flags_server.verify, timeout=120) as http_client:
        yield openai.OpenAI(
            base_url=flags_server.url + "/v1", api_key=API_KEY, max_retries=0, http_client=http_client
        )


def test_chat_role_cached_tokens_and_request_id(flags_server, client, http, other_tokenizer):
    messages = [{"role": "user", "content": "Count the colours of the rainbow, one per line, please. " * 4}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=1,
        extra_headers={"X-Request-Id": "trace-42"},
        extra_body={"request_id": "from-the-body"},  # the header wins, as in vLLM
    )
    assert first.headers["x-request-id"] == "trace-42"
    answer = first.parse()
    assert answer.id == "chatcmpl-trace-42"  # vLLM's: the sent id, after the route's prefix
    assert answer.choices[0].message.role == ROLE
    # --max-log-len: the request's log line shows the first MAX_LOG_LEN ids of its prompt and their text.
    ids = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["tokens"]
    with open(flags_server.log_path, errors="replace") as f:
        logged = re.search(
            r"request chatcmpl-trace-42-\w{8}: .*, prompt: (.*), prompt_token_ids: (.*)\n", f.read()
        )
    assert logged is not None and json.loads(logged[2]) == ids[:MAX_LOG_LEN]
    assert logged[1] == repr(other_tokenizer[0].decode(ids[:MAX_LOG_LEN])[:MAX_LOG_LEN])
    # The same prompt again: every full block of it but the last token's comes from the prefix cache.
    # Without the header, the body's request_id names the answer (the response's header is a new id).
    again = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, extra_body={"request_id": "body-7"}
    )
    assert re.fullmatch(r"[0-9a-f]{32}", again.headers["x-request-id"])  # none sent: a new one
    assert again.parse().id == "chatcmpl-body-7"
    usage = again.parse().usage
    assert usage.prompt_tokens == answer.usage.prompt_tokens > BLOCK_SIZE
    cached = (usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens == cached
    # Without a generation prompt the answer continues the last message, in that message's role.
    continued = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    assert continued.choices[0].message.role == "user"


def test_a_responses_request_id_is_its_header_under_the_flag(http):
    """--enable-request-id-headers keeps the Responses route's own X-Request-Id, the body's request_id
    (its only echo: the response's id is the store's), over a new one; a header sent still wins."""
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 1, "store": False}
    answer = http.post("/v1/responses", json={**body, "request_id": "body-3"})
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "body-3", answer.text
    assert answer.json()["id"].startswith("resp_")
    sent = http.post(
        "/v1/responses", json={**body, "request_id": "body-3"}, headers={"X-Request-Id": "hdr-4"}
    )
    assert sent.headers["x-request-id"] == "hdr-4"
    assert re.fullmatch(r"[0-9a-f]{32}", http.post("/v1/responses", json=body).headers["x-request-id"])


def test_streams_end_with_usage_and_count_in_the_load(http):
    assert http.get("/load").json() == {"server_load": 0}
    body = {"model": MODEL_NAME, "prompt": "One, two, three,", "max_tokens": 6, "stream": True}
    body |= {"ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert http.get("/load").json() == {"server_load": 1}  # in flight until its last event
        data = [first] + [line for line in events if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    usage = json.loads(data[-2].removeprefix("data: "))["usage"]
    prompt = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": body["prompt"]}).json()["count"]
    assert usage["prompt_tokens"] == prompt and usage["completion_tokens"] == 6
    assert "cached_tokens" in usage["prompt_tokens_details"]
    deadline = time.monotonic() + DEADLINE_S
    while http.get("/load").json()["server_load"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}


def test_requests_in_flight_may_send_the_same_id(http):
    """Two completions with one X-Request-Id, the first still streaming: both run, both answer with
    that id (the engine's ids for them differ)."""
    headers = {"X-Request-Id": "twice"}
    # The first runs on while the second is answered (it is left, aborted, after that); its events are
    # read from one iterator held open: a dropped one would close the stream.
    body = {"model": MODEL_NAME, "prompt": "One, two, three,", "max_tokens": 400, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        events = response.iter_lines()
        first = next(line for line in events if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["id"] == "cmpl-twice"
        again = http.post("/v1/completions", json={**body, "max_tokens": 1}, headers=headers)
        assert again.status_code == 200, again.text
        assert again.json()["id"] == "cmpl-twice"
    # An id the engine's (and a disaggregated prefill's) bounds could not take: a 400 naming the header.
    for bad in ("r" * 129, "tab\there"):
        refused = http.post("/v1/completions", json={**body, "max_tokens": 1}, headers={"X-Request-Id": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Request-Id", refused.text
        # The body's request_id (vLLM's field) has the header's bounds.
        refused = http.post("/v1/completions", json={**body, "max_tokens": 1, "request_id": bad})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "request_id", refused.text
        assert "request_id must be 1 to 128 printable ASCII characters" in error["message"]


def test_root_path_in_the_schema_and_docs_and_behind_the_key(flags_server, http):
    assert http.get("/openapi.json").json()["servers"] == [{"url": ROOT_PATH}]
    assert f"'{ROOT_PATH}/openapi.json'" in http.get("/docs").text
    # The prefix left in a path routes as the path without it: the API key is asked for there too. The
    # guard's own answer carries the request's id, whatever bytes a header may hold.
    odd_id = b"\xff\x01 " + b"r" * 4000
    refused = httpx.get(
        flags_server.url + ROOT_PATH + "/v1/models",
        headers={"X-Request-Id": odd_id},
        verify=flags_server.verify,
    )
    assert refused.status_code == 401 and (b"x-request-id", odd_id) in refused.headers.raw
    assert http.get(ROOT_PATH + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
    # The playground page calls the routes under the prefix.
    assert f'<body data-root-path="{ROOT_PATH}">' in http.get(ROOT_PATH + "/").text


def test_the_tokenizer_flag_tokenizes_with_the_other_tokenizer(http, other_tokenizer):
    tokenizer, path = other_tokenizer
    # The server loaded it (front end and core): its class is code only --trust-remote-code runs.
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_tokenizer(path)
    assert type(load_tokenizer(path, trust_remote_code=True)).__name__ == "RemoteTokenizer"
    text = f"Hello {EXTRA_TOKEN} world"
    ours = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids(EXTRA_TOKEN) in ours  # one token, not the model's pieces
    body = {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False}
    assert http.post("/tokenize", json=body).json()["tokens"] == ours
    # Its id is past the model's vocabulary: a prompt holding it is refused, naming the prompt.
    refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": text, "max_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"


def test_bad_tls_files_fail_before_an_engine_starts(tmp_path, tls_files, capsys):
    key, cert = tls_files
    missing = str(tmp_path / "missing.pem")
    assert main(["serve", "--ssl-keyfile", missing, "--ssl-certfile", cert]) == 2
    assert f"--ssl-keyfile: cannot read {missing!r}: No such file or directory" in capsys.readouterr().err
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    assert main(["serve", "--ssl-keyfile", key, "--ssl-certfile", str(garbage)]) == 2
    assert "--ssl-certfile and --ssl-keyfile: not a PEM certificate chain" in capsys.readouterr().err
    assert main(["serve", "--ssl-ca-certs", cert]) == 2
    assert "--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile" in capsys.readouterr().err


def test_bad_log_flags_exit_2_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--max-log-len", "-1"])
    assert exited.value.code == 2
    assert "--max-log-len takes an integer >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--enable-log-requests", "--disable-log-requests"])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
