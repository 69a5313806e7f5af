"""End to end on the real SmolLM2 weights: parity with Hugging Face, caching, preemption, limits."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is the boiling point of water?\nA:",
    "List of prime numbers: 2, 3, 5, 7,",
    "Translate to French: Good morning, my friend.",
    "Les chats sont",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "SELECT name FROM users WHERE",
    "A haiku about the sea:\n",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "1, 1, 2, 3, 5, 8, 13,",
]
NEAR_TIE = 2e-3  # how far below HF's top logit our token may be (a near tie), else a mismatch


def _hf_gaps(hf_model, prompt_ids: list[int], ours: list[int]) -> list[float]:
    """Teacher-forced over our tokens (one forward of prompt + ours): per generated position, how far
    our token's logit falls below HF's top logit there (0: HF's greedy choice too). Equal greedy runs are
    exactly the all-zero case, by induction on the position; one forward instead of a decode loop."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ours[:-1]])).logits[0, len(prompt_ids) - 1 :]
    chosen = logits[torch.arange(len(ours)), torch.tensor(ours)]
    return (logits.max(dim=-1).values - chosen).tolist()


@pytest.mark.slow
def test_greedy_matches_hugging_face(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)  # all 16 in flight together
    num_exact = 0
    for prompt, output in zip(PROMPTS, outputs):
        ours = list(output.outputs[0].token_ids)
        assert len(ours) == 32
        gaps = _hf_gaps(hf_model, list(output.prompt_token_ids), ours)
        # A token HF would not pick greedily is allowed only at a near tie of HF's top logits (float32
        # sums in another order), at every position, not only the first that differs.
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        assert gaps[worst] < NEAR_TIE, (
            f"{prompt!r}: token {worst} ({ours[worst]}) is {gaps[worst]:.2e} below HF's top"
        )
        num_exact += all(g == 0 for g in gaps)
    assert num_exact >= len(PROMPTS) - 2  # near ties are rare: most prompts match HF token for token


def _metric(llm, name: str):
    return next(m for m in llm.get_metrics() if m.name == f"xlaserve:{name}").value


def test_prefix_cache_computes_only_new_tokens(llm):
    llm.reset_prefix_cache()
    prefix = "You are a careful assistant. Answer in one short sentence. " * 6
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.generate(prefix + "What is the capital of Italy?", params, use_tqdm=False)[0]
    hits_before = _metric(llm, "prefix_cache_hits")
    second = llm.generate(prefix + "What is the capital of Spain?", params, use_tqdm=False)[0]
    shared = next(
        i for i, (a, b) in enumerate(zip(first.prompt_token_ids, second.prompt_token_ids)) if a != b
    )
    block_size = llm.config.cache.block_size
    expected_hit = shared // block_size * block_size
    assert expected_hit >= 64
    assert second.num_cached_tokens == expected_hit
    assert _metric(llm, "prefix_cache_hits") - hits_before == expected_hit
    # The same request without the cache gives the same tokens.
    llm.reset_prefix_cache()
    fresh = llm.generate(prefix + "What is the capital of Spain?", params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == second.outputs[0].token_ids


def test_n_shares_prompt_blocks_and_seeds_are_batch_independent(llm):
    llm.reset_prefix_cache()
    prompt = "Write a short poem about autumn leaves falling on a quiet street. " * 3
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # children draw differently
    # Children after the first hit the prompt's full blocks instead of recomputing them.
    num_prompt = len(out.prompt_token_ids)
    block_size = llm.config.cache.block_size
    assert out.num_cached_tokens in (0, (num_prompt - 1) // block_size * block_size)
    # Alone or next to other requests, the same seed yields the same tokens.
    alone = llm.generate(
        prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12), use_tqdm=False
    )
    crowded = llm.generate(
        ["Some other prompt", prompt, "Yet another one about cats"],
        [SamplingParams(temperature=1.0, max_tokens=20)]
        + [SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)]
        + [SamplingParams(temperature=0.7, seed=7, max_tokens=5)],
        use_tqdm=False,
    )
    assert alone[0].outputs[0].token_ids == crowded[1].outputs[0].token_ids == out.outputs[0].token_ids


def test_stop_conditions(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = llm.generate("The three primary colors are", greedy, use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    # A stop string cut from the text, with finish reason stop and the string as stop_reason.
    word = base.text.split()[2]
    stopped = llm.generate(
        "The three primary colors are",
        SamplingParams(temperature=0.0, max_tokens=24, stop=[word]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert stopped.text == base.text[: base.text.index(word)]
    # A stop token id ends generation right after it.
    stop_id = base.token_ids[5]
    by_id = llm.generate(
        "The three primary colors are",
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert list(by_id.token_ids) == list(base.token_ids[: base.token_ids.index(stop_id) + 1])


def test_eos_and_min_tokens(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = llm.get_tokenizer().eos_token_id
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    n = len(short.token_ids)
    longer = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=n + 3), use_tqdm=False)
    tokens = longer[0].outputs[0].token_ids
    assert len(tokens) >= n + 3 and eos not in tokens[: n + 2]


def test_chat_takes_vllms_template_arguments(llm):
    """continue_final_message continues the assistant's last message (no end of turn after it); tools and
    chat_template_kwargs reach the template; settings that contradict chat()'s are refused by name."""
    tokenizer = llm.get_tokenizer()
    chat = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    out = llm.chat(chat, one, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)[0]
    want = tokenizer.apply_chat_template(
        chat, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert out.prompt == want and want.endswith("The color is")
    assert list(out.prompt_token_ids) == tokenizer.encode(want, add_special_tokens=False)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ tools | length }} tools|{{ mood }}"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(2)]
    kwargs = {"chat_template": template, "tools": tools, "chat_template_kwargs": {"mood": "calm"}}
    assert llm.chat(chat[:1], one, use_tqdm=False, **kwargs)[0].prompt == "Name a color.|2 tools|calm"
    # The content format: a template looping over a message's content gets parts ("auto" sees the loop).
    parts = "{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
    parts += "{% for p in m.content %}P:{{ p.text }}{% endfor %}{% endif %}{% endfor %}"
    split = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    for fmt, want in [("auto", "P:HiP:!"), ("openai", "P:HiP:!"), ("string", "S:Hi!")]:
        kwargs = {"chat_template": parts, "chat_template_content_format": fmt, "use_tqdm": False}
        assert llm.chat(split, one, **kwargs)[0].prompt == want, fmt
    assert llm.chat(chat[:1], one, chat_template=parts, use_tqdm=False)[0].prompt == "P:Name a color."
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(chat, one, chat_template_content_format="parts")
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        llm.chat(chat, one, continue_final_message=True)
    with pytest.raises(ValueError, match=r"chat_template_kwargs cannot set \['tools'\]"):
        llm.chat(chat, one, chat_template_kwargs={"tools": []})


def test_logprobs_match_hugging_face(llm, hf_model):
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=3)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(out.prompt_token_ids)):
        entry = out.prompt_logprobs[pos]
        token = ids[pos]
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token], abs=1e-4)
        assert len(entry) >= 3
    for i, entry in enumerate(out.outputs[0].logprobs):
        pos = len(out.prompt_token_ids) + i
        token = ids[pos]
        assert entry[token].rank == 1  # greedy
        assert entry[token].logprob == pytest.approx(ref[pos - 1].max(), abs=1e-4)
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:5]
        np.testing.assert_allclose([lp.logprob for lp in top], np.sort(ref[pos - 1])[::-1][:5], atol=1e-4)


