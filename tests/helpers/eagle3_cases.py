"""Tiny EAGLE-3 checkpoints (config.json and model.safetensors as the releases ship them:
`LlamaForCausalLMEagle3`, `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) over a tiny Llama target,
and the drafts such a checkpoint proposes, computed in torch from Hugging Face's Llama modules wired as
vLLM's llama_eagle3 wires them (helpers/mtp_cases.py's chain)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from helpers.family_cases import BASE
from helpers.mtp_cases import chain_drafts

# The draft: narrower than the target (fc takes 3 * 48 to 32), its own embedding, 64 of the 101 ids.
DRAFT = dict(
    BASE,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=5000.0,
    draft_vocab_size=64,
    target_hidden_size=BASE["hidden_size"],
)


def _write(directory, config: dict, tensors: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **config}, f)
    tensors = {n: t.contiguous() for n, t in tensors.items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def _maps(draft_ids: torch.Tensor, vocab: int) -> dict:
    """`d2t` (offsets: target id = draft id + d2t) and `t2d` (which target ids the draft names)."""
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}


def save_random_eagle3(directory, seed: int = 1, **overrides) -> tuple[str, dict]:
    """A random EAGLE-3 checkpoint for BASE's Llama (DRAFT's sizes) -> (path, its tensors)."""
    config = {**DRAFT, **overrides}
    d, t, f = config["hidden_size"], config["target_hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def norm(n):
        return 1.0 + randn(n, scale=0.2)

    layer = {
        "input_layernorm.weight": norm(d),
        "hidden_norm.weight": norm(d),
        "self_attn.q_proj.weight": randn(heads * hd, 2 * d),
        "self_attn.k_proj.weight": randn(kv * hd, 2 * d),
        "self_attn.v_proj.weight": randn(kv * hd, 2 * d),
        "self_attn.o_proj.weight": randn(d, heads * hd),
        "post_attention_layernorm.weight": norm(d),
        "mlp.gate_proj.weight": randn(f, d),
        "mlp.up_proj.weight": randn(f, d),
        "mlp.down_proj.weight": randn(d, f),
    }
    draft_ids = torch.randperm(config["vocab_size"], generator=g)[: config["draft_vocab_size"]].sort().values
    tensors = {
        "fc.weight": randn(d, 3 * t, scale=0.1),
        "embed_tokens.weight": randn(config["vocab_size"], d, scale=1.0),
        **{f"midlayer.{n}": w for n, w in layer.items()},
        "norm.weight": norm(d),
        "lm_head.weight": randn(config["draft_vocab_size"], d),
        **_maps(draft_ids, config["vocab_size"]),
    }
    return _write(directory, config, tensors), tensors


def save_echo_eagle3(directory, target_dir: str, draft_vocab_size: int | None = None, seed: int = 1) -> str:
    """An EAGLE-3 checkpoint for the tiny Llama at `target_dir` whose drafts are often accepted on the
    repetitive text a tiny model generates: at position i it drafts the token at i (right for a token
    repeated, and as the first draft in a two-token cycle), read off its aux input from layer 0, the
    target's embedding of that token. `fc` passes that third through to a layer of the target's width
    whose attention and MLP add a little (their weights still split under tensor parallelism); the LM
    head's rows are the normalized embedding rows of `draft_vocab_size` shuffled target ids (None: all),
    which `d2t` maps back (a draft vocabulary that a tensor-parallel split pads: sharding/vocab.py)."""
    from safetensors.torch import load_file

    embedding = load_file(os.path.join(target_dir, "model.safetensors"))["model.embed_tokens.weight"]
    vocab, width = embedding.shape
    draft_vocab_size = draft_vocab_size or vocab
    with open(os.path.join(target_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    config = dict(
        DRAFT,
        vocab_size=vocab,
        hidden_size=width,
        target_hidden_size=width,
        draft_vocab_size=draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=[0, layers // 2, layers - 1],
    )
    _, tensors = save_random_eagle3(directory, seed, **config)
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(vocab, generator=g)[:draft_vocab_size]  # draft id j names draft_ids[j]
    tensors["fc.weight"] = torch.cat([torch.eye(width), torch.zeros(width, 2 * width)], dim=1)
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        tensors[name] = tensors[name] * 1e-4
    tensors["norm.weight"] = torch.ones(width)  # its output keeps the direction the head compares
    tensors["lm_head.weight"] = torch.nn.functional.normalize(embedding[draft_ids], dim=-1)
    return _write(directory, config, tensors | _maps(draft_ids, vocab))


def as_speculators(
    released: str, directory, tensors: dict, speculative_tokens: int, verifier: str = "tiny-llama"
) -> str:
    """The released checkpoint at `released` rewritten as Red Hat's `speculators` library writes EAGLE-3
    (vLLM reads both): the layer's config nested in `transformer_layer_config`, the proposal's length in
    `speculators_config` with its `verifier` (the target), the layer as `layers.0.*`; norm_before_residual
    left to its default (True)."""
    with open(os.path.join(released, "config.json")) as f:
        config = json.load(f)
    top = ("draft_vocab_size", "target_hidden_size")
    layer = {k: v for k, v in config.items() if k not in top} | {"architectures": ["LlamaForCausalLM"]}
    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **{k: config[k] for k in top},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        },
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(speculators, f)
    renamed = {n.replace("midlayer.", "layers.0.", 1): t.contiguous() for n, t in tensors.items()}
    save_file(renamed, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@torch.no_grad()
def eagle3_drafts(
    hf, tensors: dict, seq: list[int], steps: list[int], k: int, norm_before_residual: bool = False
) -> list[list[int]]:
    """For each p of `steps`, the k greedy drafts proposed once the token at position p of `seq` is
    emitted (helpers/mtp_cases.py `hf_drafts`' contract), float32: the target's aux hidden states (the
    residual stream entering layers 2, L // 2 and L - 3: Hugging Face's `output_hidden_states`) through
    `fc` for the sequence's rows; each further draft reads the layer's pre-norm output before it.
    `norm_before_residual`: the layer's residual is its normed hidden input (vLLM's llama_eagle3)."""
    config = LlamaConfig(**{**DRAFT, "attn_implementation": "eager"})
    num_layers = hf.config.num_hidden_layers
    n = len(seq) - 1
    states = hf.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    ids = sorted((2, num_layers // 2, num_layers - 3))
    aux = torch.cat([states[i][0, :n] for i in ids], dim=-1)
    hidden = aux @ tensors["fc.weight"].T

    def module(m, prefix):
        m.load_state_dict({n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)})
        return m.eval()

    attn = LlamaAttention(config, layer_idx=0)
    for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding | hidden state]: 2H
        setattr(
            attn, name, torch.nn.Linear(2 * config.hidden_size, getattr(attn, name).out_features, bias=False)
        )
    attn = module(attn, "midlayer.self_attn.")
    mlp = module(LlamaMLP(config), "midlayer.mlp.")
    norms = {
        name: module(LlamaRMSNorm(config.hidden_size, config.rms_norm_eps), f"{prefix}.")
        for name, prefix in [
            ("input", "midlayer.input_layernorm"),
            ("hidden", "midlayer.hidden_norm"),
            ("post", "midlayer.post_attention_layernorm"),
            ("final", "norm"),
        ]
    }
    rotary = LlamaRotaryEmbedding(config)
    targets = torch.arange(config.draft_vocab_size) + tensors["d2t"]

    def run(ids, rows, positions, mask):
        x = torch.cat([norms["input"](tensors["embed_tokens.weight"][ids]), norms["hidden"](rows)], dim=-1)
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]
        h, _ = attn(x[None], rotary(x[None], positions[None]), bias)
        h = (norms["hidden"](rows) if norm_before_residual else rows) + h[0]
        out = h + mlp(norms["post"](h))
        logits = norms["final"](out) @ tensors["lm_head.weight"].T
        return targets[logits.argmax(-1)].tolist(), out

    return chain_drafts(run, list(seq[1:]), hidden, torch.arange(n), steps, k)
