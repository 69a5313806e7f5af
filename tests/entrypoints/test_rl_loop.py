"""The research stack's RL loop (entrypoints/rl_loop.py) on a tiny random Llama: the trainer's pure-JAX
forward equals Hugging Face's; a short GRPO run raises the reward, the engine's sampled logprobs equal
the trainer's within LOGPROB_BOUND (float32 engine), and nothing compiles after the first iteration,
in the engine or in the trainer; with the engine asleep while the trainer steps, the run is the same."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from helpers.family_cases import hf_logits, make_hf_model, save_hf_model
from xlaserve import LLM
from xlaserve.entrypoints.rl_loop import LoopConfig, group_advantages, llama_logits, load_policy, run_rl_loop

ARGS = {
    "dtype": "float32",  # the trainer's dtype: the two forwards differ only in reduction order
    "max_model_len": 128,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "block_size": 8,
    "kv_cache_memory": 2**20,
    "enable_prefix_caching": True,
    "enforce_eager": False,
    "strict_compile_guard": True,
    "skip_tokenizer_init": True,
    # As RL trainers run vLLM: logprobs of the distribution sampled from (at the loop's temperature 1 with
    # no filter, the raw ones bit for bit: the trainer's checks below hold either way).
    "logprobs_mode": "processed_logprobs",
}
# float32 end to end: measured 2e-6 to 7e-6 over seeds 0-5 (the engine reduces in other orders).
LOGPROB_BOUND = 1e-3
FORWARD_TOLERANCE = 1e-4
CONFIG = LoopConfig(
    prompts=((5, 17, 33, 4, 60, 8, 21, 90), (9, 31, 50, 77, 13, 64, 40)),
    targets=frozenset(range(3, 13)),  # 10 of the 101 tokens: about 1 in 10 sampled at first
    num_steps=8,
    group_size=4,
    max_tokens=8,
    learning_rate=5e-2,
    seed=0,
)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model("LlamaForCausalLM", seed=0)


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    return save_hf_model(hf_model, tmp_path_factory.mktemp("policy"))


def test_the_trainers_forward_equals_hugging_faces(hf_model, model_dir):
    shape, params = load_policy(model_dir)
    assert (shape.num_heads, shape.num_kv_heads, shape.tie_word_embeddings) == (4, 2, False)  # GQA
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, shape.vocab_size, n).tolist() for n in (23, 11)]
    # One right-padded batch: padding after a sequence changes nothing in it (causal attention).
    batch = np.zeros((2, 23), np.int32)
    for row, ids in enumerate(sequences):
        batch[row, : len(ids)] = ids
    # Jitted as the trainer's step runs it: one program (op by op, each jnp op compiled its own).
    ours = np.asarray(jax.jit(llama_logits, static_argnums=2)(params, batch, shape))
    for row, ids in enumerate(sequences):
        theirs = hf_logits(hf_model, ids)
        np.testing.assert_allclose(ours[row, : len(ids)], theirs, rtol=0, atol=FORWARD_TOLERANCE)


def test_group_advantages_are_normalized_within_each_group():
    advantages = group_advantages(np.array([[0.0, 0.5, 1.0, 0.5], [0.25, 0.25, 0.25, 0.25]]))
    np.testing.assert_allclose(advantages[0], [-np.sqrt(2), 0, np.sqrt(2), 0], atol=1e-5)
    np.testing.assert_array_equal(advantages[1], 0.0)  # all alike: no signal


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **ARGS)


@pytest.fixture(scope="module")
def reports(llm, model_dir):
    shape, params = load_policy(model_dir)
    return run_rl_loop(llm, shape, params, CONFIG)


def test_the_loop_raises_the_reward(reports):
    rewards = [r.mean_reward for r in reports]
    print("mean reward per iteration:", " ".join(f"{r:.3f}" for r in rewards))
    assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.3, rewards


def test_engine_and_trainer_logprobs_agree(reports):
    gaps = [r.max_logprob_gap for r in reports]
    print("max |engine - trainer| logprob per iteration:", " ".join(f"{g:.1e}" for g in gaps))
    assert max(gaps) < LOGPROB_BOUND, gaps


def test_nothing_compiles_after_the_first_iteration(llm, reports):
    # Warm-up compiled every bucket; the first update of jax arrays compiles their conversions (a
    # transpose, a cast, once per shape: worker/weight_update.py), and later ones reuse them.
    assert all(r.num_engine_compiles == 0 for r in reports[1:])
    assert all(r.num_compiles == 0 for r in reports[1:])  # the trainer's step was compiled up front
    assert llm.engine_core.runner.guard.num_unexpected == 0


def test_sleeping_between_rollouts_changes_nothing(llm, model_dir, reports):
    """The same run, the engine asleep (weights and KV cache off the device) while the trainer steps:
    the same samples, rewards and losses, and still no compile."""
    llm.update_weights_from_path(model_dir)  # back to the start
    shape, params = load_policy(model_dir)
    steps = 3
    asleep = run_rl_loop(llm, shape, params, dataclasses.replace(CONFIG, num_steps=steps, sleep_level=2))
    assert [(r.mean_reward, r.loss) for r in asleep] == [(r.mean_reward, r.loss) for r in reports[:steps]]
    assert all(r.num_engine_compiles == 0 for r in asleep)
    assert all(r.num_sleep_compiles == 0 for r in asleep[1:])  # the cache's zero fill: compiled once
    assert llm.engine_core.runner.guard.num_unexpected == 0


def test_processed_logprobs_are_of_the_distribution_sampled_from(llm):
    """--logprobs-mode processed_logprobs at temperature 0.5 with top_k 5: each sampled token's logprob
    is log_softmax over the top 5 of logits / 0.5, computed from the raw prompt logprobs (always raw)
    of the same sequence fed back; not the raw logprob."""
    from xlaserve import SamplingParams

    prompt = list(CONFIG.prompts[0])
    sampled = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=6, logprobs=0),
        use_tqdm=False,
    )[0].outputs[0]
    fed = prompt + list(sampled.token_ids)
    raw = llm.generate(
        {"prompt_token_ids": fed}, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False
    )[0].prompt_logprobs[len(prompt) :]
    for token, entry, logprobs in zip(sampled.token_ids, raw, sampled.logprobs, strict=True):
        top5 = np.array(sorted((e.logprob for e in entry.values() if e.rank <= 5), reverse=True)) / 0.5
        assert len(top5) == 5 and entry[token].rank <= 5
        expected = entry[token].logprob / 0.5 - np.logaddexp.reduce(top5)
        np.testing.assert_allclose(logprobs[token].logprob, expected, rtol=0, atol=1e-5)
        assert abs(logprobs[token].logprob - entry[token].logprob) > 1e-3
