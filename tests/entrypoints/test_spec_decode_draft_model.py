"""Speculative decoding with a draft model (worker/draft_model.py), k=3, on a tiny random Llama: greedy
outputs equal those without speculation token for token, through chunked prefill, prefix-cache hits and
preemption; the target as its own draft accepts every draft (greedy and sampled: a strong check of the
draft's cache on the shared block ids and of its q); seeded sampling is reproducible; nothing compiles
after warm-up; a draft with another vocabulary, or no draft at the path, is refused naming the field."""

from __future__ import annotations

import json

import jax
import pytest
from test_spec_decode_llm import ENGINE_ARGS, prompts, spec_metrics

from helpers.eagle3_cases import as_speculators, eagle3_drafts, save_random_eagle3
from helpers.family_cases import make_hf_model, save_hf_model
from helpers.mtp_cases import record_drafts
from helpers.tiny_models import elemental_emitters
from xlaserve import LLM, SamplingParams
from xlaserve.entrypoints.cli import main
from xlaserve.worker.compile_guard import num_compiles

K = 3
NUM_TOKENS = 32
# test_spec_decode_llm's (18 usable blocks of 8 slots: four requests of 56-72 tokens preempt, lookahead
# slots included): the baseline engine is that module's, its programs found in the compilation cache.
ARGS = ENGINE_ARGS


def params(*, with_penalties: bool) -> list[SamplingParams]:
    common = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "ignore_eos": True}
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.2} if with_penalties else {}
    return [
        SamplingParams(**common),
        SamplingParams(**common, logprobs=2),
        SamplingParams(**common, **penalties),  # the draft proposes without them: the target decides
        SamplingParams(**common),
    ]


def draft_config(model_dir) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("LlamaForCausalLM"), tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def truncated_draft_dir(tmp_path_factory):
    """The target's first layer (same embedding and head): a draft that agrees with it sometimes."""
    model = make_hf_model("LlamaForCausalLM")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return save_hf_model(model, tmp_path_factory.mktemp("draft"))


SAMPLED = SamplingParams(temperature=0.8, top_k=20, n=2, seed=5, max_tokens=24, ignore_eos=True)


def run_sampled(llm: LLM) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p} for p in prompts()[:2]]
    return [c.token_ids for o in llm.generate(inputs, SAMPLED, use_tqdm=False) for c in o.outputs]


@pytest.fixture(scope="module")
def baseline(target_dir):
    """Token ids without speculation: greedy with and without penalties (they differ in one request),
    and seeded sampling."""
    llm = LLM(target_dir, enforce_eager=True, **ARGS)
    outputs = {is_on: [o.outputs[0].token_ids for o in run(llm, is_on)] for is_on in (True, False)}
    return outputs | {"sampled": run_sampled(llm)}


def run(llm: LLM, with_penalties: bool):
    inputs = [{"prompt_token_ids": p} for p in prompts()]
    return llm.generate(inputs, params(with_penalties=with_penalties), use_tqdm=False)


