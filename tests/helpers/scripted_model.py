"""A tiny Llama whose greedy answer is a script: for tests of what the server does with a model's text
(a family's chat format through its tool-call or reasoning parser, speculation, priority, data
parallelism) that a random model cannot be made to write.

How it answers: its attention and MLP outputs are zero (`o_proj`, `down_proj`), so a position's final
hidden state is its own token's embedding, normalized. The LM head's row of token `u` is the unit
embedding of the token before `u` in the script, scaled, and every other row is zero: the greedy next
token is a function of the current token alone, a chain from the generation prompt's last token
through the script's pieces to EOS. Each piece is one token of the vocabulary (an added token, so it
decodes as its own text; a special token when the family's format says so), so a piece may occur only
once in the script.
"""

from __future__ import annotations

import os

import numpy as np

from helpers.tiny_models import small_byte_tokenizer

# The head's scale: the script's next token scores 4 * sqrt(hidden) (32 at hidden 64) and any other
# at most ~0.5 of it (random unit vectors in 64 dimensions), so bfloat16 keeps the order.
_HEAD_SCALE = 4.0
_EXAMPLE = [{"role": "user", "content": "hi"}]


def save_scripted_llama(
    directory: str,
    *,
    chat_template: str,
    answer: list[str],
    special_tokens: list[str] = (),
    added_tokens: list[str] = (),
    bos_token: str | None = None,
    hidden_size: int = 64,
    seed: int = 0,
) -> str:
    """Write the model, its tokenizer (a small byte-level BPE plus `special_tokens` and the answer's
    pieces; `added_tokens`: more tokens that decode as text, like DeepSeek's <think>) and
    `chat_template` to `directory`. Its greedy answer to any chat rendered by the template
    is the concatenation of `answer`, then EOS."""
    import torch
    import transformers

    tokenizer = small_byte_tokenizer()
    specials = list(special_tokens) + ([bos_token] if bos_token else [])
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    if bos_token:
        tokenizer.bos_token = bos_token
    tokenizer.add_tokens([*added_tokens, *(piece for piece in answer if piece not in specials)])
    tokenizer.chat_template = chat_template

    ids = []
    for piece in answer:
        encoded = tokenizer.encode(piece, add_special_tokens=False)
        assert len(encoded) == 1, f"piece {piece!r} is not one token: {encoded}"
        ids.append(encoded[0])
    rendered = tokenizer.apply_chat_template(_EXAMPLE, add_generation_prompt=True, tokenize=False)
    start = tokenizer.encode(rendered, add_special_tokens=False)
    chain = [start[-1], *ids, tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), f"a token occurs twice in the chain {chain}"

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((len(tokenizer), hidden_size)).astype(np.float32)
    head = np.zeros_like(embed)
    for before, token in zip(chain, chain[1:]):
        head[token] = _HEAD_SCALE * embed[before] / np.linalg.norm(embed[before])
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.from_numpy(embed))
        model.lm_head.weight.copy_(torch.from_numpy(head))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
