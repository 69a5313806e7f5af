"""Warm-up: every program a ModelRunner can call, loaded or compiled before the first request.

The compile guard (worker/compile_guard.py) is armed after it; the strict guard in the tests proves
that the steps that follow find every program compiled here.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np
from jax.experimental.compilation_cache.compilation_cache import reset_cache
from tqdm import tqdm

from xlaserve.worker.compile_guard import compile_seconds, num_cache_hits, num_compiles, num_own_compiles
from xlaserve.worker.input_batch import sampling_tensors
from xlaserve.worker.program import Program
from xlaserve.worker.program_store import ProgramStore
from xlaserve.worker.spec_decode import build_spec_inputs

logger = logging.getLogger(__name__)


def compile_all(runner) -> None:
    """Make ready every program `runner` (a ModelRunner) may call: each token bucket's forward and
    prompt logprobs, and every sampler (and verify) variant per request bucket; with
    `warm_up_plain_sampling_only`, the forwards and the sampler without penalties or a grammar alone.

    Each program is loaded from the engine's store of executables when a warm start finds it there
    (worker/program_store.py), else lowered, compiled and stored; either way its executable is what
    the steps call (worker/program.py). XLA's compiles release the GIL, so they run in a pool of one
    thread per core: the forwards first, and once a bucket's forward is ready, its prompt-logprobs
    and sampler programs, lowered for the forward's outputs (shape structs with their shardings),
    while the next forwards still compile. Nothing runs on the device. The strict compile guard in
    the tests proves the first steps find every program."""
    start_compiles, start_secs, t0 = num_compiles(), compile_seconds(), time.perf_counter()
    start_hits = num_cache_hits()
    store = ProgramStore.for_engine(runner.config, runner.hf_config, list(runner.mesh.devices.flat))
    vocab = runner.padded_vocab_size
    ready = runner.placement.step_inputs
    batches = {n: runner._build_batch([], n) for n in runner.token_buckets}
    hook_arrays = {n: runner._prepare_hooks([], n, set()) for n in runner.token_buckets}
    # The features' own programs (a draft model's step per bucket), loaded or compiled as the step's.
    hook_programs = [p for hook in runner.hooks for p in hook.warm_up(batches, runner._num_seqs_for)]
    plain_only = runner.config.compilation.warm_up_plain_sampling_only
    variants = [(False, False)] if plain_only else list(itertools.product((False, True), repeat=2))

    def prepare(program, args, kwargs=None):
        return _load_or_compile(store, program, args, kwargs or {})

    sampler_buckets_done, jobs = set(), []
    with _compile_pool() as pool, _fresh_compiles(store):
        forwards = {
            n: pool.submit(
                prepare, runner._forward_fn, runner._forward_args(runner.kv_cache, batches[n], hook_arrays[n])
            )
            for n in runner.token_buckets
        }
        for num_tokens in tqdm(runner.token_buckets, desc="Compiling buckets", unit="bucket"):
            forward, _ = forwards[num_tokens].result()
            hidden, hidden_rd = (_shape_struct(s) for s in forward.out_info[:2])
            if not plain_only:
                plp_args = (runner.head_params, hidden, ready(np.zeros(num_tokens, np.int32)))
                jobs.append(pool.submit(prepare, runner._prompt_logprobs_fn, plp_args))
            num_seqs = runner._num_seqs_for(num_tokens)
            if num_seqs in sampler_buckets_done:
                continue
            sampler_buckets_done.add(num_seqs)
            # The sampler's static variants: penalties and a grammar's token bitmask, each on or
            # off. Logprobs are a runtime flag of the same programs (sampler.py).
            for with_penalties, with_grammar in variants:
                bitmask = np.zeros((0, 1), np.int32) if with_grammar else None
                st = ready(sampling_tensors([], num_seqs, vocab, with_penalties, grammar_bitmask=bitmask))
                args = (runner.head_params, hidden_rd, st)
                jobs.append(pool.submit(prepare, runner._sample_fn, args, {"with_logprobs": False}))
                if runner.num_spec_tokens:  # the same variants verifying drafts (logprobs a runtime flag too)
                    spec = ready(build_spec_inputs([], num_seqs, runner.num_spec_tokens))
                    if with_grammar:  # one mask per verified position
                        bitmask = np.zeros((0, runner.num_spec_tokens + 1, 1), np.int32)
                        st = ready(
                            sampling_tensors([], num_seqs, vocab, with_penalties, grammar_bitmask=bitmask)
                        )
                    args = (
                        runner.head_params,
                        hidden_rd,
                        st,
                        spec,
                        runner._verify_q(hook_arrays[num_tokens]),
                    )
                    jobs.append(pool.submit(prepare, runner._verify_fn, args, {"with_logprobs": False}))
        jobs += [pool.submit(prepare, program, args) for program, args in hook_programs]
        results = [f.result() for f in forwards.values()] + [job.result() for job in jobs]
    num_loaded = sum(is_loaded for _, is_loaded in results)
    num_compiled = num_compiles() - start_compiles
    logger.info(
        "warm-up: %d programs for %d token buckets %s in %.1fs (%d loaded ahead of time, %d compiled, "
        "%d from the persistent cache; XLA compile time %.1fs)",
        num_loaded + num_compiled,
        len(runner.token_buckets),
        runner.token_buckets,
        time.perf_counter() - t0,
        num_loaded,
        num_compiled,
        num_cache_hits() - start_hits,
        compile_seconds() - start_secs,
    )
    runner.num_programs_loaded, runner.num_programs_compiled = num_loaded, num_compiled


@contextlib.contextmanager
def _fresh_compiles(store: ProgramStore | None):
    """With a store, compile without XLA's persistent cache: the store keeps only what XLA compiled (an
    executable that cache loaded serializes incompletely on CPU, jax 0.10: "Function ... not found" when
    the stored copy runs), so a program found there would be compiled again (_compile_afresh). Without
    one, as configured."""
    if store is None or not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()  # JAX decides once whether its cache is used; ask it again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        reset_cache()


def _shape_struct(info) -> jax.ShapeDtypeStruct:
    """An output's shape, dtype and sharding (not its layout: the default one)."""
    return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=info.sharding)


