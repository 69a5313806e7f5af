"""Beam search (`LLM.beam_search`, entrypoints/beam_search.py): SmolLM2's beams equal Hugging Face's
`generate(num_beams=...)` token for token (float32), a search in bfloat16 is the same whatever searches
run beside it (batch invariance), and the bookkeeping (EOS, length penalty, the text) on made-up
logprobs."""

from __future__ import annotations

import math

import pytest

from xlaserve import BeamSearchParams, SamplingParams
from xlaserve.entrypoints.beam_search import BeamSearch, BeamSearchSequence, beam_score
from xlaserve.outputs import Logprob

PROMPT = "The capital of France is"  # SmolLM2's best beam ends: " Paris." and EOS
OTHER = "def fibonacci(n):"
HF_PROMPTS = ["Once upon a time, in a small village,", "The three primary colors are"]


def test_beams_equal_hugging_face_generate_num_beams(llm, hf_model):
    """With no EOS among the candidates, vLLM's search and HF's pick the same beams: the best 4 of
    (beam, token) by cumulative logprob at every step. HF's `sequences_scores` are the cumulative
    logprob over the generated length (length_penalty 1). Two prompts searched together."""
    import torch

    params = BeamSearchParams(beam_width=4, max_tokens=6)
    outputs = llm.beam_search(HF_PROMPTS, params)
    tokenizer = llm.get_tokenizer()
    for prompt, ours in zip(HF_PROMPTS, outputs, strict=True):
        prompt_ids = tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt_ids]),
                num_beams=4,
                num_return_sequences=4,
                max_new_tokens=6,
                do_sample=False,
                length_penalty=1.0,
                early_stopping=False,
                output_scores=True,
                return_dict_in_generate=True,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        assert [beam.finish_reason for beam in ours.sequences] == ["length"] * 4  # no EOS: the case compared
        assert [beam.tokens for beam in ours.sequences] == ref.sequences.tolist()
        for beam, score in zip(ours.sequences, ref.sequences_scores.tolist()):
            generated = beam.tokens[len(prompt_ids) :]
            assert beam.cum_logprob / 6 == pytest.approx(score, abs=1e-4)
            assert len(beam.logprobs) == 6 and beam.text == tokenizer.decode(generated)
            # Each step's candidates: the 2 x beam_width most likely, the chosen token among them.
            assert all(len(step) == 8 and token in step for step, token in zip(beam.logprobs, generated))
            assert beam.cum_logprob == pytest.approx(
                sum(step[token].logprob for step, token in zip(beam.logprobs, generated)), abs=1e-5
            )


def test_a_bfloat16_search_is_the_same_beside_others(llm_bf16):
    """Batch invariance: a prompt's beams, searched alone or beside another prompt's (8 beams a step
    instead of 4), are the same bit for bit, their logprobs too."""
    params = BeamSearchParams(beam_width=4, max_tokens=5)
    (alone,) = llm_bf16.beam_search([PROMPT], params)
    together = llm_bf16.beam_search([OTHER, PROMPT], params)
    assert together[1] == alone and together[0].sequences[0].tokens[:5] != alone.sequences[0].tokens[:5]
    assert len({tuple(beam.tokens) for beam in alone.sequences}) == 4
    # Each beam's logprobs are the prompt logprobs of its tokens fed back as one prompt, bit for bit.
    for beam in alone.sequences:
        forced = llm_bf16.generate(
            {"prompt_token_ids": beam.tokens},
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )[0].prompt_logprobs
        num_generated = len(beam.logprobs)  # 5, or fewer for a beam ended by EOS
        generated = beam.tokens[-num_generated:]
        assert [e[t].logprob for e, t in zip(forced[-num_generated:], generated)] == [
            step[t].logprob for step, t in zip(beam.logprobs, generated)
        ]