def test_penalties_change_greedy_output(llm):
    prompt = "List of prime numbers: 2, 3, 5, 7,"
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    penalized = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.8), use_tqdm=False
    )[0]
    assert plain.outputs[0].token_ids != penalized.outputs[0].token_ids


def _penalized(logits, prompt_ids, output_ids, params) -> np.ndarray:
    """vLLM's formulas in float64 on one position's logits: the logit bias, then the repetition penalty
    on tokens of the prompt or the output so far, then frequency and presence on the output's."""
    vocab = len(logits)
    z = np.asarray(logits, np.float64).copy()
    for token_id, bias in (params.logit_bias or {}).items():
        z[token_id] += bias
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab)
    seen = counts > 0
    seen[prompt_ids] = True
    rep = params.repetition_penalty
    z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
    return z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def test_penalties_and_logit_bias_match_vllms_formulas(llm, hf_model):
    """Greedy under every penalty and a logit bias: each token is the argmax of vLLM's penalized logits
    (numpy over Hugging Face's, teacher-forced on ours). The bias is on a prompt token, sized so that
    at the first step adding it after the penalties (the old order) would pick that token instead."""
    import torch

    prompt = "List of prime numbers: 2, 3, 5, 7,"
    prompt_ids = llm.get_tokenizer().encode(prompt)
    with torch.no_grad():
        first = hf_model(torch.tensor([prompt_ids])).logits[0, -1].double().numpy()
    rep = 2.0
    seen = max(set(prompt_ids), key=lambda t: first[t])  # the likeliest prompt token: penalized
    top = _penalized(first, prompt_ids, [], SamplingParams(repetition_penalty=rep)).max()
    bias = round(rep * (top - 1.0) - first[seen], 2)  # (logit + bias) / rep: 1 below the top
    assert first[seen] / rep + bias > top  # the other order would pick `seen`
    params = SamplingParams(
        temperature=0.0, max_tokens=10, repetition_penalty=rep, frequency_penalty=0.4,
        presence_penalty=0.3, logit_bias={seen: bias}, ignore_eos=True,
    )  # fmt: skip
    ours = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours[0] != seen
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + ours[:-1]])).logits[0, len(prompt_ids) - 1 :].numpy()
    for i, token in enumerate(ours):
        z = _penalized(logits[i], prompt_ids, ours[:i], params)
        assert z.max() - z[token] <= NEAR_TIE, (i, ours)


