"""`xlaserve bench throughput|latency` on a tiny random model: the report's counts add up."""

from __future__ import annotations

import json

import pytest

from helpers.tiny_models import save_repeating_llama, save_tiny_llama, small_byte_tokenizer
from xlaserve.entrypoints import cli

# The bench's workloads are chat conversations: a plain template over a 320-token byte vocabulary
# (SmolLM2's 49,152 made every sampler program ~150x wider to compile; nothing here reads the vocab).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_bench_llama(directory: str, **overrides) -> str:
    return save_tiny_llama(
        directory, tokenizer=small_byte_tokenizer(), chat_template=CHAT_TEMPLATE, **overrides
    )


# Every bench here runs at --max-num-batched-tokens 16: an engine compiles the buckets its steps use (1, 4,
# 16; at 64 also 32 and 64), and no test reads the step size, only counts, pairs and ratios.
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_bench_llama(str(tmp_path_factory.mktemp("tiny_llama_bench")))


@pytest.mark.parametrize("bench, num_prompts", [("throughput", 6), ("latency", 2)])
def test_bench_reports_what_it_ran(tiny_llama, tmp_path, bench, num_prompts):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        bench,
        "--model",
        tiny_llama,
        "--num-prompts",
        str(num_prompts),
        "--output-len",
        "5",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "16",
        "--kv-cache-memory",
        str(2**22),
        "--enforce-eager",
        "--output-json",
        str(out),
    ] + (["--compare-async"] if bench == "throughput" else ["--roofline", "--async-scheduling"])
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == bench and report["num_prompts"] == num_prompts and report["output_len"] == 5
    r = report["xlaserve"]
    assert r["num_requests"] == num_prompts
    # ignore_eos: exactly output_len tokens per request.
    assert r["output_tokens_per_s"] * r["elapsed_s"] == pytest.approx(num_prompts * 5)
    # At least one step per output token; one at a time (latency), every request takes its own 5.
    assert r["num_steps"] >= 5 * (num_prompts if bench == "latency" else 1)
    assert 0 < r["host_ms_per_step"] < r["elapsed_s"] * 1e3 / r["num_steps"]
    assert r["ttft_s"]["mean"] > 0 and r["tpot_s"]["mean"] > 0
    # Idle time per step, the host's and the device's, fit in a step's wall time.
    step_ms = r["elapsed_s"] * 1e3 / r["num_steps"]
    assert 0 <= r["host_idle_ms_per_step"] < step_ms and 0 <= r["device_idle_ms_per_step"] < step_ms
    # Async: as --compare-async sets it, or asked for on a CPU (where it is off by default).
    assert r["async_scheduling"]
    if bench == "throughput":  # --compare-async: the same workload, synchronous, on the same engine
        sync = report["xlaserve_sync"]
        assert not sync["async_scheduling"]
        assert sync["output_tokens_per_s"] * sync["elapsed_s"] == pytest.approx(num_prompts * 5)
        assert report["ratio_async_over_sync_output_throughput"] == pytest.approx(
            r["output_tokens_per_s"] / sync["output_tokens_per_s"]
        )
    else:  # --roofline: TPOT over the weights' bytes read at the measured copy bandwidth
        roof = report["roofline"]
        assert roof["tpot_s"] == r["tpot_s"]["mean"] and roof["copy_bandwidth_bytes_per_s"] > 0
        assert roof["weight_read_s"] == pytest.approx(
            roof["weight_bytes"] / roof["copy_bandwidth_bytes_per_s"]
        )
        assert roof["ratio"] == pytest.approx(roof["tpot_s"] / roof["weight_read_s"])
        assert roof["target"] == 1.15 and roof["met"] is False  # judged on a GPU only


def test_random_prompts_have_the_asked_length_and_no_special_tokens(tiny_llama, tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--num-prompts",
        "3",
        "--input-len",
        "40",
        "--output-len",
        "2",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "16",
        "--kv-cache-memory",
        str(2**22),
        "--enforce-eager",
        "--output-json",
        str(out),
    ]
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["input_len"] == 40
    # total tokens = 3 x (40 prompt + 2 output)
    assert r["xlaserve"]["total_tokens_per_s"] * r["xlaserve"]["elapsed_s"] == pytest.approx(3 * 42)

    from xlaserve.entrypoints.bench.offline import random_prompts

    a, b = random_prompts(4, 50, 100, {0, 1, 2}), random_prompts(4, 50, 100, {0, 1, 2})
    assert a == b and all(len(p["prompt_token_ids"]) == 50 for p in a)
    ids = {t for p in a for t in p["prompt_token_ids"]}
    assert ids <= set(range(3, 100)) and len(ids) > 50