def test_a_beam_ended_by_eos_ranks_by_vllms_score(llm):
    """SmolLM2's " Paris." then EOS is set aside finished at step 3 and ranks first: vLLM's score divides
    by the length with the prompt's tokens (HF's by the generated ones, which ranks it below the live
    beams: the one case where the two searches differ). Its text leaves the EOS out."""
    (output,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=6))
    best, *live = output.sequences
    num_prompt = len(llm.get_tokenizer().encode(PROMPT))
    assert best.finish_reason == "stop" and best.tokens[-1] == llm.get_tokenizer().eos_token_id
    assert best.text == " Paris." and len(best.logprobs) == len(best.tokens) - num_prompt == 3
    assert [beam.finish_reason for beam in live] == ["length"] * 3
    assert all(beam.cum_logprob < best.cum_logprob for beam in live)


def test_refusals_name_the_field(llm):
    free_before = llm.engine_core.kv_cache_manager.num_free_blocks
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match=r"beam_width must be at most 10 .*max_logprobs, 20\), got 11"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.nan)
    with pytest.raises(ValueError, match=r"maximum context length is 512 tokens, but 515 were requested"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=510))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([PROMPT], {"beam_width": 2})
    assert llm.engine_core.kv_cache_manager.num_free_blocks == free_before  # nothing was left running


def _step(*pairs) -> dict[int, Logprob]:
    return {token: Logprob(logprob) for token, logprob in pairs}


EOS = 9


def test_eos_sets_a_beam_aside_and_the_length_penalty_ranks_the_finished():
    """Step 1 from one beam: tokens 1 and 2 live, EOS finished at once. Step 2: each live beam's best
    continuation. With length_penalty 0 the scores are the sums: the beam finished in step 2 (-0.6)
    ranks first; with a large penalty, the live beams' longer length divides their sums by more, and
    both beat it."""
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=0.0)
    search = BeamSearch([5, 6], params, EOS)
    search.advance([_step((1, -0.5), (EOS, -1.0), (2, -0.7), (3, -3.0))])
    assert [b.tokens for b in search.beams] == [[5, 6, 1], [5, 6, 2]]
    assert [b.tokens for b in search.finished] == [[5, 6, EOS]]
    search.advance([_step((4, -0.9), (EOS, -0.1)), _step((4, -0.2), (3, -2.0))])
    assert search.is_done and [b.tokens for b in search.beams] == [[5, 6, 2, 4], [5, 6, 1, 4]]
    best = search.result(lambda ids: " ".join(map(str, ids)))
    assert [(b.tokens, b.finish_reason, b.text) for b in best.sequences] == [
        ([5, 6, 1, EOS], "stop", "1"),  # -0.6: the EOS's text left out
        ([5, 6, 2, 4], "length", "2 4"),  # -0.9
    ]
    # vLLM's score: the length counts the prompt, not a final EOS.
    finished = BeamSearchSequence([5, 6, 1, EOS], cum_logprob=-0.6)
    assert beam_score(finished, EOS, 2.0) == pytest.approx(-0.6 / 9)
    long_search = BeamSearch([5, 6], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=3.0), EOS)
    long_search.beams, long_search.finished = search.beams, [finished]
    ranked = long_search.result(None).sequences
    assert [b.tokens for b in ranked] == [[5, 6, 2, 4], [5, 6, 1, 4]] and ranked[0].text is None


def test_ignore_eos_keeps_eos_beams_live_and_include_stop_str_keeps_its_text():
    search = BeamSearch([5], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), EOS)
    search.advance([_step((EOS, -0.1), (2, -0.2))])
    assert [b.tokens for b in search.beams] == [[5, EOS]] and search.finished == []
    search = BeamSearch(
        [5], BeamSearchParams(beam_width=1, max_tokens=3, include_stop_str_in_output=True), EOS
    )
    search.advance([_step((EOS, -0.1), (2, -5.0))])
    search.advance([_step((EOS, -9.0), (3, -9.0))])
    assert search.result(str).sequences[0].text == str([EOS])