def check_outputs_and_metrics(llm: LLM, baseline, with_penalties: bool) -> dict:
    """Greedy outputs equal the baseline's; the engine went through chunked prefill, prefix-cache hits
    and preemption; metrics add up; every block is back."""
    core = llm.engine_core
    outputs = run(llm, with_penalties)
    assert [o.outputs[0].token_ids for o in outputs] == baseline[with_penalties]
    assert all(len(o.outputs[0].token_ids) == NUM_TOKENS for o in outputs)
    assert len(outputs[1].outputs[0].logprobs) == NUM_TOKENS
    assert max(len(p) for p in prompts()) > ARGS["max_num_batched_tokens"]  # chunked prefill
    assert core.scheduler.num_preemptions_total > 0
    assert sum(m.value for m in llm.get_metrics() if m.name == "xlaserve:prefix_cache_hits") > 0
    metrics = spec_metrics(llm)
    assert 0 < metrics["num_draft_tokens"] <= K * metrics["num_drafts"]
    assert metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]
    per_pos = metrics["per_pos"]
    assert len(per_pos) == K and sum(per_pos) == metrics["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.req_to_blocks
    return metrics


def test_the_target_as_its_own_draft_accepts_every_draft(target_dir, baseline):
    """Its cache rides the target's block ids: were a K/V missing (a prefix-cache hit, a preempted
    request's recompute, a chunk) or stale, some draft would differ from the target's choice."""
    spec = draft_config(target_dir)
    llm = LLM(target_dir, speculative_config=spec, strict_compile_guard=True, **ARGS)
    before = num_compiles()
    metrics = check_outputs_and_metrics(llm, baseline, with_penalties=False)
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"]  # acceptance rate 1.0
    assert metrics["num_drafts"] > 20
    # Sampled rows draw their drafts from q = the target's own p: min(1, p / q) = 1 accepts them all
    # (up to float rounding), which checks that each row reads its own q. A draft is drawn with the
    # noise the sampler would use at its index: the tokens are those sampled without speculation,
    # however the steps fell (the second run hits the prefix cache).
    before_sampled = spec_metrics(llm)
    tokens = run_sampled(llm)
    assert tokens == run_sampled(llm) == baseline["sampled"]
    assert len(set(map(tuple, tokens))) == 4 and all(len(t) == 24 for t in tokens)
    after = spec_metrics(llm)
    num_drafted = after["num_draft_tokens"] - before_sampled["num_draft_tokens"]
    assert num_drafted > 8 * K
    assert after["num_accepted_tokens"] - before_sampled["num_accepted_tokens"] >= 0.95 * num_drafted
    assert num_compiles() == before and llm.engine_core.runner.guard.num_unexpected == 0


def test_a_smaller_draft_keeps_greedy_outputs_exact(truncated_draft_dir, target_dir, baseline):
    spec = draft_config(truncated_draft_dir)
    llm = LLM(target_dir, speculative_config=spec, enforce_eager=True, **ARGS)
    metrics = check_outputs_and_metrics(llm, baseline, with_penalties=True)
    assert metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # a different model: some rejected
    runner = llm.engine_core.runner
    assert runner.drafter.kv_spec.num_layers == 1
    # The weights gauge counts the draft's (one layer of the target's two, same embedding and head).
    assert 0 < runner.drafter.weight_bytes < runner.weight_bytes
    gauge = next(m.value for m in llm.get_metrics() if m.name == "xlaserve:model_weight_bytes")
    assert gauge == runner.weight_bytes + runner.drafter.weight_bytes
    # Sleep frees the draft's cache and (level 2) its weights beside the target's; awake, the same tokens.
    caches = sum(x.nbytes for x in jax.tree.leaves((runner.kv_cache, runner.drafter.kv_cache)))
    slept = llm.sleep(2)
    assert slept.device_bytes >= gauge + caches
    assert llm.wake_up().device_bytes == slept.device_bytes
    greedy = [o.outputs[0].token_ids for o in run(llm, with_penalties=True)]
    assert greedy == baseline[True]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, target_dir):
    other = save_hf_model(make_hf_model("LlamaForCausalLM", vocab_size=97), tmp_path / "other")
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocab_size \(97\) must"):
        LLM(target_dir, speculative_config=draft_config(other), enforce_eager=True, **ARGS)


def test_serve_refuses_a_draft_that_is_not_there(capsys):
    spec = json.dumps({"method": "draft_model", "model": "/no/such/draft"})
    assert main(["serve", "--speculative-config", spec]) == 2
    assert "speculative_config.model: '/no/such/draft' does not exist" in capsys.readouterr().err


# -- EAGLE-3 (worker/eagle3.py): a draft network over three of the target's hidden states -------------