@pytest.mark.slow  # two engines
def test_speculative_bench_reports_acceptance_and_the_paired_ratio(tmp_path):
    """On a model that repeats the prompt's last token, every answer repeats itself, so n-gram drafts
    are proposed and, once the answer's own run of tokens is the longest match, accepted: the counts
    must be positive (a random model may answer without repeating a token, and then nothing is
    drafted and every check of the figures passes on zeros)."""
    # attention and MLP outputs zero, tied head: its greedy answer repeats the prompt's last token
    model = save_repeating_llama(
        str(tmp_path / "repeating_llama"), tokenizer=small_byte_tokenizer(), chat_template=CHAT_TEMPLATE
    )
    out = tmp_path / "bench.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    argv = ["bench", "latency", "--model", model, "--num-prompts", "2", "--output-len", "12",
            "--workload", "copy", "--speculative-config", spec, "--baseline-without-speculation",
            "--max-model-len", "512", "--max-num-batched-tokens", "16", "--kv-cache-memory", str(2**22),
            "--dtype", "float32", "--enforce-eager", "--output-json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "copy"
    paired = report["paired"]
    assert paired["num_identical_outputs"] == 2  # greedy, float32: speculation changes nothing
    assert paired["tpot_ratio_without_over_with"] == pytest.approx(
        paired["tpot_s_without"] / paired["tpot_s_with"]
    )
    assert 0 < paired["num_accepted_tokens"] <= paired["num_draft_tokens"] <= 3 * paired["num_drafts"]
    assert paired["mean_acceptance_length"] == pytest.approx(
        1 + paired["num_accepted_tokens"] / paired["num_drafts"]
    )
    measured = report["xlaserve"]["speculative"]  # the timed run's figures, not only the paired ones
    assert 0 < measured["num_accepted_tokens"] <= measured["num_draft_tokens"] <= 3 * measured["num_drafts"]


@pytest.mark.slow  # two tiny engines and two HF loads
def test_bench_targets_pairs_every_run_and_derives_the_ratios(tiny_llama, tmp_path):
    """`xlaserve bench targets`: xlaserve at its default dtype (bfloat16 on a CPU with AVX512-BF16,
    float32 elsewhere), with batch invariance off, and in float32, HF in both dtypes, and each target's
    ratio from those runs; a verdict only when the load average says the machine was quiet."""
    out = tmp_path / "targets.json"
    engine = ["--max-model-len", "256", "--max-num-batched-tokens", "16", "--kv-cache-memory", str(2**22),
              "--enforce-eager"]  # fmt: skip
    argv = ["bench", "targets", "--model", tiny_llama, "--num-prompts", "3", "--output-len", "4",
            "--latency-prompts", "1", "--latency-output-len", "3", "--output-json", str(out)]  # fmt: skip
    argv += engine
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())
    runs = ["xlaserve_default", "xlaserve_not_invariant", "hf_float32", "hf_bfloat16"]
    assert r["xlaserve_default"]["batch_invariant"] and not r["xlaserve_not_invariant"]["batch_invariant"]
    if r["xlaserve_default"]["dtype"] != "float32":
        runs.append("xlaserve_float32")
        assert r["xlaserve_float32"]["dtype"] == "float32"
    for name in runs:
        tp, lat = r[name]["throughput"], r[name]["latency"]
        assert tp["num_requests"] == 3 and lat["num_requests"] == 1
        assert tp["output_tokens_per_s"] * tp["elapsed_s"] == pytest.approx(3 * 4)
    for name in ("xlaserve_default", "xlaserve_not_invariant"):  # the pair: each run twice, pooled
        for run in ("throughput", "latency"):
            rounds = r[name][run]["rounds"]
            assert len(rounds) == 2
            assert r[name][run]["elapsed_s"] == pytest.approx(
                (rounds[0]["elapsed_s"] + rounds[1]["elapsed_s"]) / 2
            )
            tpot = (rounds[0]["tpot_s"]["mean"] + rounds[1]["tpot_s"]["mean"]) / 2
            assert r[name][run]["tpot_s"]["mean"] == pytest.approx(tpot)

    def tok_s(name):
        return r[name]["throughput"]["output_tokens_per_s"]

    hf_best = max(tok_s("hf_float32"), tok_s("hf_bfloat16"))
    t = r["targets"]["throughput_vs_hf_best"]
    assert t["ratio"] == pytest.approx(tok_s("xlaserve_default") / hf_best)
    others = r["other_processes_cores"]
    assert others is None or others >= 0.0
    quiet = (r["load_average_before"] is None or r["load_average_before"] <= 1.0) and (
        others <= 0.1 if others is not None else (r["load_average_after"] or 0.0) <= 1.0
    )
    assert r["quiet"] == quiet
    assert t["would_be_met"] == (t["ratio"] >= 2.0) and t["met"] == (quiet and t["would_be_met"])
    tpot = min(r[h]["latency"]["tpot_s"]["mean"] for h in ("hf_float32", "hf_bfloat16"))
    t = r["targets"]["batch1_tpot_vs_hf_best"]
    assert t["ratio"] == pytest.approx(r["xlaserve_default"]["latency"]["tpot_s"]["mean"] / tpot)
    assert t["would_be_met"] == (t["ratio"] <= 0.5) and t["met"] == (quiet and t["would_be_met"])
    assert ("bf16_vs_f32" in r["targets"]) == ("xlaserve_float32" in r)
    t = r["targets"]["invariance_throughput"]
    assert t["ratio"] == pytest.approx(tok_s("xlaserve_default") / tok_s("xlaserve_not_invariant"))
    t = r["targets"]["invariance_tpot"]
    assert t["ratio"] == pytest.approx(
        r["xlaserve_default"]["latency"]["tpot_s"]["mean"]
        / r["xlaserve_not_invariant"]["latency"]["tpot_s"]["mean"]
    )


