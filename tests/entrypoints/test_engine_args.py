"""Engine arguments are declared once, on the config fields: every field has a flag (or says what
sets it instead), a flag's help is its field's, and a parsed command line becomes the same config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import pytest

from xlaserve.config import ARG_KEY, CONFIG_GROUPS, EngineConfig
from xlaserve.entrypoints.arg_utils import add_engine_args, engine_arg_fields, engine_kwargs

# Fields set by the server's own flags, not by engine flags (entrypoints' api_server), and per rank by
# make_engine_core (data_parallel_rank; vLLM's --data-parallel-rank starts one rank of a multi-node
# deployment, which is not built here).
NOT_FLAGS = {"served_model_name", "max_num_queued_reqs", "data_parallel_rank"}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def actions_by_flag(parser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions for name in action.option_strings}


def test_every_config_field_has_a_flag(parser):
    actions = actions_by_flag(parser)
    fields = [f for klass in CONFIG_GROUPS.values() for f in dataclasses.fields(klass)]
    fields.append(next(f for f in dataclasses.fields(EngineConfig) if f.name == "speculative"))
    undeclared = [f.name for f in fields if ARG_KEY not in f.metadata]
    assert undeclared == [], f"config fields without an Arg in their metadata: {undeclared}"
    without_flag = {f.name for f in fields if not f.metadata[ARG_KEY].is_flag}
    assert without_flag == NOT_FLAGS
    for f in fields:
        spec = f.metadata[ARG_KEY]
        if spec.is_flag:
            assert spec.flag_for(f.name) in actions, f.name
            assert all(alias in actions for alias in spec.aliases), f.name
    assert {f.name for _, f in engine_arg_fields()} == {f.name for f in fields}


def test_help_and_choices_come_from_the_field(parser):
    actions = actions_by_flag(parser)
    for _, f in engine_arg_fields():
        spec = f.metadata[ARG_KEY]
        if spec.is_flag:
            action = actions[spec.flag_for(f.name)]
            assert action.help == spec.help, f.name
            assert action.default is None, f.name  # unset: the config's default
            if spec.choices is not None:
                assert list(action.choices) == list(spec.choices), f.name
    assert "-tp" in actions and "-dp" in actions and "-q" in actions
    assert actions["--scheduling-policy"].dest == "scheduling_policy"


def test_flags_round_trip_into_the_config(parser):
    args = parser.parse_args(
        ["--max-num-seqs", "3", "-tp", "2", "--no-enable-prefix-caching", "--scheduling-policy", "priority",
         "--enforce-eager", "--dtype", "float32", "--kv-cache-memory", "1024", "--trust-remote-code",
         "--tokenizer-mode", "hf", "--cudagraph-capture-sizes", "16", "1"]
    )  # fmt: skip
    config = EngineConfig.from_kwargs(None, **engine_kwargs(args))
    assert config.scheduler.max_num_seqs == 3
    assert config.parallel.tensor_parallel_size == 2
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.policy == "priority"
    assert config.compilation.enforce_eager is True
    assert config.model.dtype == "float32"
    assert config.cache.kv_cache_memory == 1024
    assert config.model.trust_remote_code is True and config.model.tokenizer_mode == "hf"
    assert config.compilation.cudagraph_capture_sizes == (1, 16)
    # Everything not given keeps the config's default.
    default = EngineConfig.from_kwargs(None)
    assert config.scheduler.max_num_batched_tokens == default.scheduler.max_num_batched_tokens
    assert config.lora == default.lora


def test_tokenizer_modes_without_a_tokenizer_here_are_refused_by_name(parser, capsys):
    """vLLM's --tokenizer-mode: auto and hf are the Hugging Face tokenizer; slow (which transformers 5
    no longer has), mistral and custom are refused, argparse's way on the command line (exit 2) and
    naming the field for LLM(tokenizer_mode=...)."""
    for mode in ("slow", "mistral", "custom"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["--tokenizer-mode", mode])
        assert exited.value.code == 2
        message = f"--tokenizer-mode: invalid choice: '{mode}' \\(choose from '?auto'?, '?hf'?\\)"
        assert re.search(message, capsys.readouterr().err)
        with pytest.raises(ValueError, match=f"tokenizer_mode must be one of .*, got '{mode}'"):
            EngineConfig.from_kwargs(None, tokenizer_mode=mode)


def test_optimization_level_reaches_every_step_program(parser):
    """-O (vLLM's spelling) sets XLA's backend optimization level of the engine's programs: the step's
    four jitted functions carry it to their compiles; unset, they carry nothing (XLA's own level)."""
    from xlaserve.worker.step_programs import make_step_programs

    config = EngineConfig.from_kwargs(None, **engine_kwargs(parser.parse_args(["-O0"])))
    assert config.compilation.compiler_options() == {"xla_backend_optimization_level": 0}
    assert EngineConfig.from_kwargs(None).compilation.compiler_options() is None
    with pytest.raises(ValueError, match="optimization_level must be 0, 1, 2 or 3, got 4"):
        EngineConfig.from_kwargs(None, optimization_level=4)

    def carried(options) -> list:  # what each program's jax.jit passes its compiles
        programs = make_step_programs(None, 8, 2, False, options)
        jitted = [programs.forward, programs.sample, programs.prompt_logprobs, programs.verify]
        return [p.jitted._jit_info.compiler_options_kvs for p in jitted]

    assert carried(config.compilation.compiler_options()) == [(("xla_backend_optimization_level", 0),)] * 4
    assert carried(None) == [()] * 4


def test_every_flag_names_an_engine_argument(parser):
    """Each flag's dest is a keyword `from_kwargs` accepts (its field's default passes through)."""
    for group, f in engine_arg_fields():
        spec = f.metadata[ARG_KEY]
        if not spec.is_flag or f.name == "model" or group == "speculative":
            continue
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        config = EngineConfig.from_kwargs(None, **{spec.kwarg_for(f.name): value})
        assert getattr(getattr(config, group), f.name) == value


def test_bool_flags_keep_their_forms(parser):
    actions = actions_by_flag(parser)
    assert isinstance(actions["--async-scheduling"], argparse.BooleanOptionalAction)
    assert isinstance(actions["--enable-prefix-caching"], argparse.BooleanOptionalAction)
    assert actions["--enable-lora"].nargs == 0 and "--no-enable-lora" not in actions
    assert engine_kwargs(parser.parse_args(["--speculative-config", '{"method": "ngram"}'])) == {
        "speculative_config": '{"method": "ngram"}'
    }


def test_the_config_crosses_to_the_core_process_as_built(monkeypatch):
    """The engine core process receives the front end's EngineConfig (pickled into the spawn):
    environment-derived defaults are the front end's, not re-read in the core."""
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setenv("XLASERVE_ATTENTION_BACKEND", "reference")
    monkeypatch.setenv("XLASERVE_COMPILATION_CACHE_DIR", "/front/end/xla")
    config = EngineConfig.from_kwargs(None, max_num_seqs=3, speculative_config={"method": "ngram"})
    monkeypatch.delenv("XLASERVE_ATTENTION_BACKEND")
    monkeypatch.delenv("XLASERVE_COMPILATION_CACHE_DIR")
    received = ForkingPickler.loads(bytes(ForkingPickler.dumps(config)))
    assert received == config
    assert received.compilation.attention_backend == "reference"
    assert received.compilation.compilation_cache_dir == "/front/end/xla"


def test_pooling_flags_build_the_pooler_config(parser):
    """--runner, --convert and --pooler-config (JSON) reach ModelConfig; pooling over every token turns
    prefix caching off (a cached prefix's tokens would have no hidden states)."""
    args = parser.parse_args(
        [
            "--runner",
            "pooling",
            "--convert",
            "embed",
            "--pooler-config",
            '{"pooling_type": "mean", "dimensions": 8}',
        ]
    )
    config = EngineConfig.from_kwargs(None, **engine_kwargs(args))
    assert (config.model.runner, config.model.convert, config.model.pooling_type) == (
        "pooling",
        "embed",
        "MEAN",
    )
    assert config.model.pooler_config.dimensions == 8
    assert config.cache.enable_prefix_caching is False
    assert EngineConfig.from_kwargs(None, runner="pooling").cache.enable_prefix_caching is True  # LAST
    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of"):
        EngineConfig.from_kwargs(None, runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="need runner='pooling'"):
        EngineConfig.from_kwargs(None, convert="classify")


def test_the_generation_config_names_the_eos_ids(tmp_path):
    """vLLM's try_get_generation_config: generation_config.json's eos_token_id (an id or a list), else
    config.json's; under --generation-config vllm too (it drops only the sampling defaults); a folder
    given names another file. The input processor adds those past the tokenizer's EOS to every request's
    stop_token_ids (tests/engine/test_processor.py)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"eos_token_id": 128001}')
    (model / "generation_config.json").write_text('{"eos_token_id": [128001, 128008, 128009], "top_k": 5}')
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"eos_token_id": 7}')

    def eos_ids(**kwargs) -> tuple[int, ...]:
        return EngineConfig.from_kwargs(str(model), **kwargs).model.generation_eos_token_ids

    assert eos_ids() == eos_ids(generation_config="vllm") == (128001, 128008, 128009)
    assert eos_ids(generation_config=str(other)) == (7,)
    (model / "generation_config.json").unlink()
    assert eos_ids() == (128001,)
    assert EngineConfig.from_kwargs(None).model.generation_eos_token_ids == ()  # the embedded GGUF


def test_the_generation_config_gives_requests_defaults(parser, tmp_path):
    """vLLM's --generation-config auto: the model directory's generation_config.json gives the six fields
    vLLM takes (max_new_tokens as max_tokens; nulls and the rest ignored), --override-generation-config
    goes over it, `vllm` ignores the file (the override still counts), a folder names another file. Bad
    ones fail at start naming what is wrong. The CLI's generate and chat: a flag given, over the model's,
    over their own defaults."""
    from xlaserve.entrypoints.cli import build_parser, sampling_params

    model = tmp_path / "model"
    model.mkdir()
    fields = {"temperature": 0.6, "top_k": 20, "top_p": None, "max_new_tokens": 64, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps({**fields, "bos_token_id": 1}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"repetition_penalty": 1.1, "min_p": 0.05}')

    def defaults(*flags: str) -> dict:
        args = parser.parse_args(list(flags))
        return EngineConfig.from_kwargs(str(model), **engine_kwargs(args)).model.sampling_defaults()

    assert defaults() == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    override = ["--override-generation-config", '{"temperature": 0.2, "min_p": 0.1}']
    assert defaults(*override) == {"temperature": 0.2, "top_k": 20, "max_tokens": 64, "min_p": 0.1}
    assert defaults("--generation-config", "vllm") == {}
    assert defaults("--generation-config", "vllm", *override) == {"temperature": 0.2, "min_p": 0.1}
    assert defaults("--generation-config", str(other)) == {"repetition_penalty": 1.1, "min_p": 0.05}
    assert EngineConfig.from_kwargs(None).model.sampling_defaults() == {}  # the embedded GGUF: none
    with pytest.raises(ValueError, match="override_generation_config: unknown keys \\['temprature'\\]"):
        defaults("--override-generation-config", '{"temprature": 0.2}')
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        defaults("--generation-config", str(tmp_path))
    (model / "generation_config.json").write_text('{"top_p": ')
    with pytest.raises(
        ValueError, match=r"generation_config \(.*generation_config.json\) must be a JSON object"
    ):
        defaults()
    (model / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ValueError, match="generation_config.json: top_p must be in \\(0, 1\\]"):
        defaults()
    cli = build_parser()
    model_defaults = {"temperature": 0.6, "max_tokens": 64}
    args = cli.parse_args(["generate", "hi", "--top-k", "5"])
    assert (sampling_params(args, model_defaults).temperature, sampling_params(args, {}).temperature) == (
        0.6,
        0.7,
    )
    assert sampling_params(args, model_defaults).max_tokens == 64 and sampling_params(args, {}).top_k == 5
    args = cli.parse_args(["generate", "hi", "--temperature", "0", "--max-tokens", "3"])
    assert (
        sampling_params(args, model_defaults).temperature,
        sampling_params(args, model_defaults).max_tokens,
    ) == (0, 3)


@pytest.mark.parametrize(
    "flag, value", [("--num-prompts", "0"), ("--output-len", "-3"), ("--num-prompts", "x")]
)
def test_bench_counts_below_one_are_refused_naming_the_flag(capsys, flag, value):
    """`bench throughput|latency` measure nothing with 0 prompts or output tokens: argparse refuses them
    (the default is in the parser, so --help shows it)."""
    from xlaserve.entrypoints.cli import build_parser

    cli = build_parser()
    assert cli.parse_args(["bench", "latency", "--model", "m"]).num_prompts == 8
    with pytest.raises(SystemExit) as e:
        cli.parse_args(["bench", "throughput", "--model", "m", flag, value])
    assert (
        e.value.code == 2
        and f"argument {flag}: takes an integer >= 1, got '{value}'" in capsys.readouterr().err
    )
