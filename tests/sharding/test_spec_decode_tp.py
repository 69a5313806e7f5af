"""Speculative decoding under tensor parallelism, on fake CPU devices (the session's worker process,
helpers/tp_run.py): with n-gram drafts, a draft model (the target itself, placed on the same mesh), an
EAGLE-3 head and an MTP layer (both reading the target's hidden states, their weights split over the
target's ranks), greedy outputs equal the single-device engine's without speculation, token for token;
the verifier runs on the vocab-sharded logits."""

from __future__ import annotations

import numpy as np

from helpers.eagle3_cases import save_echo_eagle3
from helpers.mtp_cases import save_qwen3_5_with_mtp
from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
DRAFT = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}


def test_speculation_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path):
    # 8 query heads, 2 KV heads; a 300-token vocabulary keeps every program small (padded to 320 under
    # TP: the target's embedding and head, the EAGLE-3 layer's own embedding).
    model_dir = save_tiny_llama(str(tmp_path), tokenizer=small_byte_tokenizer(300), num_key_value_heads=2)
    # Its 4 query and 2 KV heads split over 2 ranks, and over 4 with KV heads repeated; 299 draft ids
    # padded to 320 to split.
    eagle3 = {
        "method": "eagle3",
        "model": save_echo_eagle3(tmp_path / "eagle3", model_dir, draft_vocab_size=299),
        "num_speculative_tokens": 3,
    }
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 300, 5).tolist()
    prompts = [phrase * 4, rng.integers(3, 300, 12).tolist() + phrase * 2, rng.integers(3, 300, 20).tolist()]
    layouts = [
        {},
        {"tensor_parallel_size": 2, "speculative_config": NGRAM},
        {"tensor_parallel_size": 4, "speculative_config": DRAFT},
        {"tensor_parallel_size": 2, "speculative_config": eagle3},
        {"tensor_parallel_size": 4, "speculative_config": eagle3},
    ]
    base, ngram, draft, eagle3_tp2, eagle3_tp4 = tp_worker.run(
        "speculative", model_dir, {"layouts": layouts, "prompts": prompts, "max_tokens": 24}
    )
    assert [r["num_devices"] for r in (base, ngram, draft, eagle3_tp2, eagle3_tp4)] == [1, 2, 4, 2, 4]
    for run in (ngram, draft, eagle3_tp2, eagle3_tp4):
        assert run["tokens"] == base["tokens"]
    assert 0 < ngram["metrics"]["num_accepted_tokens"] <= ngram["metrics"]["num_draft_tokens"]
    # The target as its own draft: every greedy draft is the target's argmax, so every one is accepted.
    assert draft["metrics"]["num_accepted_tokens"] == draft["metrics"]["num_draft_tokens"] > 0
    # The EAGLE-3 head drafts the same tokens however the ranks split it, and some are the target's.
    assert eagle3_tp2["metrics"] == eagle3_tp4["metrics"]
    assert 0 < eagle3_tp2["metrics"]["num_accepted_tokens"] < eagle3_tp2["metrics"]["num_draft_tokens"]
    # The target's 8 query heads split over 8 ranks; the head's 4 do not.
    refusal = tp_worker.run("error", model_dir, {"tensor_parallel_size": 8, "speculative_config": eagle3})
    assert refusal == (
        "speculative_config.model: the EAGLE-3 layer: tensor_parallel_size=8 must divide "
        "num_attention_heads=4"
    )


def test_mtp_layer_under_tensor_parallelism_matches_one_device(tp_worker, tmp_path):
    """A Qwen3.5 (hybrid: Gated DeltaNet and attention layers, split by head) whose MTP layer predicts
    the target (helpers/mtp_cases.py's oracle) at tensor_parallel_size=4 (its 2 KV heads repeated, the
    layer's with the target's; 4 linear key heads; TP 2's plain split is the EAGLE-3 case's): the layer,
    one of the target's attention layers, split as they are, drafts the target's own tokens, so every
    draft is accepted, and the output is the one-device engine's without speculation."""
    model_dir = save_qwen3_5_with_mtp(str(tmp_path), oracle=True, linear_num_key_heads=4)[0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 101, 15).tolist(), rng.integers(3, 101, 9).tolist()]
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    layouts = [{}, {"tensor_parallel_size": 4, "speculative_config": mtp}]
    base, run = tp_worker.run(
        "speculative", model_dir, {"layouts": layouts, "prompts": prompts, "max_tokens": 16}
    )
    assert run["num_devices"] == 4
    assert run["tokens"] == base["tokens"]
    assert run["metrics"]["num_accepted_tokens"] == run["metrics"]["num_draft_tokens"] > 0