def test_a_target_is_judged_only_on_a_quiet_machine():
    # Quiet: a load average <= 1.0 at the start and other processes' CPU <= 0.1 cores over the run; the
    # end's load average (the bench's own engines raise it) only where the others' CPU is unknown.
    from xlaserve.entrypoints.bench.targets import is_quiet

    assert is_quiet(0.3, 0.05, 1.9) and is_quiet(None, None, None) and is_quiet(0.3, None, 0.9)
    assert not is_quiet(0.3, 0.5, 0.2) and not is_quiet(2.0, 0.0, 0.5) and not is_quiet(0.3, None, 1.6)


def test_other_processes_cpu_is_the_machines_less_this_ones():
    # (machine busy - own CPU) / wall: 3 s of the machine's busy time over 2 s, 2 of them this
    # process's, leave 0.5 cores to the others; never below zero; unknown without /proc/stat.
    import time

    from xlaserve.entrypoints.bench.targets import OtherProcesses, _machine_busy_s, _own_cpu_s

    readings = {"busy": 100.0, "own": 10.0, "clock": 50.0}
    others = OtherProcesses(lambda: readings["busy"], lambda: readings["own"], lambda: readings["clock"])
    readings.update(busy=103.0, own=12.0, clock=52.0)
    assert others.cores() == 0.5
    readings.update(own=20.0)  # own time counted past the machine's (clock granularity): zero
    assert others.cores() == 0.0
    assert OtherProcesses(lambda: None, lambda: 0.0).cores() is None
    # The real readings: this process's busy loop is its own CPU, and the machine's busy time holds it.
    # (Spun until 0.2 CPU s are its own, not for a wall time: on a loaded machine 0.5 s of wall gave 0.07.)
    busy0, own0, t0 = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    while _own_cpu_s() - own0 < 0.2 and time.perf_counter() - t0 < 60:
        pass
    own = _own_cpu_s() - own0
    assert own >= 0.2
    if busy0 is not None:
        assert _machine_busy_s() - busy0 >= own - 0.05  # clock ticks: 10 ms each


@pytest.mark.slow  # two engines, compiled lazily (~25 s)
def test_lora_bench_pairs_rounds_over_adapters_of_each_rank(tiny_llama, tmp_path):
    """`--num-random-loras 2 --random-lora-rank 4,8 --lora-rounds 2`: both engines alternated twice,
    the adapters (ranks 4 and 8) each written into a slot once, the ratios from the rounds' runs."""
    out = tmp_path / "lora.json"
    argv = ["bench", "throughput", "--model", tiny_llama, "--num-prompts", "4", "--output-len", "3"]
    argv += ["--max-model-len", "256", "--max-num-batched-tokens", "16", "--kv-cache-memory", str(2**22)]
    argv += ["--enforce-eager", "--num-random-loras", "2", "--random-lora-rank", "4,8", "--lora-rounds", "2"]
    assert cli.main(argv + ["--output-json", str(out)]) == 0
    r = json.loads(out.read_text())["lora_bench"]
    assert (r["num_rounds"], r["num_loras"], r["lora_rank"], r["max_loras"]) == (2, 2, [4, 8], 2)
    assert len(r["round_ratios"]) == 2 and r["adapter_loads"] == 2
    assert r["compiles_after_warm_up"] == 0
    for run in ("base", "lora", "lora_engine_base"):
        assert r[run]["num_requests"] == 4, run
        assert round(r[run]["output_tokens_per_s"] * r[run]["elapsed_s"]) == 4 * 3, run
    ratios = sorted(r["round_ratios"])
    assert ratios[0] <= r["ratio_output_throughput"] <= ratios[-1]
    with pytest.raises(SystemExit):
        cli.main(argv[:-7] + ["--num-random-loras", "2", "--random-lora-rank", "8,0"])


