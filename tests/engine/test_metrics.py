"""EngineMetrics against vLLM's Prometheus logger (vllm/v1/metrics/loggers.py): each histogram's buckets,
the token histograms' reaching max_model_len, and engine_sleep_state's series, so that vLLM's Grafana
dashboard and clients read the same series from `/metrics` and `LLM.get_metrics()`."""

from __future__ import annotations

from types import SimpleNamespace

from xlaserve.config import CacheConfig
from xlaserve.core.kv_cache_manager import PrefixCacheStats
from xlaserve.core.outputs import SchedulerStats
from xlaserve.engine.metrics import PREFIX, EngineMetrics, Histogram
from xlaserve.entrypoints.serving.metrics import make_registry, render
from xlaserve.outputs import IterationStats, RequestStateStats

# vLLM's, copied out rather than imported from the module under test.
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
TOKEN_GAP = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0]  # fmt: skip
REQUEST_TIME = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS_TO_2048 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # vLLM's build_1_2_5_buckets(2048)


def histograms(metrics: EngineMetrics) -> dict[str, Histogram]:
    return {m.name.removeprefix(PREFIX): m for m in metrics.snapshot() if isinstance(m, Histogram)}


def bounds(histogram: Histogram) -> list[float]:
    *finite, last = histogram.buckets
    assert last == "+Inf"
    return [float(b) for b in finite]


def test_every_histogram_has_vllms_buckets():
    metrics = EngineMetrics()
    metrics.record_engine(10**6, 64, CacheConfig(), max_model_len=2048)
    expected = {
        "time_to_first_token_seconds": TTFT,
        "inter_token_latency_seconds": TOKEN_GAP,
        "request_time_per_output_token_seconds": TOKEN_GAP,
        "iteration_tokens_total": ITERATION_TOKENS,
        "request_params_n": [1, 2, 5, 10, 20],
    }
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):  # fmt: skip
        expected[name] = REQUEST_TIME
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_max_num_generation_tokens", "request_prefill_kv_computed_tokens"):  # fmt: skip
        expected[name] = TOKENS_TO_2048
    assert {name: bounds(h) for name, h in histograms(metrics).items()} == expected


def test_samples_land_in_their_buckets_and_a_restart_keeps_them():
    """A bound holds the samples equal to it (Prometheus's `le`); the same max_model_len again (a
    restarted core) keeps the token histograms' counts."""
    metrics = EngineMetrics()
    metrics.record_engine(10**6, 64, CacheConfig(), max_model_len=2048)
    stats = IterationStats(
        num_prompt_tokens=7,
        num_generation_tokens=1,
        time_to_first_tokens=[0.3],
        inter_token_latencies=[0.025, 0.03],
        e2e_latencies=[0.4],
        prompt_lengths=[7],
    )
    metrics.record_iteration(stats)
    metrics.record_engine(10**6, 64, CacheConfig(), max_model_len=2048)
    h = histograms(metrics)

    def counts(name: str, *les: str) -> tuple[int, ...]:
        return tuple(h[name].buckets[le] for le in les)

    assert counts("time_to_first_token_seconds", "0.25", "0.5") == (0, 1)
    assert counts("inter_token_latency_seconds", "0.01", "0.025", "0.05") == (0, 1, 2)
    assert counts("e2e_request_latency_seconds", "0.3", "0.5") == (0, 1)
    assert counts("request_prompt_tokens", "5", "10") == (0, 1)
    assert counts("iteration_tokens_total", "1", "8") == (0, 1)