def test_logit_bias_and_allowed_token_ids_steer_greedy_sampling(llm):
    """A bias just over the gap between the top two tokens makes the second the greedy choice (its
    logprob stays the raw distribution's); -100 on the top token does too; allowed_token_ids keeps every
    token in the set; and a request beside them without either is unchanged."""
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    first = base.outputs[0].logprobs[0]
    top, second, third = sorted(first, key=lambda t: first[t].rank)[:3]
    gap = first[top].logprob - first[second].logprob
    nudged = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, logit_bias={second: gap + 0.01})
    banned = SamplingParams(temperature=0.0, max_tokens=1, logit_bias={top: -100.0})
    allowed = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[third, second])
    plain = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    outs = llm.generate([prompt] * 4, [nudged, banned, allowed, plain], use_tqdm=False)
    (nudged_out, banned_out, allowed_out, plain_out) = (o.outputs[0] for o in outs)
    assert nudged_out.token_ids == [second] == banned_out.token_ids
    assert nudged_out.logprobs[0][second].logprob == pytest.approx(first[second].logprob, abs=1e-5)
    assert nudged_out.logprobs[0][second].rank == 2  # the raw distribution's rank
    assert allowed_out.token_ids[0] == second and set(allowed_out.token_ids) <= {second, third}
    assert plain_out.token_ids == base.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens, the same answer as sending them; -1
    (the context's length) leaves a prompt that fits as it is."""
    prompt = "List of prime numbers: 2, 3, 5, 7, 11, 13, 17, 19, 23,"
    ids = llm.get_tokenizer().encode(prompt)
    greedy = {"temperature": 0.0, "max_tokens": 6}
    cut, whole, fits = llm.generate(
        [prompt, {"prompt_token_ids": ids[-8:]}, prompt],
        [SamplingParams(**greedy, truncate_prompt_tokens=8), SamplingParams(**greedy),
         SamplingParams(**greedy, truncate_prompt_tokens=-1)],
        use_tqdm=False,
    )  # fmt: skip
    assert cut.prompt_token_ids == ids[-8:] and cut.prompt is None
    assert cut.outputs[0].token_ids == whole.outputs[0].token_ids
    # stream() cuts the prompt too.
    streamed = "".join(llm.stream(prompt, SamplingParams(**greedy, truncate_prompt_tokens=8)))
    assert streamed == whole.outputs[0].text
    assert fits.prompt_token_ids == ids and fits.prompt == prompt


def test_calls_without_sampling_params_sample_as_the_generation_config_says(llm, monkeypatch):
    """generate() and stream() without sampling_params take the model's generation config
    (LLM.default_sampling, from --generation-config and --override-generation-config: test_engine_args.py;
    the embedded GGUF has none, so it is set here): the tokens of the same fields given. Its max_tokens is
    cut to the room a long prompt leaves, not an error."""
    monkeypatch.setattr(
        llm, "default_sampling", {"temperature": 0.0, "max_tokens": 5, "repetition_penalty": 1.3}
    )
    given = SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3)
    prompt = "List of prime numbers: 2, 3, 5, 7,"
    implicit, explicit = (
        llm.generate([prompt], use_tqdm=False)[0],
        llm.generate([prompt], given, use_tqdm=False)[0],
    )
    assert (
        implicit.outputs[0].token_ids == explicit.outputs[0].token_ids
        and len(implicit.outputs[0].token_ids) == 5
    )
    assert "".join(llm.stream(prompt)) == explicit.outputs[0].text
    assert llm.get_default_sampling_params() == given
    long = {"prompt_token_ids": [1] + [2] * (llm.max_model_len - 3)}  # room for 2 tokens
    assert len(llm.generate(long, use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"n": 2, "temperature": 0.0}, "n"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_bad_input_leaves_the_engine_serving(llm):
    with pytest.raises(ValueError, match="max_model_len=512"):
        llm.generate({"prompt_token_ids": [1] * 600}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4), use_tqdm=False)
    # vLLM's -1 is the whole vocabulary, past this engine's max_logprobs (20).
    vocab = llm.input_processor.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        limit = r"must be at most 20 \(the engine's max_logprobs\)"
        refused = rf"^{name} {limit}, got -1 \(the whole vocabulary, {vocab}\)$"
        with pytest.raises(ValueError, match=refused):
            llm.generate("Hello", SamplingParams(**{name: -1}), use_tqdm=False)
    free_before = llm.engine_core.kv_cache_manager.num_free_blocks
    out = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not llm.engine_core.has_unfinished_requests()
    assert llm.engine_core.kv_cache_manager.num_free_blocks == free_before


