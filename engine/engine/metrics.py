"""Engine metrics named like vLLM's (under the `xlaserve:` prefix), read by `LLM.get_metrics()`.

The shapes follow vLLM's `vllm.v1.metrics.reader`: Counter, Gauge and Histogram records.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from dataclasses import dataclass, field

from xlaserve.config import CacheConfig
from xlaserve.core.kv_connector import KVTransferStats
from xlaserve.core.request import FinishReason
from xlaserve.core.spec_decode import SpecDecodingStats

PREFIX = "xlaserve:"

# vLLM's buckets, by what they measure: time to first token (seconds), the gaps between tokens (and a
# request's mean gap), a request's whole time and its phases, and the tokens of one engine step.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                         120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for request_params_n
_TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
    "request_max_num_generation_tokens",
    "request_prefill_kv_computed_tokens",
)
# vLLM's prompt_tokens_by_source labels, and the IterationStats counts behind them.
PROMPT_SOURCES = {
    "local_compute": "num_prompt_tokens_computed",
    "local_cache_hit": "num_prompt_tokens_local_cache_hit",
    "external_kv_transfer": "num_prompt_tokens_external",
}
_DEFAULT_MAX_MODEL_LEN = 5 * 10**6  # the token histograms' reach until record_engine knows the model's


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int | float = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Histogram(Metric):
    buckets: dict[str, int] = field(default_factory=dict)  # cumulative counts by upper bound ("+Inf" last)
    count: int = 0
    sum: float = 0.0


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's buckets for a request's token counts: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    return tuple(
        b for e in range(len(str(max_model_len))) for m in (1, 2, 5) if (b := m * 10**e) <= max_model_len
    )


# vLLM's engine_sleep_state labels: awake, and the state each sleep level leaves the engine in.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class _Hist:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe_all(self, values) -> None:
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.count += 1
            self.sum += v

    def record(self, name: str) -> Histogram:
        cumulative, total = {}, 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += n
            cumulative[bound] = total
        return Histogram(name, buckets=cumulative, count=self.count, sum=self.sum)


class EngineMetrics:
    """Accumulates SchedulerStats snapshots and the output processor's IterationStats."""

    def __init__(self):
        self.counters = dict.fromkeys(
            [
                "prefix_cache_queries",
                "prefix_cache_hits",
                "num_preemptions",
                "prompt_tokens",
                "prompt_tokens_cached",
                "prompt_tokens_recomputed",
                "generation_tokens",
            ],
            0,
        )
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_SOURCES, 0)
        self.gauges = dict.fromkeys(
            ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"], 0.0
        )
        self.histograms = {
            "time_to_first_token_seconds": _Hist(_TTFT_BUCKETS),
            "inter_token_latency_seconds": _Hist(_TOKEN_GAP_BUCKETS),
            "request_time_per_output_token_seconds": _Hist(_TOKEN_GAP_BUCKETS),
        }
        self.histograms |= {
            name: _Hist(_REQUEST_TIME_BUCKETS)
            for name in (
                "e2e_request_latency_seconds",
                "request_queue_time_seconds",
                "request_prefill_time_seconds",
                "request_decode_time_seconds",
                "request_inference_time_seconds",
            )
        }
        self.histograms |= self._token_histograms(_DEFAULT_MAX_MODEL_LEN)
        self.histograms["iteration_tokens_total"] = _Hist(_ITERATION_TOKEN_BUCKETS)
        self.histograms["request_params_n"] = _Hist(_N_BUCKETS)
        # request_success by finished_reason (vLLM's label), every reason from 0 as vLLM's series are.
        self.finish_reasons = collections.Counter(dict.fromkeys(map(str, FinishReason), 0))
        self.sleep_level = 0  # the engine's, from its stats (0: awake), for engine_sleep_state
        # vLLM's cache_config_info: the KV cache's settings as the labels of a gauge that reads 1
        # (record_engine; empty before).
        self.cache_config_info: dict[str, str] = {}
        self._last_preemptions = 0
        # Speculative decoding's counters (vLLM's spec_decode_*), once a core reports them (None: off).
        self.spec_decoding: SpecDecodingStats | None = None
        # A KV connector's totals (host offload, disaggregated prefill, or both), once a core reports
        # them (None: no connector).
        self.kv_transfer: KVTransferStats | None = None
        # The server's alone (the offline LLM has no core process), so it is not in snapshot().
        self.num_core_restarts = 0

    def record_scheduler(self, stats) -> None:
        self.gauges["num_requests_running"] = stats.num_running
        self.gauges["num_requests_waiting"] = stats.num_waiting
        self.gauges["kv_cache_usage_perc"] = stats.kv_cache_usage
        self.counters["prefix_cache_queries"] += stats.prefix_cache_stats.num_queries
        self.counters["prefix_cache_hits"] += stats.prefix_cache_stats.num_hits
        self.counters["num_preemptions"] += stats.num_preemptions_total - self._last_preemptions
        self.sleep_level = stats.sleep_level
        self._last_preemptions = stats.num_preemptions_total
        spec = stats.spec_decoding_stats
        if spec is not None:
            if self.spec_decoding is None:
                self.spec_decoding = SpecDecodingStats(spec.num_spec_tokens)
            self.spec_decoding.add(spec)
        transfer = stats.kv_transfer_stats
        if transfer is not None:
            if self.kv_transfer is None:
                self.kv_transfer = KVTransferStats()
            self.kv_transfer.add(transfer)

    def kv_connector_counters(self) -> list[Counter]:
        """A KV connector's counters (none without one), in vLLM's names: prompt tokens asked of the
        outside sources past the device hit and those they served (external_prefix_cache_*); host
        offload's hits by tier (kv_offload_hits), the bytes and seconds of its copies each way
        (kv_offload_total_*, by transfer_type: device_to_host, host_to_device, and with a disk tier
        host_to_disk, disk_to_device), the evicted blocks a step had no host slot for
        (kv_offload_stores_skipped, vLLM's name) and those the host tier evicted that a step had no disk
        slot for (kv_offload_demotions_skipped, by tier as vLLM labels a secondary tier's counters);
        disaggregated prefill's (`_kv_transfer_counters`). An engine with both has both."""
        t = self.kv_transfer
        if t is None:
            return []
        counters = [
            Counter(PREFIX + "external_prefix_cache_queries", value=t.num_queries),
            Counter(PREFIX + "external_prefix_cache_hits", value=t.num_hits),
        ]
        if t.is_offloaded:
            counters += self._kv_offload_counters(t)
        if t.is_disaggregated:
            counters += self._kv_transfer_counters(t)
        return counters

    @staticmethod
    def _kv_offload_counters(t: KVTransferStats) -> list[Counter]:
        num_host_hits = t.num_hits - t.num_disk_hits - t.num_remote_hits
        counters = [
            Counter(PREFIX + "kv_offload_hits", {"tier": "host"}, value=num_host_hits),
            Counter(PREFIX + "kv_offload_hits", {"tier": "disk"}, value=t.num_disk_hits),
            Counter(PREFIX + "kv_offload_stores_skipped", value=t.num_saves_skipped),
            Counter(PREFIX + "kv_offload_demotions_skipped", {"tier": "disk"}, value=t.num_demotes_skipped),
        ]
        for way, num_bytes, seconds in (
            ("device_to_host", t.bytes_saved, t.save_seconds),
            ("host_to_device", t.bytes_loaded, t.load_seconds),
            ("host_to_disk", t.bytes_demoted, t.demote_seconds),
            ("disk_to_device", t.bytes_loaded_from_disk, t.disk_load_seconds),
        ):
            counters.append(
                Counter(PREFIX + "kv_offload_total_bytes", {"transfer_type": way}, value=num_bytes)
            )
            counters.append(Counter(PREFIX + "kv_offload_total_time", {"transfer_type": way}, value=seconds))
        return counters

    @staticmethod
    def _kv_transfer_counters(t: KVTransferStats) -> list[Counter]:
        """Disaggregated prefill's: a consumer's fetches by outcome (loaded; recomputed after a failure;
        cached: its own caches held every block, none fetched), and the bytes and seconds each way
        (kv_transfer_total_*: sent, fetched, loaded)."""
        num_loaded = t.num_remote_fetches - t.num_remote_fetch_failures - t.num_remote_fetches_cached
        counters = [
            Counter(PREFIX + "kv_transfer_fetches", {"outcome": "loaded"}, value=num_loaded),
            Counter(
                PREFIX + "kv_transfer_fetches", {"outcome": "recomputed"}, value=t.num_remote_fetch_failures
            ),
            Counter(PREFIX + "kv_transfer_fetches", {"outcome": "cached"}, value=t.num_remote_fetches_cached),
        ]
        for way, num_bytes, seconds in (
            ("sent", t.bytes_sent, t.send_seconds),
            ("fetched", t.bytes_fetched, t.fetch_seconds),
            ("loaded", t.bytes_loaded_remote, t.remote_load_seconds),
        ):
            counters.append(
                Counter(PREFIX + "kv_transfer_total_bytes", {"transfer_type": way}, value=num_bytes)
            )
            counters.append(Counter(PREFIX + "kv_transfer_total_time", {"transfer_type": way}, value=seconds))
        return counters

    def spec_decode_counters(self) -> list[Counter]:
        """vLLM's spec_decode_* counters (none while speculative decoding is off)."""
        spec = self.spec_decoding
        if spec is None:
            return []
        counters = [
            Counter(PREFIX + "spec_decode_num_drafts", value=spec.num_drafts),
            Counter(PREFIX + "spec_decode_num_draft_tokens", value=spec.num_draft_tokens),
            Counter(PREFIX + "spec_decode_num_accepted_tokens", value=spec.num_accepted_tokens),
        ]
        return counters + [
            Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos", {"position": str(i)}, value=n)
            for i, n in enumerate(spec.num_accepted_tokens_per_pos)
        ]

    @staticmethod
    def _token_histograms(max_model_len: int) -> dict[str, _Hist]:
        bounds = token_buckets(max_model_len)
        return {name: _Hist(bounds) for name in _TOKEN_HISTOGRAMS}

    def record_engine(
        self, weight_bytes: int, num_kv_blocks: int, cache: CacheConfig, max_model_len: int
    ) -> None:
        """What the engine holds once ready: weight bytes on the devices and KV cache blocks; and the
        cache's settings with its number of blocks (vLLM's num_gpu_blocks) as cache_config_info's labels.
        The token histograms' buckets reach max_model_len (vLLM's); a restarted core of the same model
        keeps them and their counts."""
        if self.histograms["request_prompt_tokens"].bounds != token_buckets(max_model_len):
            self.histograms |= self._token_histograms(max_model_len)
        self.gauges["model_weight_bytes"] = float(weight_bytes)
        self.gauges["num_kv_blocks"] = float(num_kv_blocks)
        settings = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
        self.cache_config_info = {k: str(v) for k, v in {**settings, "num_gpu_blocks": num_kv_blocks}.items()}

    def record_abort(self) -> None:
        """The front end aborted a request (cancelled, or its client gone) before the core reported it."""
        self.finish_reasons["abort"] += 1

    def prompt_source_counters(self) -> list[Counter]:
        """vLLM's prompt_tokens_by_source: the prompt tokens counted in prompt_tokens, by where their K/V
        came from (IterationStats' fields)."""
        return [
            Counter(PREFIX + "prompt_tokens_by_source", {"source": source}, value=n)
            for source, n in self.prompt_tokens_by_source.items()
        ]

    def sleep_state_gauges(self) -> list[Gauge]:
        """vLLM's engine_sleep_state: 1 for the state the engine is in (awake; weights_offloaded after
        sleep level 1, discard_all after level 2), 0 for the others."""
        return [
            Gauge(PREFIX + "engine_sleep_state", {"sleep_state": state}, value=float(i == self.sleep_level))
            for i, state in enumerate(SLEEP_STATES)
        ]

    def record_core_down(self) -> None:
        """The core died: its gauges are no longer true, and its successor counts preemptions from 0."""
        self.gauges = dict.fromkeys(self.gauges, 0.0)
        self._last_preemptions = 0

    def record_iteration(self, stats) -> None:
        self.counters["prompt_tokens"] += stats.num_prompt_tokens
        self.counters["prompt_tokens_cached"] += stats.num_prompt_tokens_cached
        self.counters["prompt_tokens_recomputed"] += stats.num_prompt_tokens_recomputed
        for source, field_name in PROMPT_SOURCES.items():
            self.prompt_tokens_by_source[source] += getattr(stats, field_name)
        self.counters["generation_tokens"] += stats.num_generation_tokens
        self.finish_reasons.update(stats.finish_reasons)
        self.histograms["time_to_first_token_seconds"].observe_all(stats.time_to_first_tokens)
        self.histograms["inter_token_latency_seconds"].observe_all(stats.inter_token_latencies)
        self.histograms["request_time_per_output_token_seconds"].observe_all(stats.time_per_output_tokens)
        self.histograms["e2e_request_latency_seconds"].observe_all(stats.e2e_latencies)
        for name, values in (
            ("request_queue_time_seconds", stats.queue_times),
            ("request_prefill_time_seconds", stats.prefill_times),
            ("request_decode_time_seconds", stats.decode_times),
            ("request_inference_time_seconds", stats.inference_times),
            ("request_prompt_tokens", stats.prompt_lengths),
            ("request_generation_tokens", stats.generation_lengths),
            ("request_params_max_tokens", stats.max_tokens_params),
            ("request_params_n", stats.n_params),
            ("request_max_num_generation_tokens", stats.max_num_generation_tokens),
            ("request_prefill_kv_computed_tokens", stats.prefill_kv_computed_tokens),
        ):
            self.histograms[name].observe_all(values)
        if stats.num_prompt_tokens or stats.num_generation_tokens:  # a step's tokens (vLLM's per iteration)
            self.histograms["iteration_tokens_total"].observe_all(
                [stats.num_prompt_tokens + stats.num_generation_tokens]
            )

    def snapshot(self) -> list[Metric]:
        metrics: list[Metric] = [Counter(PREFIX + k, value=v) for k, v in self.counters.items()]
        metrics += [
            Counter(PREFIX + "request_success", {"finished_reason": reason}, value=n)
            for reason, n in self.finish_reasons.items()
        ]
        metrics += [Gauge(PREFIX + k, value=v) for k, v in self.gauges.items()]
        metrics += [h.record(PREFIX + k) for k, h in self.histograms.items()]
        if self.cache_config_info:
            metrics.append(Gauge(PREFIX + "cache_config_info", dict(self.cache_config_info), value=1.0))
        metrics += self.sleep_state_gauges() + self.prompt_source_counters()
        return metrics + self.spec_decode_counters() + self.kv_connector_counters()