def test_engine_sleep_state_follows_sleep_and_wake_up():
    """vLLM's engine_sleep_state{sleep_state}: awake, weights_offloaded (level 1), discard_all (level 2),
    as the core's stats say (one source for the server's and the offline LLM's)."""
    metrics = EngineMetrics()

    def record_sleep(level: int) -> None:
        metrics.record_scheduler(SchedulerStats(0, 0, 0.0, 0, PrefixCacheStats(), sleep_level=level))

    def states() -> dict[str, float]:
        return {
            m.labels["sleep_state"]: m.value
            for m in metrics.snapshot()
            if m.name == PREFIX + "engine_sleep_state"
        }

    assert states() == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    record_sleep(1)
    assert states() == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    record_sleep(2)
    text = render(make_registry(SimpleNamespace(metrics=metrics), "m")).decode()
    assert "# TYPE xlaserve:engine_sleep_state gauge" in text
    assert 'xlaserve:engine_sleep_state{model_name="m",sleep_state="discard_all"} 1.0' in text
    assert 'xlaserve:engine_sleep_state{model_name="m",sleep_state="awake"} 0.0' in text
    record_sleep(0)
    assert states() == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}


def test_request_success_by_finished_reason_offline_and_served():
    """vLLM's request_success{finished_reason}: in `LLM.get_metrics()` as in `/metrics`, every reason's
    series from 0 (a dashboard's `finished_reason="error"` finds a 0, not nothing); a front-end abort
    counts as abort."""
    metrics = EngineMetrics()
    metrics.record_iteration(IterationStats(finish_reasons=["stop", "length", "length"]))
    metrics.record_abort()
    counters = {
        m.labels["finished_reason"]: m.value
        for m in metrics.snapshot()
        if m.name == PREFIX + "request_success"
    }
    assert counters == {"stop": 1, "length": 2, "abort": 1, "error": 0}
    text = render(make_registry(SimpleNamespace(metrics=metrics), "m")).decode()
    assert 'xlaserve:request_success_total{finished_reason="error",model_name="m"} 0.0' in text
    assert 'xlaserve:request_success_total{finished_reason="length",model_name="m"} 2.0' in text


def test_prompt_tokens_by_source_and_the_tokens_each_request_computed():
    """vLLM's PromptTokenStats (vllm/v1/metrics/stats.py) on three first tokens: a prompt of 10 without a
    hit, one of 16 with 8 cached (2 of them loaded by a connector), one of 8 cached but its last token
    (whose recompute counts as computed and as a hit); and request_prefill_kv_computed_tokens of the
    three finished."""
    metrics = EngineMetrics()
    metrics.record_engine(10**6, 64, CacheConfig(), max_model_len=2048)
    stats = IterationStats()
    for num_prompt, num_cached, num_external in ((10, 0, 0), (16, 8, 2), (8, 7, 0)):
        request = RequestStateStats(arrival_time=0.0)
        stats.record_tokens(request, num_prompt, 1, 1.0, num_cached, num_external)
        stats.record_tokens(request, num_prompt, 1, 2.0, num_cached, num_external)  # not its prompt again
        stats.record_finish(request, "length", 2.0, num_prompt, num_cached_tokens=num_cached)
    metrics.record_iteration(stats)
    text = render(make_registry(SimpleNamespace(metrics=metrics), "m")).decode()
    for line in (
        'xlaserve:prompt_tokens_total{model_name="m"} 34.0',
        'xlaserve:prompt_tokens_by_source_total{model_name="m",source="local_compute"} 19.0',
        'xlaserve:prompt_tokens_by_source_total{model_name="m",source="local_cache_hit"} 14.0',
        'xlaserve:prompt_tokens_by_source_total{model_name="m",source="external_kv_transfer"} 2.0',
        'xlaserve:prompt_tokens_cached_total{model_name="m"} 15.0',
        'xlaserve:prompt_tokens_recomputed_total{model_name="m"} 1.0',
        'xlaserve:request_prefill_kv_computed_tokens_sum{model_name="m"} 19.0',
        'xlaserve:request_prefill_kv_computed_tokens_bucket{le="1",model_name="m"} 1.0',
        'xlaserve:request_prefill_kv_computed_tokens_bucket{le="5",model_name="m"} 1.0',
        'xlaserve:request_prefill_kv_computed_tokens_bucket{le="10",model_name="m"} 3.0',
    ):
        assert line in text, line
    by_source = {m.labels["source"]: m.value for m in metrics.prompt_source_counters()}
    assert sum(by_source.values()) - metrics.counters["prompt_tokens_recomputed"] == 34  # vLLM's invariant