def test_bad_words_are_never_generated(llm):
    """vLLM's bad_words: SmolLM2's greedy " Paris. The capital of France" never says "Paris" with it
    banned (one token, as written and after a space), and with "Paris." (two tokens) it may say " Paris"
    but never the period after it."""
    prompt = "The capital of France is"
    greedy = {"temperature": 0.0, "max_tokens": 12}
    plain, one, two = (
        o.outputs[0].text
        for o in llm.generate(
            [prompt] * 3,
            [SamplingParams(**greedy), SamplingParams(**greedy, bad_words=["Paris"]),
             SamplingParams(**greedy, bad_words=["Paris."])],
            use_tqdm=False,
        )
    )  # fmt: skip
    assert plain.startswith(" Paris.")
    assert "Paris" not in one and one != plain
    assert two.startswith(" Paris") and "Paris." not in two
    with pytest.raises(ValueError, match="bad_words must be non-empty strings"):
        SamplingParams(bad_words=[" "])


def test_detokenize_false_gives_the_ids_without_text(llm):
    """vLLM's detokenize=False: the same tokens and logprobs, no text and no decoded tokens (the prompt
    logprobs' included); stop strings, which are matched in the text, are refused."""
    prompt = "The capital of France is"
    greedy = {"temperature": 0.0, "max_tokens": 6, "logprobs": 1, "prompt_logprobs": 0}
    with_text, ids_only = llm.generate(
        [prompt] * 2, [SamplingParams(**greedy), SamplingParams(**greedy, detokenize=False)], use_tqdm=False
    )
    (a,), (b,) = with_text.outputs, ids_only.outputs
    assert b.text == "" and a.text and b.token_ids == a.token_ids
    assert [{t: lp.logprob for t, lp in e.items()} for e in b.logprobs] == [
        {t: lp.logprob for t, lp in e.items()} for e in a.logprobs
    ]
    assert all(
        lp.decoded_token is None for e in b.logprobs + ids_only.prompt_logprobs[1:] for lp in e.values()
    )
    assert all(lp.decoded_token is not None for e in a.logprobs for lp in e.values())
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)


def test_profiling_needs_a_profiler_dir(llm):
    with pytest.raises(ValueError, match=r"start_profile needs profiler_dir \(--profiler-dir"):
        llm.start_profile()
    with pytest.raises(ValueError, match="no profile is running"):
        llm.stop_profile()


def test_unknown_model_path_and_non_model_file(tmp_path):
    from xlaserve import LLM

    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="notes.txt"):
        LLM(str(text))