def eagle3_config(path, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("form", ["released", "speculators"])
def test_eagle3_drafts_equal_the_torch_reference(target_dir, tmp_path, form):
    """float32, k = 2, a request prefilled in two chunks: every step's drafts equal those
    Hugging Face's Llama modules compute when wired as vLLM's llama_eagle3 (helpers/eagle3_cases.py):
    the aux hidden states entering the target's layers 0, 1 and 2 through fc to a narrower draft, its
    own embedding, its pre-norm output chained into the next draft, 64 draft ids mapped by d2t. The same
    weights in the speculators library's format, the engine started on that directory alone (vLLM's
    `vllm serve <speculator>`: the target is its verifier, the method and k = 2 come from its config),
    run with the residual normed, as that format's norm_before_residual says by default."""
    path, tensors = save_random_eagle3(tmp_path / "eagle3")
    args = {**ARGS, "dtype": "float32", "enforce_eager": True}
    with elemental_emitters():  # compared with the torch reference only
        if form == "speculators":
            spec_dir = as_speculators(path, tmp_path / "speculators", tensors, 2, verifier=target_dir)
            llm = LLM(spec_dir, **args)
        else:
            llm = LLM(target_dir, speculative_config=eagle3_config(path, k=2), **args)
    if form == "speculators":
        assert llm.config.model.model == str(target_dir)
    assert (llm.config.speculative.method, llm.config.num_spec_tokens) == ("eagle3", 2)
    seen = record_drafts(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hf = make_hf_model("LlamaForCausalLM")  # the target_dir fixture's model
    prompt = prompts()[0][:32]  # two chunks of 16, then steps of 1 + k: two token buckets
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    seq = prompt + list(out.outputs[0].token_ids)
    steps = [(p, d) for p, d in seen[out.request_id] if p < len(seq) - 1]
    assert len(steps) >= 4
    normed = form == "speculators"
    assert [d for _, d in steps] == eagle3_drafts(hf, tensors, seq, [p for p, _ in steps], 2, normed)
    if normed:  # the residual matters: the released wiring proposes other drafts here
        assert [d for _, d in steps] != eagle3_drafts(hf, tensors, seq, [p for p, _ in steps], 2)


def test_eagle3_keeps_greedy_outputs_exact(target_dir, baseline, tmp_path):
    """bfloat16 (batch invariance on): with a random EAGLE-3 drafter the four requests (chunked prefill,
    a prefix-cache hit, preemption, logprobs) decode the plain engine's tokens, the aux hidden states
    taken from the forward change none of its bits, every block comes back, and nothing compiles after
    warm-up."""
    path, _ = save_random_eagle3(tmp_path / "eagle3")
    llm = LLM(target_dir, speculative_config=eagle3_config(path), strict_compile_guard=True, **ARGS)
    before = num_compiles()
    check_outputs_and_metrics(llm, baseline, with_penalties=False)
    assert num_compiles() == before and llm.engine_core.runner.guard.num_unexpected == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({}, "speculative_config.model is required for method 'eagle3'"),
        ({"model": "."}, None),
    ],
)
def test_eagle3_settings_refused_at_start(args, message):
    from xlaserve.config import EngineConfig

    spec = {"method": "eagle3", **args}
    if message is not None:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs("smollm2", speculative_config=spec)
        return
    with pytest.raises(
        ValueError, match="pipeline_parallel_size=2 cannot be combined with speculative_config"
    ):
        EngineConfig.from_kwargs("smollm2", speculative_config=spec, pipeline_parallel_size=2)


def test_eagle3_padding_draft_ids_map_past_the_targets_logits():
    """Under tensor parallelism the draft vocabulary pads to split (sharding/vocab.py): its padding ids'
    zero logits land past the target's (padded) ids, where `draft_logits`' scatter drops them, never on
    a real id. On one device nothing pads."""
    import numpy as np

    from xlaserve.worker.eagle3 import _draft_to_target

    d2t = np.array([2, 5, 5])  # draft ids 0, 1, 2 name target ids 2, 6, 7
    assert _draft_to_target({"d2t": d2t}, 3, 10, 1, 10).tolist() == [2, 6, 7]
    assert _draft_to_target({"d2t": d2t}, 3, 10, 2, 64).tolist() == [2, 6, 7] + [64] * 61


def test_eagle3_checkpoints_and_targets_refused_by_name(tmp_path, target_dir):
    """Not an EAGLE-3 checkpoint (the target's own directory), another vocabulary, and a target whose
    forward does not run models/decoder.py's layer scan (a hybrid)."""
    from types import SimpleNamespace

    from xlaserve.worker.eagle3 import _check_target

    with pytest.raises(ValueError, match=r"speculative_config.model: .* is not an EAGLE-3 checkpoint"):
        LLM(target_dir, speculative_config=eagle3_config(target_dir), enforce_eager=True, **ARGS)
    path, _ = save_random_eagle3(tmp_path / "eagle3", vocab_size=97)
    with pytest.raises(
        ValueError, match=r"speculative_config.model: the EAGLE-3 checkpoint's vocab_size \(97\)"
    ):
        LLM(target_dir, speculative_config=eagle3_config(path), enforce_eager=True, **ARGS)
    path, tensors = save_random_eagle3(tmp_path / "eagle3_fc_norm", norm_before_fc=True)  # a later variant
    with pytest.raises(ValueError, match=r"speculative_config.model: norm_before_fc is not supported"):
        LLM(target_dir, speculative_config=eagle3_config(path), enforce_eager=True, **ARGS)
    spec_dir = as_speculators(path, tmp_path / "speculators", tensors, 2)  # its verifier is no local path
    with pytest.raises(ValueError, match=r"verifier 'tiny-llama' is not a local path"):
        LLM(spec_dir, **ARGS)
    with pytest.raises(ValueError, match=r"is a speculators checkpoint \(a drafter\); with a speculative"):
        LLM(spec_dir, speculative_config={"method": "ngram"}, **ARGS)
    hybrid = SimpleNamespace(
        model_config=SimpleNamespace(architecture="Qwen3_5ForCausalLM"),
        kv_spec=SimpleNamespace(layer_kind="hybrid"),
    )
    with pytest.raises(
        ValueError, match=r"speculative_config.method 'eagle3': Qwen3_5ForCausalLM is not supported"
    ):
        _check_target(hybrid)
