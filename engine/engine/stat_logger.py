"""The server's periodic log line of what the engine did (vLLM's LoggingStatLogger): throughput since the
last line, requests running and waiting, KV cache usage, the prefix cache's hit rate, and under
speculative decoding the drafts' acceptance. Every `interval` seconds (XLASERVE_LOG_STATS_INTERVAL,
vLLM's 10 s default) while the engine works, one more line once it stops, then quiet until the next
request; off with `xlaserve serve --disable-log-stats`. It reads the front end's EngineMetrics only."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from xlaserve.engine.metrics import EngineMetrics

logger = logging.getLogger("xlaserve.engine.stats")

DEFAULT_INTERVAL_S = 10.0


def log_stats_interval() -> float:
    """XLASERVE_LOG_STATS_INTERVAL (seconds, > 0), else DEFAULT_INTERVAL_S."""
    text = os.environ.get("XLASERVE_LOG_STATS_INTERVAL")
    if text is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"XLASERVE_LOG_STATS_INTERVAL must be a number of seconds > 0, got {text!r}")
    return value


@dataclass(frozen=True)
class _Totals:
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, metrics: EngineMetrics) -> _Totals:
        c, spec = metrics.counters, metrics.spec_decoding
        return cls(
            c["prompt_tokens"],
            c["generation_tokens"],
            c["prefix_cache_queries"],
            c["prefix_cache_hits"],
            c["num_preemptions"],
            *((spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0, 0)),
        )


class StatLogger:
    """`line(now)`: the interval's line, or None where there is nothing to say (idle, and said so)."""

    def __init__(self, metrics: EngineMetrics, now: float):
        self._metrics = metrics
        self._last, self._last_time = _Totals.of(metrics), now
        self._was_idle = True

    def line(self, now: float) -> str | None:
        totals, gauges = _Totals.of(self._metrics), self._metrics.gauges
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = totals, now
        running, waiting = int(gauges["num_requests_running"]), int(gauges["num_requests_waiting"])
        is_idle = totals == last and running == waiting == 0
        if is_idle and self._was_idle:
            return None
        self._was_idle = is_idle
        queries = totals.prefix_queries - last.prefix_queries
        hits = totals.prefix_hits - last.prefix_hits
        text = (
            f"Avg prompt throughput: {(totals.prompt_tokens - last.prompt_tokens) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(totals.generation_tokens - last.generation_tokens) / elapsed:.1f} "
            f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * gauges['kv_cache_usage_perc']:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        )
        if totals.preemptions > last.preemptions:
            text += f", Preempted: {totals.preemptions - last.preemptions} reqs"
        drafts = totals.drafts - last.drafts
        if drafts:
            draft_tokens = totals.draft_tokens - last.draft_tokens
            accepted = totals.accepted_tokens - last.accepted_tokens
            text += (
                f", SpecDecoding: mean acceptance length {1 + accepted / drafts:.2f}, "
                f"accepted {accepted} of {draft_tokens} draft tokens ({100 * accepted / draft_tokens:.1f}%)"
            )
        return text


async def log_stats(metrics: EngineMetrics, interval_s: float) -> None:
    """Log StatLogger's line every `interval_s` seconds until cancelled."""
    stats = StatLogger(metrics, time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        text = stats.line(time.monotonic())
        if text is not None:
            logger.info("%s", text)