def test_nothing_compiles_after_warm_up(llm):
    from xlaserve.worker.compile_guard import num_compiles

    before = num_compiles()
    prompts = [("word " * n).strip() for n in (1, 7, 30, 90, 200, 3)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=9, seed=1),
        SamplingParams(temperature=1.0, min_p=0.1, max_tokens=17, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=5, presence_penalty=0.5, prompt_logprobs=1),
        SamplingParams(temperature=0.7, max_tokens=6, logit_bias={13: 5.0}, allowed_token_ids=[13, 14, 15]),
        SamplingParams(temperature=0.0, max_tokens=40),
    ]
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    assert num_compiles() == before
    assert llm.engine_core.runner.guard.num_unexpected == 0


def test_metrics_are_named_like_vllm(llm):
    names = {m.name for m in llm.get_metrics()}
    for name in (
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "time_to_first_token_seconds",
        "request_time_per_output_token_seconds",
        "kv_cache_usage_perc",
    ):
        assert f"xlaserve:{name}" in names
    llm.generate("Queue, prefill, decode:", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert _metric(llm, "generation_tokens") > 0
    # vLLM's per-request phases and lengths, one sample per finished request (the module's so far):
    # inference = prefill + decode for each request that got a token, a queue time for each scheduled.
    hist = {m.name.removeprefix("xlaserve:"): m for m in llm.get_metrics() if hasattr(m, "buckets")}
    prefill, decode, inference = (
        hist[f"request_{n}_time_seconds"] for n in ("prefill", "decode", "inference")
    )
    assert 0 < prefill.count == decode.count == inference.count <= hist["request_queue_time_seconds"].count
    assert inference.sum == pytest.approx(prefill.sum + decode.sum, rel=1e-9)
    finished = hist["e2e_request_latency_seconds"].count
    assert hist["request_prompt_tokens"].count == hist["request_generation_tokens"].count == finished
    # Per user request (n > 1 counts once), and per finished request that set max_tokens.
    assert 0 < hist["request_params_n"].count == hist["request_max_num_generation_tokens"].count <= finished
    assert 0 < hist["request_params_max_tokens"].count <= finished
    # Finished requests' tokens: not those of the module's aborted ones, which the counter has.
    assert 0 < hist["request_generation_tokens"].sum <= _metric(llm, "generation_tokens")
    assert hist["iteration_tokens_total"].sum == _metric(llm, "generation_tokens") + _metric(
        llm, "prompt_tokens"
    )
    runner = llm.engine_core.runner
    assert _metric(llm, "num_kv_blocks") == runner.num_blocks
    assert _metric(llm, "model_weight_bytes") == runner.weight_bytes > 1e8  # ~135M parameters


def test_bfloat16_engine_tracks_float32(llm, llm_bf16, hf_model):
    """bfloat16, the GPU default, end to end on CPU: weights and KV cache in bfloat16, prompt
    logprobs within bfloat16's error of Hugging Face's float32 ones, and the float32 engine's greedy
    tokens where their margins are wide. The session's bfloat16 engine (conftest.py; its prefix cache
    does not serve a request for prompt logprobs), not one of its own: no second engine to build."""
    import jax
    import torch

    bf16 = llm_bf16
    runner = bf16.engine_core.runner
    # Layer stacks are stored as their raw 16-bit words on CPU, the rest as bfloat16.
    assert {x.dtype.name for x in jax.tree.leaves(runner.params["layers"])} == {"uint16"}
    assert {x.dtype.name for x in jax.tree.leaves(runner.params) if x.ndim < 3} >= {"bfloat16"}
    # The reference backend stores the bfloat16 cache as its raw 16-bit words (kernels/dtype_ops.py).
    assert {x.dtype.name for x in jax.tree.leaves(runner.kv_cache)} == {"uint16"}
    # What made bfloat16 20x slower than float32 on CPU must not come back: XLA converting the
    # whole KV cache, or whole stacked weights, to float32 inside the step (engine/PERFORMANCE.md).
    hlo = runner.compiled_forward_text(runner.token_buckets[-1])
    big = [runner.kv_cache.k.shape] + [x.shape for x in jax.tree.leaves(runner.params) if x.ndim == 3]
    for shape in big:
        dims = ",".join(map(str, shape))
        assert f"= f32[{dims}]" not in hlo, f"the step converts a {shape} array to float32"

    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    prompt = "1, 2, 3, 4,"
    got = bf16.generate(prompt, params, use_tqdm=False)[0]
    want = llm.generate(prompt, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids  # " 5, 6, 7, 8,"
    ids = list(got.prompt_token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
    errors = [abs(got.prompt_logprobs[p][ids[p]].logprob - ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert max(errors) < 0.25, errors
