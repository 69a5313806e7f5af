"""Speculative drafts under a grammar, on the host: the structured-output manager cuts a request's drafts
at the first one its grammar rejects (or after the one that completes it), and builds one mask per
verified position (the mask after drafts 0..j-1), leaving the matcher where it was. SmolLM2's real
tokenizer and llguidance; no model, no jax."""

from __future__ import annotations

import time

import numpy as np
import pytest

from xlaserve.core.outputs import ScheduledRequest
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams, StructuredOutputsParams

K = 4  # drafts per step: masks of K + 1 positions


# `tokenizer` (SmolLM2's) and `manager` (a StructuredOutputManager on it): tests/engine/conftest.py


@pytest.fixture(scope="module")
def ids(tokenizer):
    def one(text: str) -> int:
        (token_id,) = tokenizer.encode(text, add_special_tokens=False)
        return token_id

    return {"ab": one("ab"), "cd": one("cd"), "x": one("x"), "end": one("ok"), "eos": 2}


def constrained(manager, request_id: str, regex: str, reasoning_end_token_id: int | None = None) -> Request:
    spec = StructuredOutputsParams(regex=regex, reasoning_end_token_id=reasoning_end_token_id)
    params = SamplingParams(max_tokens=16, structured_outputs=spec)
    request = Request(request_id, [1, 2, 3], params, eos_token_id=2)
    manager.add_request(request)
    deadline = time.monotonic() + 60
    while not request.grammar.is_ready:
        assert time.monotonic() < deadline, "grammar never compiled"
        time.sleep(0.01)
    request.num_computed_tokens = request.num_tokens - 1  # decoding: its last token is missing
    return request


def verifying(request: Request, drafts: list[int]) -> ScheduledRequest:
    request.spec_token_ids = []
    return ScheduledRequest(request, 1 + len(drafts), [1], spec_token_ids=list(drafts))


def allowed(row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def sequential_masks(manager, request: Request, tokens: list[int]) -> list[np.ndarray]:
    """The masks the engine without speculation would use: one step per token, the matcher advanced by
    each (on a fresh request with the same grammar)."""
    masks = []
    for token_id in [*tokens, None]:
        masks.append(manager.grammar_bitmask([ScheduledRequest(request, 1, [1])])[0])
        if token_id is not None:
            request.grammar.accept_token(token_id)
    return masks


def test_a_draft_the_grammar_rejects_cuts_the_drafts_there(manager, ids):
    regex = "(ab|cd){3}"
    request = constrained(manager, "cut", regex)
    request.spec_token_ids = [ids["ab"], ids["x"], ids["cd"]]  # the 2nd is not in the grammar
    manager.check_drafts([request])
    assert request.spec_token_ids == [ids["ab"]]
    # A draft model's sampled drafts keep the rejected one (verifying rejects it for sure, exactly).
    request.spec_token_ids = [ids["ab"], ids["x"], ids["cd"]]
    manager.check_drafts([request], keep_rejected=True)
    assert request.spec_token_ids == [ids["ab"], ids["x"]]
    before = manager.grammar_bitmask([verifying(request, [])])
    # One mask per position: position 0 before any draft, position 1 after "ab"; the rest allow all.
    bitmask = manager.grammar_bitmask([verifying(request, [ids["ab"]])], num_positions=K + 1)
    assert bitmask.shape == (1, K + 1, 49152 // 32) and bitmask.dtype == np.int32
    expected = sequential_masks(manager, constrained(manager, "ref", regex), [ids["ab"]])
    np.testing.assert_array_equal(bitmask[0, :2], np.stack(expected))
    assert (bitmask[0, 2:] == -1).all()
    assert ids["cd"] in allowed(bitmask[0, 1]) and ids["x"] not in allowed(bitmask[0, 1])
    # The walk was rolled back: the matcher is where it was, and still takes the real tokens.
    np.testing.assert_array_equal(manager.grammar_bitmask([verifying(request, [])]), before)
    for token_id in (ids["ab"], ids["cd"]):
        request.grammar.accept_token(token_id)
    assert request.grammar.error is None and not request.grammar.is_terminated


def test_masks_per_position_equal_the_sequential_ones(manager, ids):
    """Three drafts, all valid, beside an unconstrained row and a row without drafts."""
    regex = "(ab|cd){6}"
    drafts = [ids["cd"], ids["ab"], ids["ab"]]
    request, other = constrained(manager, "walk", regex), constrained(manager, "nodrafts", regex)
    plain = Request("plain", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_id=2)
    plain.num_computed_tokens = 2
    request.spec_token_ids = list(drafts)
    manager.check_drafts([request, other, plain])
    assert request.spec_token_ids == drafts
    scheduled = [verifying(plain, [ids["x"]]), verifying(request, drafts), verifying(other, [])]
    bitmask = manager.grammar_bitmask(scheduled, num_positions=K + 1)
    assert (bitmask[0] == -1).all()  # unconstrained
    expected = sequential_masks(manager, constrained(manager, "ref2", regex), drafts)
    np.testing.assert_array_equal(bitmask[1, : len(drafts) + 1], np.stack(expected))
    assert (bitmask[1, len(drafts) + 1 :] == -1).all()
    np.testing.assert_array_equal(bitmask[2, 0], expected[0])
    with pytest.raises(ValueError, match="positions"):  # more drafts than the verifier's positions
        manager.grammar_bitmask([verifying(request, drafts * 2)], num_positions=K + 1)


def test_drafts_stop_at_the_token_that_completes_the_grammar(manager, ids):
    request = constrained(manager, "stop", "(ab|cd){2}")
    request.spec_token_ids = [ids["ab"], ids["cd"], ids["eos"], ids["ab"]]
    manager.check_drafts([request], keep_rejected=True)
    assert request.spec_token_ids == [ids["ab"], ids["cd"]]  # the request stops at "cd"
    for token_id in request.spec_token_ids:
        request.grammar.accept_token(token_id)
    assert request.grammar.is_terminated
    request.spec_token_ids = [ids["eos"]]
    manager.check_drafts([request])
    assert request.spec_token_ids == []  # a terminated grammar drafts nothing


def test_reasoning_positions_are_free_until_the_end_id(manager, ids):
    """While a request reasons, its drafts are free up to the reasoning end id; the grammar masks the
    positions after it, from its first state."""
    end = ids["end"]
    request = constrained(manager, "think", "(ab|cd){3}", reasoning_end_token_id=end)
    request.spec_token_ids = [ids["x"], end, ids["ab"], ids["x"]]
    manager.check_drafts([request])
    assert request.spec_token_ids == [ids["x"], end, ids["ab"]]
    bitmask = manager.grammar_bitmask([verifying(request, request.spec_token_ids)], num_positions=K + 1)
    assert (bitmask[0, :2] == -1).all()
    expected = sequential_masks(manager, constrained(manager, "ref3", "(ab|cd){3}"), [ids["ab"]])
    np.testing.assert_array_equal(bitmask[0, 2:4], np.stack(expected))
    # Drafts that stay in the reasoning are all free, and need no mask.
    assert manager.grammar_bitmask([verifying(request, [ids["x"]])], num_positions=K + 1) is None
    assert request.grammar.is_reasoning  # nothing consumed by the walks
