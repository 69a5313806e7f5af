"""A fault in one request's host work fails that request alone: it ends with finish_reason "error",
the request beside it in the same batches finishes with exactly its normal greedy output, the engine
keeps serving, and no KV block leaks. (A fault in the jitted step itself is the engine's, not a
request's: that one may still stop the core.)"""

from __future__ import annotations

import pytest

from xlaserve import SamplingParams
from xlaserve.engine import output_processor
from xlaserve.worker import input_batch, step_output

GOOD, BAD = "The capital of France is", "Count to ten: one, two,"
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FAULT_AFTER = 2  # the fault hits once the bad request has this many output tokens: mid-generation


def _faulty(real, request_of):
    def fill(*args):
        request = request_of(args)
        if request.request_id == "bad" and request.num_output_tokens >= FAULT_AFTER:
            raise IndexError("injected fault")
        return real(*args)

    return fill


class _State:  # an output-processor RequestState, seen as a Request
    def __init__(self, state):
        self.request_id, self.num_output_tokens = state.request_id, len(state.detokenizer.token_ids)


# Where per-request host work runs, and how each function's arguments name its request.
FAULT_SITES = {
    "batch_rows": (input_batch, "_fill_row", lambda a: a[3].request),
    "sampling_rows": (input_batch, "_fill_sampling_row", lambda a: a[2].request),
    "reading_outputs": (step_output, "_read_outputs", lambda a: a[4].request),
    "output_processing": (output_processor.OutputProcessor, "_append_logprobs", lambda a: _State(a[1])),
}


def _run(llm, requests):
    outputs = {}
    for request_id, prompt in requests:
        ids = llm.tokenizer.encode(prompt)
        llm._add_request(request_id, prompt, ids, PARAMS, 0)
    while llm.engine_core.has_unfinished_requests():
        for output in llm._step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0]
    return outputs


@pytest.fixture(params=["async", "sync"])
def engine(request, llm):
    """The shared engine with async scheduling and without (the default on a CPU): a failure is isolated
    in both."""
    default = llm.engine_core.async_scheduling
    llm.engine_core.set_async_scheduling(request.param == "async")
    yield llm
    llm.engine_core.set_async_scheduling(default)


@pytest.mark.parametrize("site", list(FAULT_SITES))
def test_a_faulty_request_fails_alone(engine, monkeypatch, site):
    llm = engine
    [expected] = llm.generate(GOOD, PARAMS, use_tqdm=False)
    manager = llm.engine_core.kv_cache_manager
    num_free_blocks = manager.num_free_blocks

    module, name, request_of = FAULT_SITES[site]
    monkeypatch.setattr(module, name, _faulty(getattr(module, name), request_of))
    outputs = _run(llm, [("bad", BAD), ("good", GOOD)])

    assert outputs["bad"].finish_reason == "error"
    assert outputs["good"].finish_reason == "length"
    assert outputs["good"].token_ids == expected.outputs[0].token_ids
    assert outputs["good"].text == expected.outputs[0].text
    assert manager.num_free_blocks == num_free_blocks
    assert not llm.output_processor.has_unfinished_requests()

    monkeypatch.undo()  # the engine still serves the request that failed, now without the fault
    assert _run(llm, [("again", BAD)])["again"].finish_reason == "length"