def _load_or_compile(store: ProgramStore | None, program: Program, args: tuple, kwargs: dict):
    """-> (the executable for (args, kwargs), whether it was loaded), routed to by `program`.

    The store is asked twice: by the engine's settings and the abstract arguments (no tracing), then,
    on a miss, by the lowered program's text, which another engine (other settings, another checkpoint
    of the model's shapes) may have stored; a compile is stored under both keys."""
    call_kwargs = {k: v for k, v in kwargs.items() if k not in program.static_argnames}
    if store is None:
        executable, is_loaded = program.lower(*args, **kwargs).compile(), False
    else:
        key = store.key(program.name, args, kwargs)
        executable = store.load(key, args, call_kwargs)
        is_loaded = executable is not None
        if not is_loaded:
            lowered = program.lower(*args, **kwargs)
            text_key = store.text_key(lowered, args, kwargs)
            executable = store.load(text_key, args, call_kwargs)
            is_loaded = executable is not None
            if is_loaded:
                store.copy(text_key, key)  # the next start of these settings finds it without lowering
            else:
                executable = _compile_afresh(lowered)
                store.save(executable, key, text_key)
    program.add(args, kwargs, executable)
    return executable, is_loaded


# A compiler option at XLA's default: a program compiled with it is the same, under another key of jax's
# in-memory cache of executables.
_ANOTHER_KEY = {"xla_embed_ir_in_executable": False}


def _compile_afresh(lowered):
    """`lowered`'s executable as XLA compiled it in this thread, for the store. jax may give back one
    XLA's persistent cache loaded (with the cache on), or its in-memory copy of a program the process
    ran before (maybe one that cache loaded); these serialize without their kernels on CPU ("Function
    ... not found" in the process that loads them from the store), so the program is compiled again
    under another key of jax's in-memory cache (one only this function compiles with, with XLA's cache
    off in warm-up: what jax keeps under it was compiled)."""
    own_compiles = num_own_compiles()
    executable = lowered.compile()
    if num_own_compiles() == own_compiles:
        executable = lowered.compile(compiler_options=_ANOTHER_KEY)
    return executable


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
