"""Multi-LoRA through the real server: a tiny random Llama served with --enable-lora, two adapters
from --lora-modules (both of vLLM's forms) and a third loaded and unloaded at run time.

Each adapter's greedy tokens equal PEFT's; /v1/models lists the adapters with the base model as
parent; an unknown or unloaded adapter is a 404; three adapters wanted at once with two slots are
spread over steps with nothing lost; no prefix-cache block is shared across adapters; and the strict
compile guard stays silent throughout (a compile after warm-up would fail a request).
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from helpers.family_cases import make_hf_model, save_hf_model
from helpers.lora_adapters import make_adapter
from helpers.server_harness import ServerProcess
from helpers.tiny_models import TINY_PROCESS_ENV

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")


BASE_NAME = "tiny-llama"
NUM_TOKENS = 6
# Two full blocks of 16 tokens, shared by every request: what the prefix cache could share.
PROMPT = [5 + (i * 7) % 90 for i in range(40)]
ADAPTERS = [
    (4, 8, False, ["q_proj", "v_proj", "down_proj"]),
    (8, 16, True, ["k_proj", "o_proj", "gate_proj"]),
]
ADAPTERS.append((2, 4, False, ["up_proj", "q_proj"]))


def greedy(model, ids) -> list[int]:
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            tokens.append(int(torch.argmax(model(input_ids=torch.tensor([tokens])).logits[0, -1])))
    return tokens[len(ids) :]


pytestmark = pytest.mark.slow  # a server of its own: its warm-up compiles every bucket


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, server_cache_dir):
    root = tmp_path_factory.mktemp("lora-server")
    base = make_hf_model("LlamaForCausalLM", seed=11, max_position_embeddings=512)
    directory = save_hf_model(base, root / "base")
    paths, references = [], {BASE_NAME: greedy(base, PROMPT)}
    torch.set_num_threads(1)
    for i, (rank, alpha, rslora, targets) in enumerate(ADAPTERS):
        paths.append(str(root / f"a{i}"))
        references[f"a{i}"] = greedy(
            make_adapter(base, rank, alpha, rslora, targets, paths[-1], seed=20 + i), PROMPT
        )
    assert len({tuple(r) for r in references.values()}) == 4  # every adapter changes the output
    flags = ["--served-model-name", BASE_NAME, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    # Buckets for these requests, not SmolLM2's (128 tokens, 16 sequences): token buckets 1, 4, 16 and
    # request buckets 1, 4, 8 (the eight concurrent requests below) leave half the programs to compile.
    flags += ["--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--enable-prompt-tokens-details"]
    flags += ["--lora-modules", f"a0={paths[0]}", json.dumps({"name": "a1", "path": paths[1]})]
    proc = ServerProcess(
        str(root),
        server_cache_dir,
        flags,
        model=directory,
        env={"XLASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", **TINY_PROCESS_ENV},
    )
    proc.wait_ready()
    with httpx.Client(base_url=proc.url, timeout=120) as client:
        yield client, proc, paths, references
    code = proc.stop()
    assert code == 0, proc.log_tail()
    assert "after warm-up" not in proc.log_tail(10**7), proc.log_tail()


def complete(client, model: str, prompt=PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
    return client.post("/v1/completions", json={**body, "logprobs": 0})


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    # The word tokenizer decodes id i to "wi" (no special ids among the greedy tokens here).
    return [int(t.strip()[1:]) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_adapters_match_peft_and_are_listed(lora_server):
    client, _, paths, references = lora_server
    for name in (BASE_NAME, "a0", "a1"):
        assert token_ids(complete(client, name)) == references[name], name
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(cards) == {BASE_NAME, "a0", "a1"}
    assert cards["a0"]["parent"] == BASE_NAME and cards["a1"]["root"] == paths[1]
    assert cards[BASE_NAME]["parent"] is None
    assert client.get("/v1/models/a1").json()["parent"] == BASE_NAME


def test_unknown_adapter_is_404(lora_server):
    client = lora_server[0]
    response = complete(client, "a9")
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_load_and_unload_at_run_time(lora_server):
    client, _, paths, references = lora_server
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": paths[2]})
    assert response.status_code == 200, response.text
    assert token_ids(complete(client, "a2")) == references["a2"]
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": paths[2]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = client.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths[2] + "-missing"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    assert complete(client, "a2").status_code == 404
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
    assert "a2" not in {card["id"] for card in client.get("/v1/models").json()["data"]}


def test_a_module_the_model_lacks_is_refused_when_loaded(lora_server, tmp_path):
    """A routed expert's projection (as older MoE adapters name them) on this dense model: a 400 at
    /v1/load_lora_adapter naming the module, checked against the engine's slots."""
    import numpy as np
    from safetensors.numpy import save_file

    client = lora_server[0]
    prefix = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    tensors = {f"{prefix}.lora_A.weight": np.zeros((4, 48), np.float32)}
    tensors[f"{prefix}.lora_B.weight"] = np.zeros((71, 4), np.float32)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["gate_proj"]}))
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "experts", "lora_path": str(tmp_path)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and "'mlp.experts.0.gate_proj' (layer 0)" in error["message"]
    assert "experts" not in {card["id"] for card in client.get("/v1/models").json()["data"]}


def test_more_adapters_than_slots_are_spread_over_steps(lora_server):
    """Three adapters and the base at once, two slots: every request gets its solo output."""
    client, _, paths, references = lora_server
    assert (
        client.post("/v1/load_lora_adapter", json={"lora_name": "b2", "lora_path": paths[2]}).status_code
        == 200
    )
    names = ["a0", "a1", "b2", BASE_NAME] * 2
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        responses = list(pool.map(lambda name: complete(client, name), names))
    for name, response in zip(names, responses):
        assert token_ids(response) == references["a2" if name == "b2" else name], name


def test_no_prefix_cache_block_is_shared_across_adapters(lora_server):
    client = lora_server[0]
    prompt = [7 + (i * 11) % 90 for i in range(40)]  # not seen before: nothing cached yet
    assert cached_tokens(complete(client, "a0", prompt)) == 0
    assert cached_tokens(complete(client, "a1", prompt)) == 0  # same tokens, another adapter
    assert cached_tokens(complete(client, BASE_NAME, prompt)) == 0
    assert cached_tokens(complete(client, "a0", prompt)) == 32  # its own blocks: two of 16
