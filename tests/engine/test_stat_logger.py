"""The server's periodic stats line (engine/engine/stat_logger.py, vLLM's LoggingStatLogger) over the
front end's EngineMetrics: throughputs over the interval, the queues, KV cache use, the interval's
prefix-cache hit rate and drafts' acceptance; quiet while idle, after one line saying so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from xlaserve.core.spec_decode import SpecDecodingStats
from xlaserve.engine.metrics import EngineMetrics
from xlaserve.engine.stat_logger import StatLogger, log_stats_interval
from xlaserve.outputs import IterationStats


def step(metrics: EngineMetrics, *, prompt=0, generated=0, queries=0, hits=0, running=0, waiting=0, kv=0.0):
    metrics.record_iteration(IterationStats(num_prompt_tokens=prompt, num_generation_tokens=generated))
    metrics.record_scheduler(
        SimpleNamespace(
            num_running=running,
            num_waiting=waiting,
            kv_cache_usage=kv,
            prefix_cache_stats=SimpleNamespace(num_queries=queries, num_hits=hits),
            num_preemptions_total=0,
            spec_decoding_stats=None,
            kv_transfer_stats=None,
            sleep_level=0,
        )
    )


def test_a_line_per_busy_interval_then_one_idle_line_then_quiet():
    metrics = EngineMetrics()
    stats = StatLogger(metrics, now=100.0)
    assert stats.line(110.0) is None  # nothing happened since the start
    step(metrics, prompt=300, generated=40, queries=400, hits=100, running=3, waiting=1, kv=0.25)
    step(metrics, generated=60, queries=0, running=3, waiting=1, kv=0.25)
    assert stats.line(120.0) == (
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 3 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    step(metrics, generated=20)  # the last tokens; the queues are empty
    assert "Avg generation throughput: 4.0 tokens/s, Running: 0 reqs" in stats.line(125.0)
    assert stats.line(135.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")
    assert stats.line(145.0) is None and stats.line(155.0) is None
    step(metrics, prompt=10, queries=10, hits=10, running=1)
    assert "Prefix cache hit rate: 100.0%" in stats.line(165.0)  # the interval's rate, not the total's


def test_the_drafts_acceptance_over_the_interval():
    metrics = EngineMetrics()
    stats = StatLogger(metrics, now=0.0)
    metrics.spec_decoding = SpecDecodingStats(3, num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15)
    metrics.counters["generation_tokens"] = 25
    assert stats.line(10.0).endswith(
        "SpecDecoding: mean acceptance length 2.50, accepted 15 of 30 draft tokens (50.0%)"
    )
    assert "SpecDecoding" not in (stats.line(20.0) or "")  # no drafts since


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("XLASERVE_LOG_STATS_INTERVAL", raising=False)
    assert log_stats_interval() == 10.0
    monkeypatch.setenv("XLASERVE_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval() == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("XLASERVE_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="XLASERVE_LOG_STATS_INTERVAL must be a number of seconds > 0"):
            log_stats_interval()
