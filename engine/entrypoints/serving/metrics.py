"""GET /metrics: the engine's metrics in Prometheus text, with vLLM's names under `xlaserve:`.

A custom collector reads AsyncLLM's `EngineMetrics` (the same accumulator the offline `LLM`
exposes through `get_metrics()`) at scrape time, so nothing is double-counted and there is no
global registry: each app has its own. While the engine core is down, its gauges read 0 (they would
describe a process that no longer exists); counters keep their totals across restarts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from xlaserve.engine.async_llm import AsyncLLM
from xlaserve.engine.metrics import PREFIX, Counter

CONTENT_TYPE = CONTENT_TYPE_LATEST

_DOCS = {
    "num_requests_running": "Number of requests in the model's batch.",
    "num_requests_waiting": "Number of requests waiting to be scheduled.",
    "kv_cache_usage_perc": "KV cache usage: 1 means all blocks are held by requests.",
    "model_weight_bytes": (
        "Bytes of the weights on the devices, a speculative drafter's too "
        "(quantized: as stored, 4-bit packed two to a byte, with their scales)."
    ),
    "num_kv_blocks": "KV cache blocks (vLLM's num_gpu_blocks); twice as many with --kv-cache-dtype fp8.",
    "prefix_cache_queries": "Prefix cache queries, in tokens.",
    "prefix_cache_hits": "Prefix cache hits, in tokens.",
    "num_preemptions": "Preemptions (recompute) by the scheduler.",
    "prompt_tokens": "Prefill tokens processed.",
    "prompt_tokens_by_source": "Prompt tokens by where their K/V came from: local_compute, local_cache_hit "
    "(the prefix cache), external_kv_transfer (a KV connector: host offload, a producer).",
    "prompt_tokens_cached": "Prompt tokens whose computation the prefix cache or a KV connector skipped.",
    "prompt_tokens_recomputed": "Prompts whose cache hit left one token to compute (vLLM's count of a "
    "last token recomputed): one each.",
    "generation_tokens": "Generation tokens produced.",
    "request_success": "Finished requests, by finish reason (abort: cancelled or disconnected).",
    "time_to_first_token_seconds": "Time to first token.",
    "inter_token_latency_seconds": "Time between consecutive output tokens of a request.",
    "request_time_per_output_token_seconds": "Mean time per output token after the first, per request.",
    "e2e_request_latency_seconds": "End-to-end request latency.",
    "request_queue_time_seconds": "Time a request waited before it was first scheduled.",
    "request_prefill_time_seconds": "Time from a request's first scheduling to its first token.",
    "request_decode_time_seconds": "Time from a request's first token to its last.",
    "request_inference_time_seconds": "Time from a request's first scheduling to its last token.",
    "request_prompt_tokens": "Prompt tokens of each finished request.",
    "request_generation_tokens": "Generated tokens of each finished request.",
    "request_params_max_tokens": "The max_tokens of each finished request that set one.",
    "request_params_n": "The n of each finished request.",
    "request_max_num_generation_tokens": "The most tokens one of a finished request's n sequences generated.",
    "request_prefill_kv_computed_tokens": "Prompt tokens each finished request computed (past its hit).",
    "engine_sleep_state": "Engine sleep state (vLLM's): awake reads 1 while the engine is awake; "
    "weights_offloaded after POST /sleep?level=1, discard_all after level=2.",
    "cache_config_info": "The KV cache's settings, as labels (vLLM's): the gauge reads 1.",
    "iteration_tokens_total": "Tokens an engine step completed: the prompts of requests that got their "
    "first token in it, and the tokens it generated.",
    "engine_core_restarts": "Engine core processes started to replace one that died.",
    "spec_decode_num_drafts": "Speculative decoding: requests' verifications (one per request with drafts "
    "per step).",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
    "spec_decode_num_accepted_tokens_per_pos": "Speculative decoding: drafts accepted at each position.",
    "external_prefix_cache_queries": "KV connector: prompt tokens asked of an outside source (offload "
    "tiers, a producer) after the device prefix hit.",
    "external_prefix_cache_hits": "KV connector: prompt tokens loaded from an outside source, not computed.",
    "kv_offload_hits": "KV offload: prompt tokens loaded instead of computed, by tier (host, disk).",
    "kv_offload_total_bytes": "KV offload: bytes copied between the device cache and the offload tiers.",
    "kv_offload_total_time": "KV offload: seconds spent copying between the device cache and the offload "
    "tiers.",
    "kv_offload_stores_skipped": "KV offload: blocks the device cache evicted and the host tier did not "
    "save (a step evicted more than it had slots for).",
    "kv_offload_demotions_skipped": "KV offload: blocks the host tier evicted and the tier below it did not "
    "save (a step demoted more than that tier had slots for), by tier.",
    "kv_transfer_fetches": "Disaggregated prefill: a consumer's fetches of prompt blocks, by outcome "
    "(loaded; recomputed after the producer failed or timed out; cached: this engine held every block).",
    "kv_transfer_total_bytes": "Disaggregated prefill: bytes of prompt blocks sent, fetched and loaded.",
    "kv_transfer_total_time": "Disaggregated prefill: seconds spent sending, fetching and loading prompt "
    "blocks.",
}


class EngineCollector:
    """Renders AsyncLLM's metrics on each scrape; every series has a `model_name` label."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        metrics = self.engine.metrics
        labels, values = ["model_name"], [self.model_name]
        for name, value in metrics.counters.items():
            family = CounterMetricFamily(PREFIX + name, _DOCS.get(name, name), labels=labels)
            family.add_metric(values, value)
            yield family
        family = CounterMetricFamily(
            PREFIX + "request_success", _DOCS["request_success"], labels=[*labels, "finished_reason"]
        )
        for reason, count in sorted(metrics.finish_reasons.items()):
            family.add_metric([*values, reason], count)
        yield family
        family = CounterMetricFamily(
            PREFIX + "engine_core_restarts", _DOCS["engine_core_restarts"], labels=labels
        )
        family.add_metric(values, metrics.num_core_restarts)
        yield family
        for name, value in metrics.gauges.items():
            family = GaugeMetricFamily(PREFIX + name, _DOCS.get(name, name), labels=labels)
            family.add_metric(values, value)
            yield family
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        # One family per name, a series per prompt source, per position (speculative decoding), per
        # transfer direction or per sleep state.
        labelled = [
            *metrics.prompt_source_counters(),
            *metrics.spec_decode_counters(),
            *metrics.kv_connector_counters(),
        ]
        for record in [*labelled, *metrics.sleep_state_gauges()]:
            name = record.name.removeprefix(PREFIX)
            if name not in families:
                kind = CounterMetricFamily if isinstance(record, Counter) else GaugeMetricFamily
                families[name] = kind(record.name, _DOCS[name], labels=[*labels, *record.labels])
            families[name].add_metric([*values, *record.labels.values()], record.value)
        yield from families.values()
        info = metrics.cache_config_info
        if info:
            family = GaugeMetricFamily(
                PREFIX + "cache_config_info", _DOCS["cache_config_info"], labels=[*labels, *info]
            )
            family.add_metric([*values, *info.values()], 1.0)
            yield family
        for name, histogram in metrics.histograms.items():
            record = histogram.record(PREFIX + name)
            family = HistogramMetricFamily(PREFIX + name, _DOCS.get(name, name), labels=labels)
            family.add_metric(values, buckets=list(record.buckets.items()), sum_value=record.sum)
            yield family


def make_registry(engine: AsyncLLM, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
