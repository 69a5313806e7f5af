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


@pytest.mark.parametrize("command", [["generate", "hi", "--model", "m"], ["chat", "--model", "m"]])
def test_a_followers_engine_is_sized_as_process_0s(monkeypatch, command):
    """`xlaserve generate` (or `chat`) `--nnodes 2 --node-rank 1` serves process 0's steps with the
    engine process 0 builds: the one-request sizing too, not only the flags (else the two compile other
    programs and a step's collectives wait on each other for good)."""
    from xlaserve.entrypoints import llm

    followed = {}
    monkeypatch.setattr(llm, "serve_follower", lambda model, **kwargs: followed.update(kwargs, model=model))
    multi = [*command, "--nnodes", "2", "--master-addr", "127.0.0.1"]
    args = build_parser().parse_args([*multi, "--node-rank", "1"])
    assert args.func(args) == 0
    leader = one_request_engine_kwargs(build_parser().parse_args([*multi, "--node-rank", "0"]))
    assert followed.pop("model") == "m"
    assert (followed.pop("node_rank"), leader.pop("node_rank", 0)) == (1, 0)
    assert followed == leader and (leader["max_num_seqs"], leader["max_num_batched_tokens"]) == (1, 128)


def test_generate_leaves_the_fast_exit_to_the_console_script(tmp_path, capsys, monkeypatch):
    """In process, `main(["generate", ...])` returns its code (a Python caller keeps its process) and
    marks the exit without teardown that the console script (`run`) then takes. (The console script
    itself runs in test_multihost.py and test_compilation_cache.py: exit code 0, the text on stdout.)"""
    from helpers.tiny_models import save_tiny_llama, small_byte_tokenizer
    from xlaserve.entrypoints import cli

    model = save_tiny_llama(str(tmp_path / "model"), tokenizer=small_byte_tokenizer())
    monkeypatch.setattr(cli, "_exit_without_teardown", False)
    argv = ["--log-level", "WARNING", "generate", "hi", "--model", model, "--raw", "--max-tokens", "2",
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
            "--kv-cache-memory", str(2**22)]  # fmt: skip
    assert cli.main(argv) == 0
    assert cli._exit_without_teardown is True
    assert capsys.readouterr().out.endswith("\n")
