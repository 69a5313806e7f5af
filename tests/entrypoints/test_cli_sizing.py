"""`xlaserve generate` and `chat` size the engine to one request unless told otherwise: fewer token
buckets and one request bucket, so fewer programs to compile at start-up."""

from __future__ import annotations

import pytest

from xlaserve.config import EngineConfig
from xlaserve.entrypoints.cli import build_parser, one_request_engine_kwargs
from xlaserve.worker.buckets import make_token_buckets, request_bucket


def kwargs_for(*argv):
    return one_request_engine_kwargs(build_parser().parse_args(["generate", "hi", *argv]))


def test_generate_defaults_to_one_sequence_and_128_token_steps():
    kwargs = kwargs_for()
    assert kwargs["max_num_seqs"] == 1 and kwargs["max_num_batched_tokens"] == 128
    config = EngineConfig.from_kwargs(None, **kwargs)
    buckets = make_token_buckets(config.scheduler.max_num_batched_tokens)
    assert buckets == [1, 4, 16, 32, 64, 128]
    assert {request_bucket(n, config.scheduler.max_num_seqs) for n in buckets} == {1}
    server = EngineConfig.from_kwargs(None)  # what `serve` keeps: more buckets, more request buckets
    server_buckets = make_token_buckets(server.scheduler.max_num_batched_tokens)
    assert len(server_buckets) > len(buckets)
    assert len({request_bucket(n, server.scheduler.max_num_seqs) for n in server_buckets}) > 1


@pytest.mark.parametrize(
    "argv, seqs, tokens",
    [
        (["--max-num-seqs", "4"], 4, 128),
        (["--max-num-batched-tokens", "512"], 1, 512),
        (["--max-num-seqs", "256"], 256, 256),  # a step must hold one token per sequence
    ],
)
def test_flags_the_user_sets_win(argv, seqs, tokens):
    kwargs = kwargs_for(*argv)
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (seqs, tokens)