@pytest.mark.parametrize("batch", [True, False])
def test_hf_peer_gets_the_engines_warm_up(batch):
    """`run_hf` starts with the untimed request `run_xlaserve` starts with (the first prompt,
    WARM_UP_OUTPUT_LEN tokens) before it times anything, and reports it as `warm_up_s`."""
    from types import SimpleNamespace

    from helpers.family_cases import make_hf_model
    from xlaserve.entrypoints.bench.hf_peer import run_hf
    from xlaserve.entrypoints.bench.report import WARM_UP_OUTPUT_LEN

    hf = make_hf_model("LlamaForCausalLM")
    calls, generate = [], hf.generate

    def recorded_generate(input_ids, **kwargs):  # (prompt shape, tokens asked) of every call, in order
        calls.append((tuple(input_ids.shape), kwargs["max_new_tokens"]))
        return generate(input_ids=input_ids, **kwargs)

    hf.generate = recorded_generate
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10, 11]}]
    report = run_hf(hf, SimpleNamespace(pad_token_id=0), prompts, output_len=3, batch=batch)
    timed = [((2, 4), 3)] if batch else [((1, 3), 3), ((1, 4), 3)]
    assert calls == [((1, 3), WARM_UP_OUTPUT_LEN), *timed]
    assert report["warm_up_s"] > 0 and report["num_requests"] == 2


def test_bench_backend_hf_reports_the_paired_ratios(tiny_llama, tmp_path, capsys):
    """`--backend hf`: Hugging Face's run of the same prompts beside the engine's, and their ratios."""
    out = tmp_path / "bench.json"
    argv = ["bench", "latency", "--model", tiny_llama, "--num-prompts", "2", "--output-len", "3",
            "--max-model-len", "256", "--max-num-batched-tokens", "16", "--kv-cache-memory", str(2**22),
            "--enforce-eager", "--backend", "hf", "--output-json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    r = json.loads(out.read_text())
    ours, hf = r["xlaserve"], r["hf"]
    assert r["hf_dtype"] == "float32" and hf["backend"] == "hf" and hf["num_requests"] == 2
    assert hf["warm_up_s"] > 0 and hf["output_tokens_per_s"] * hf["elapsed_s"] == pytest.approx(2 * 3)
    assert r["ratio_output_throughput"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    assert r["ratio_tpot_hf_over_xlaserve"] == pytest.approx(hf["tpot_s"]["mean"] / ours["tpot_s"]["mean"])
    printed = capsys.readouterr().out
    assert "output throughput xlaserve / hf: " in printed and "TPOT hf / xlaserve: " in printed


def test_bench_step_replays_a_decode_step_of_every_prompt(tiny_llama, tmp_path):
    # `python -m xlaserve.entrypoints.bench.step`: a step that decoded one token for each of the 3 prompts
    # (the 4-token bucket), replayed and profiled; its events summed per replayed step, largest first.
    from xlaserve.entrypoints.bench import step

    out = tmp_path / "step.json"
    argv = ["--model", tiny_llama, "--num-prompts", "3", "--repeats", "3", "--max-model-len", "128"]
    argv += ["--enforce-eager", "--trace", str(tmp_path / "trace"), "--top", "10", "--output-json", str(out)]
    assert step.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 3 and report["num_tokens"] == 4
    assert report["batch_invariant"] is True
    assert 0 < report["forward_ms"] and 0 < report["sample_ms"] and 0 < report["step_ms"]
    events = report["events"]
    assert len(events) == 10
    assert [e["ms_per_step"] for e in events] == sorted((e["ms_per_step"] for e in events), reverse=True)
    # XLA's executions of the replayed programs: the forward's and the sampler's, each step (XLA:CPU names
    # the event "ThunkExecutor::Execute", with " (wait for completion)" when the call waited on it).
    executions = next(e for e in events if e["name"].startswith("ThunkExecutor::Execute"))
    assert executions["calls_per_step"] >= 2
