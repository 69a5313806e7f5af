"""`xlaserve bench serve --structured-output-ratio`: which requests carry a schema, the schema each
gets, and the report's TTFT split (no server needed)."""

from __future__ import annotations

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.bench.serve import RequestResult, bench_schema, is_structured, summarize
from xlaserve.sampling_params import StructuredOutputsParams


def test_ratio_spreads_schemas_evenly():
    assert sum(is_structured(i, 0.5) for i in range(32)) == 16
    assert [is_structured(i, 0.25) for i in range(8)] == [False, False, False, True] * 2
    assert not any(is_structured(i, 0.0) for i in range(8)) and all(is_structured(i, 1.0) for i in range(8))


def test_each_request_gets_its_own_schema_and_it_compiles():
    assert bench_schema(1) != bench_schema(2)  # nothing is served from the grammar cache
    assert check_grammar(StructuredOutputsParams(json=bench_schema(7)))


def test_report_splits_ttft_by_schema():
    results = [
        RequestResult(is_structured=i % 2 == 1, is_ok=True, ttft=0.1 * (1 + i % 2), e2e=1.0, output_tokens=4)
        for i in range(4)
    ]
    run = summarize(results, elapsed=2.0, max_concurrency=4, request_rate=float("inf"))
    assert run["num_structured"] == 2
    assert run["ttft_s_structured"]["p50"] == 0.2 and run["ttft_s_unstructured"]["p50"] == 0.1
