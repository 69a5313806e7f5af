"""build_step_batch and sampling_tensors isolate each request's host work: a request whose rows
raise becomes a dummy sequence over the null block, and so does any request that reads a block the
failed one was to write in this step; the other rows are exactly what they would have been."""

from __future__ import annotations

import numpy as np
import pytest

from xlaserve.core.outputs import ScheduledRequest
from xlaserve.core.request import Request
from xlaserve.sampling_params import SamplingParams
from xlaserve.worker import input_batch
from xlaserve.worker.input_batch import build_step_batch, sampling_tensors

BLOCK_SIZE = 4


def scheduled(request_id, prompt, block_ids, num_computed=0, **params):
    request = Request(request_id, prompt, SamplingParams(max_tokens=4, **params))
    request.num_computed_tokens = num_computed
    return ScheduledRequest(request, len(prompt) - num_computed, block_ids)


@pytest.fixture
def faulty_rows(monkeypatch):
    real = input_batch._fill_row

    def fill(arrays, row, offset, s, block_size):
        if s.request_id == "bad":
            raise IndexError("injected")
        return real(arrays, row, offset, s, block_size)

    monkeypatch.setattr(input_batch, "_fill_row", fill)


def build(batch, failed):
    return build_step_batch(batch, 32, 4, 8, BLOCK_SIZE, failed)


def test_a_failing_row_is_a_dummy_and_the_others_are_untouched(faulty_rows):
    batch = [
        scheduled("ok1", range(10, 16), [3, 4]),
        scheduled("bad", range(6), [5, 6]),
        scheduled("ok2", [7], [8]),
    ]
    expected = build([batch[0], scheduled("gap", range(6), [5, 6]), batch[2]], set())
    failed = set()
    step = build(batch, failed)
    assert failed == {"bad"}
    md, want = step.md, expected.md
    np.testing.assert_array_equal(md.query_start_loc, want.query_start_loc)  # the layout is kept
    np.testing.assert_array_equal(step.logits_indices, expected.logits_indices)
    bad = slice(6, 12)
    assert (md.slot_mapping[bad] == 0).all() and (md.block_tables[1] == 0).all() and md.kv_lens[1] == 6
    for rows in (slice(0, 6), slice(12, 13)):
        np.testing.assert_array_equal(md.slot_mapping[rows], want.slot_mapping[rows])
        np.testing.assert_array_equal(step.input_ids[rows], expected.input_ids[rows])
    np.testing.assert_array_equal(md.block_tables[[0, 2]], want.block_tables[[0, 2]])


def test_a_request_reading_blocks_the_failed_one_was_to_write_fails_too(faulty_rows):
    # "bad" fills blocks 5 and 6 this step; "sharer" hit block 5 in the prefix cache (same step).
    batch = [
        scheduled("bad", range(8), [5, 6]),
        scheduled("sharer", [*range(4), 9, 9], [5, 7], num_computed=4),
        scheduled("ok", range(20, 23), [8]),
    ]
    failed = set()
    step = build(batch, failed)
    assert failed == {"bad", "sharer"}
    assert (step.md.block_tables[:2] == 0).all() and (step.md.slot_mapping[:10] == 0).all()
    assert step.md.block_tables[2, 0] == 8


def test_a_failing_sampling_row_keeps_the_padding_values(monkeypatch):
    real = input_batch._fill_sampling_row

    def fill(scalars, row, s):
        if s.request_id == "bad":
            raise ValueError("injected")
        return real(scalars, row, s)

    monkeypatch.setattr(input_batch, "_fill_sampling_row", fill)
    batch = [scheduled("bad", [1, 2], [1], temperature=0.5), scheduled("ok", [3], [2], temperature=0.7)]
    failed = set()
    st = sampling_tensors(batch, 4, 16, with_penalties=True, failed=failed)
    assert failed == {"bad"}
    np.testing.assert_allclose(st.temperature, [0.0, 0.7, 0.0, 0.0])
    assert not st.prompt_mask[0].any() and st.prompt_mask[1, 3]


def test_a_placeholder_is_read_from_the_previous_steps_row():
    """Async scheduling: a token the previous step sampled (unknown here) points at its row of the
    device's last sampled ids; its seed index and min_tokens count it."""
    plain = scheduled("plain", [1, 2, 3], [1])
    request = Request("async", [5, 6, 7], SamplingParams(max_tokens=4, min_tokens=2, temperature=1.0))
    request.num_computed_tokens, request.num_output_placeholders, request.last_sampled_row = 3, 1, 6
    decode = ScheduledRequest(request, 1, [2])
    assert decode.prev_sampled_row == 6 and decode.is_sampling and decode.sample_index == 1
    batch = build([plain, decode], set())
    assert batch.input_ids[:4].tolist() == [1, 2, 3, 0]  # the id itself comes from the device
    assert batch.prev_rows[:5].tolist() == [-1, -1, -1, 6, -1]
    assert batch.positions[3] == 3 and batch.md.kv_lens[1] == 4
    st = sampling_tensors([plain, decode], 4, 64, True)
    assert st.token_index[1] == 1 and st.logit_bias is not None


def test_bad_words_ban_a_words_last_token_where_the_output_ends_with_the_rest():
    """A one-token bad word is banned always; a longer one's last token only after its other tokens,
    in order, end the output so far. Logit biases and allowed ids join the same row."""
    params = SamplingParams(
        max_tokens=8,
        bad_words_token_ids=[[7], [3, 9], [4, 5, 6]],
        logit_bias={11: 2.5},
        allowed_token_ids=list(range(14)),
    )
    request = Request("words", [1, 2], params)
    request.num_computed_tokens = 2
    banned = []
    for output in ([], [3], [4, 5], [5, 4]):
        request.output_token_ids.clear()
        request.append_output_token_ids(output)
        request.num_computed_tokens = 2 + len(output)
        st = sampling_tensors([ScheduledRequest(request, 1, [1])], 2, 16, True)
        row = st.logit_bias[0]
        banned.append(sorted(int(t) for t in np.flatnonzero(np.isneginf(row)) if t < 14))
        assert row[11] == 2.5 and np.isneginf(row[14:]).all()  # outside allowed_token_ids
    assert banned == [[7], [7, 9], [6, 7], [7]]
    assert params.reads_output_tokens and SamplingParams(bad_words_token_ids=[[7]]).has_token_biases
    assert not SamplingParams(bad_words_token_ids=[[7]]).reads_output_tokens  # async scheduling goes on
