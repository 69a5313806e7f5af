"""Speculative decoding's counters: accumulated from the scheduler's snapshots (summed over data-parallel
ranks), in `LLM.get_metrics()` and in `/metrics` with vLLM's names; the bench's acceptance figures."""

from __future__ import annotations

from types import SimpleNamespace

from xlaserve.core.kv_cache_manager import PrefixCacheStats
from xlaserve.core.outputs import SchedulerStats
from xlaserve.core.spec_decode import SpecDecodingStats
from xlaserve.engine.dp_engine import _sum_spec_stats
from xlaserve.engine.metrics import EngineMetrics
from xlaserve.entrypoints.bench.speculative import acceptance
from xlaserve.entrypoints.serving.metrics import make_registry, render


def snapshot(observations) -> SchedulerStats:
    spec = SpecDecodingStats(3)
    for num_drafts, num_accepted in observations:
        spec.observe(num_drafts, num_accepted)
    return SchedulerStats(1, 0, 0.1, 0, PrefixCacheStats(), spec)


def test_counters_accumulate_and_render_with_vllm_names():
    metrics = EngineMetrics()
    assert metrics.spec_decode_counters() == []  # off: no series at all
    metrics.record_scheduler(snapshot([(3, 3), (3, 1)]))
    metrics.record_scheduler(snapshot([(2, 0)]))
    values = {(m.name, tuple(m.labels.items())): getattr(m, "value", None) for m in metrics.snapshot()}
    assert values[("xlaserve:spec_decode_num_drafts", ())] == 3
    assert values[("xlaserve:spec_decode_num_draft_tokens", ())] == 8
    assert values[("xlaserve:spec_decode_num_accepted_tokens", ())] == 4
    per_pos = [
        values[("xlaserve:spec_decode_num_accepted_tokens_per_pos", (("position", str(i)),))]
        for i in range(3)
    ]
    assert per_pos == [2, 1, 1]
    engine = SimpleNamespace(metrics=metrics)
    text = render(make_registry(engine, "m")).decode()
    assert 'xlaserve:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'xlaserve:spec_decode_num_draft_tokens_total{model_name="m"} 8.0' in text
    assert 'xlaserve:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert 'xlaserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert "spec_decode" not in render(make_registry(SimpleNamespace(metrics=EngineMetrics()), "m")).decode()


def test_data_parallel_ranks_sum_and_bench_figures():
    total = _sum_spec_stats([snapshot([(3, 2)]).spec_decoding_stats, snapshot([(1, 1)]).spec_decoding_stats])
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens) == (2, 4, 3)
    assert total.num_accepted_tokens_per_pos == [2, 1, 0]
    assert _sum_spec_stats([None, None]) is None
    before = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 1}
    after = {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 9}
    figures = acceptance(before, after)
    assert figures["acceptance_rate"] == 8 / 12 and figures["mean_acceptance_length"] == 1 + 8 / 4
    assert acceptance({}, {}) == {}


def test_stats_cross_the_core_process_boundary():
    from xlaserve.engine.protocol import EngineCoreOutputs, make_encoder, make_output_decoder

    message = EngineCoreOutputs([], snapshot([(3, 2)]))
    decoded = make_output_decoder().decode(make_encoder().encode(message)).scheduler_stats
    assert decoded.spec_decoding_stats == snapshot([(3, 2)]).spec_decoding_stats
    plain = EngineCoreOutputs([], SchedulerStats(1, 0, 0.1, 0, PrefixCacheStats()))
    assert (
        make_output_decoder().decode(make_encoder().encode(plain)).scheduler_stats.spec_decoding_stats is None
    )
