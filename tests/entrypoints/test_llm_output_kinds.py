"""vLLM's RequestOutputKind on the session SmolLM2 engine: AsyncLLM streams by it (its own output_kind
argument first), the offline LLM returns final outputs whatever it says; and LLM's use_tqdm callables.

AsyncLLM runs here over the session LLM's EngineCore in this process (`_InProcessCore`), its messages
through msgpack as over ZMQ: no second engine is built or compiled.
"""

from __future__ import annotations

import asyncio

import pytest

from xlaserve.engine import async_llm
from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.engine.output_processor import OutputProcessor
from xlaserve.engine.protocol import AddRequests, EngineCoreOutputs, make_encoder, make_input_decoder
from xlaserve.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


class _InProcessCore:
    """AsyncLLM's core client over an EngineCore in this process."""

    def __init__(self, core):
        self.core = core
        self.encoder, self.decoder = make_encoder(), make_input_decoder()

    def send(self, message) -> None:
        message = self.decoder.decode(self.encoder.encode(message))
        if isinstance(message, AddRequests):
            for request in message.requests:
                self.core.add_request(request.to_request())
        else:
            self.core.abort_requests(message.request_ids)


@pytest.fixture
def engine(llm, monkeypatch):
    monkeypatch.setattr(
        async_llm, "EngineCoreClient", lambda config, log_level: _InProcessCore(llm.engine_core)
    )
    engine = AsyncLLM.from_config(llm.config)
    engine.input_processor = llm.input_processor
    engine.output_processor = OutputProcessor(llm.tokenizer)
    return engine


def _stream(llm, engine, request_id: str, params: SamplingParams, **kwargs) -> list:
    """Every output AsyncLLM yields for PROMPT, the core stepped until the request is done."""
    stream = engine.add_request(llm.tokenizer.encode(PROMPT), params, request_id, prompt=PROMPT, **kwargs)
    while llm.engine_core.has_unfinished_requests():
        engine._process_outputs(EngineCoreOutputs(llm.engine_core.step()))

    async def drain():
        return [output async for output in stream]

    return asyncio.run(drain())


def _texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_async_llm_streams_as_output_kind_says(llm, engine):
    """DELTA's pieces concatenate to CUMULATIVE's last output, FINAL_ONLY yields that alone; the tokens
    are the offline LLM's, which returns one final output even for a DELTA request (vLLM's)."""
    delta_params = SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA)
    (offline,) = llm.generate(PROMPT, delta_params, use_tqdm=False)
    expected = offline.outputs[0]
    assert len(expected.token_ids) == 6 and offline.finished
    delta, cumulative, final = (
        _stream(llm, engine, kind.name, SamplingParams(**GREEDY, output_kind=kind))
        for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)
    )
    assert len(delta) == 6 and "".join(_texts(delta)) == expected.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected.token_ids
    assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    assert cumulative[-1].outputs[0].text == expected.text
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == expected.token_ids


def test_async_llm_output_kind_argument_comes_first(llm, engine):
    """The argument (the server's, by `stream`) over the request's kind; neither: deltas, as before."""
    unnamed = _stream(llm, engine, "unnamed", SamplingParams(**GREEDY))
    assert len(unnamed) == 6 and sum(len(o.outputs[0].token_ids) for o in unnamed) == 6
    final_params = SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY)
    assert len(_stream(llm, engine, "argument", final_params, output_kind="delta")) == 6
    assert (
        len(_stream(llm, engine, "enum", SamplingParams(**GREEDY), output_kind=RequestOutputKind.FINAL_ONLY))
        == 1
    )


def test_generate_takes_a_tqdm_like_callable(llm):
    """vLLM's use_tqdm: a callable makes the bar (with tqdm's arguments); it counts the finished
    completions (n per prompt), shows vLLM's speed postfix (the finished requests' prompt tokens, once
    per completion, and output tokens, per second the bar says have passed: 2 here), and is closed."""
    bars = []

    class Bar:
        format_dict = {"elapsed": 2.0}

        def __init__(self, **kwargs):
            self.kwargs, self.n, self.is_closed, self.postfixes = kwargs, 0, False, []
            bars.append(self)

        def update(self, n=1):
            self.n += n
            self.postfixes.append(self.postfix)

        def close(self):
            self.is_closed = True

    params = [
        SamplingParams(max_tokens=1),
        SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True),
    ]
    outputs = llm.generate(["a", "b c"], params, use_tqdm=Bar)
    assert len(outputs) == 2 and len(bars) == 1
    (bar,) = bars
    assert (bar.kwargs["total"], bar.n, bar.is_closed) == (3, 3, True)
    assert bar.kwargs["postfix"] == "est. speed input: 0.00 toks/s, output: 0.00 toks/s"
    num_input = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs)
    assert num_input == len(outputs[0].prompt_token_ids) + 2 * len(outputs[1].prompt_token_ids)
    assert bar.postfixes[-1] == f"est. speed input: {num_input / 2:.2f} toks/s, output: {7 / 2:.2f} toks/s"
