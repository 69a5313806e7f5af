"""Warm-up: every program a ModelRunner can call, compiled before the first request.

The compile guard (worker/compile_guard.py) is armed after it; the strict guard in the tests proves
that the steps that follow find every program compiled here.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from tqdm import tqdm

from xlaserve.worker.compile_guard import compile_seconds, num_cache_hits, num_compiles
from xlaserve.worker.input_batch import sampling_tensors
from xlaserve.worker.spec_decode import build_spec_inputs

logger = logging.getLogger(__name__)


def compile_all(runner) -> None:
    """Compile every program `runner` (a ModelRunner) may call: each token bucket's forward and
    prompt logprobs, and every sampler (and verify) variant per request bucket.

    XLA's compiles release the GIL, so they run in a pool of one thread per core: the forward
    of every bucket is compiled ahead of time (`lower().compile()` fills the same cache a call
    reads), and once a bucket's forward has run, its prompt-logprobs and sampler programs compile
    from its outputs (arrays, not shape structs: a program lowered for a shape struct is keyed
    apart from the call's and would compile again) while the next forwards still compile. The
    strict compile guard in the tests proves the first steps find every program."""
    start_compiles, start_secs, t0 = num_compiles(), compile_seconds(), time.perf_counter()
    start_hits = num_cache_hits()
    vocab = runner.padded_vocab_size
    ready = runner.placement.step_inputs
    if runner.lora is not None:
        runner.lora.warm_up()
    batches = {n: runner._build_batch([], n) for n in runner.token_buckets}

    def lower_forward(batch):  # in this thread, before the cache is donated by a first run
        return runner._forward_fn.lower(*runner._forward_args(runner.kv_cache, batch))

    # Only the main thread runs programs, in the same order on every process (a multi-host
    # engine's collectives must match); the pool only compiles.
    def compile_sampler(hidden_rd, st):
        runner._sample_fn.lower(runner.head_params, hidden_rd, ready(st), with_logprobs=False).compile()

    def compile_verify(hidden_rd, st, spec, with_logprobs):
        q_args = runner._draft_probs(np.zeros_like(spec.num_drafts))
        runner._verify_fn.lower(
            runner.head_params, hidden_rd, ready(st), ready(spec), *q_args, with_logprobs=with_logprobs
        ).compile()

    def compile_prompt_logprobs(hidden, num_tokens):
        targets = ready(np.zeros(num_tokens, np.int32))
        runner._prompt_logprobs_fn.lower(runner.head_params, hidden, targets).compile()

    sampler_buckets_done, jobs = set(), []
    with _compile_pool() as pool:
        forwards = {n: pool.submit(lower_forward(batches[n]).compile) for n in runner.token_buckets}
        for num_tokens in tqdm(runner.token_buckets, desc="Compiling buckets", unit="bucket"):
            forwards[num_tokens].result()
            hidden, hidden_rd = runner._run_forward(batches[num_tokens])  # compiled: runs only
            jobs.append(pool.submit(compile_prompt_logprobs, hidden, num_tokens))
            num_seqs = runner._num_seqs_for(num_tokens)
            if runner.drafter is not None:  # one draft program per token bucket
                jobs.append(pool.submit(runner.drafter.lower_step(batches[num_tokens], num_seqs).compile))
            if num_seqs in sampler_buckets_done:
                continue
            sampler_buckets_done.add(num_seqs)
            # The sampler's static variants: penalties and a grammar's token bitmask, each on or
            # off. Logprobs are a runtime flag of the same programs (sampler.py).
            for with_penalties, with_grammar in itertools.product((False, True), repeat=2):
                bitmask = np.zeros((0, 1), np.int32) if with_grammar else None
                st = sampling_tensors([], num_seqs, vocab, with_penalties, grammar_bitmask=bitmask)
                jobs.append(pool.submit(compile_sampler, hidden_rd, st))
                if runner.num_spec_tokens:  # the same variants verifying drafts (logprobs static)
                    spec = build_spec_inputs([], num_seqs, runner.num_spec_tokens)
                    if with_grammar:  # one mask per verified position
                        bitmask = np.zeros((0, runner.num_spec_tokens + 1, 1), np.int32)
                        st = sampling_tensors([], num_seqs, vocab, with_penalties, grammar_bitmask=bitmask)
                    for with_logprobs in (False, True):
                        jobs.append(pool.submit(compile_verify, hidden_rd, st, spec, with_logprobs))
        for job in jobs:
            job.result()
    logger.info(
        "warm-up: %d programs for %d token buckets %s in %.1fs (%d from the persistent cache; "
        "XLA compile time %.1fs)",
        num_compiles() - start_compiles,
        len(runner.token_buckets),
        runner.token_buckets,
        time.perf_counter() - t0,
        num_cache_hits() - start_hits,
        compile_seconds() - start_secs,
    )


class _InlinePool:
    """A stand-in for ThreadPoolExecutor that runs each job as it is submitted."""

    def __enter__(runner):
        return runner

    def __exit__(runner, *exc):
        return False

    def submit(runner, fn, *args) -> Future:
        future = Future()
        future.set_result(fn(*args))
        return future


def _compile_pool():
    """Where warm-up compiles: a pool of one thread per core in one process. A multi-host engine
    compiles inline, in the same order on every process: compiling beside a running program whose
    collectives wait on the other processes hung the two-process server at start-up."""
    if jax.process_count() > 1:
        return _InlinePool()
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="warm-up")
