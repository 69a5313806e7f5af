"""Speculative decoding under tensor parallelism, on fake CPU devices (the session's worker process,
helpers/tp_run.py): with n-gram drafts and with a draft model (the target itself, placed on the same
mesh), greedy outputs equal the single-device engine's without speculation, token for token; the
verifier runs on the vocab-sharded logits."""

from __future__ import annotations

import numpy as np

from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}


def test_speculation_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path):
    # 8 query heads, 2 KV heads; a 320-token vocabulary keeps every program small.
    model_dir = save_tiny_llama(str(tmp_path), tokenizer=small_byte_tokenizer(), num_key_value_heads=2)
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 320, 5).tolist()
    prompts = [phrase * 4, rng.integers(3, 320, 12).tolist() + phrase * 2, rng.integers(3, 320, 20).tolist()]
    layouts = [
        {},
        {"tensor_parallel_size": 2, "speculative_config": NGRAM},
        {"tensor_parallel_size": 4, "speculative_config": DRAFT},
    ]
    base, ngram, draft = tp_worker.run(
        "speculative", model_dir, {"layouts": layouts, "prompts": prompts, "max_tokens": 24}
    )
    assert [r["num_devices"] for r in (base, ngram, draft)] == [1, 2, 4]
    assert ngram["tokens"] == base["tokens"]
    assert draft["tokens"] == base["tokens"]
    assert 0 < ngram["metrics"]["num_accepted_tokens"] <= ngram["metrics"]["num_draft_tokens"]
    # The target as its own draft: every greedy draft is the target's argmax, so every one is accepted.
    assert draft["metrics"]["num_accepted_tokens"] == draft["metrics"]["num_draft_tokens"] > 0
