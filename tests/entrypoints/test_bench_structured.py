"""`xlaserve bench serve --structured-output-ratio` and `--long-prompt-ratio`: which requests carry a
schema or a long context, the schema each gets, the report's TTFT and TPOT splits and its ratios
against a peer (no server needed)."""

from __future__ import annotations

from xlaserve.engine.structured_output import check_grammar
from xlaserve.entrypoints.bench.offline import workload
from xlaserve.entrypoints.bench.report import RequestResult, peer_ratios, serve_summary
from xlaserve.entrypoints.bench.serve import bench_schema, is_structured, with_long_prompts
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
    run = serve_summary(results, elapsed=2.0, max_concurrency=4, request_rate=float("inf"))
    assert run["num_structured"] == 2
    assert run["ttft_s_structured"]["p50"] == 0.2 and run["ttft_s_unstructured"]["p50"] == 0.1


def test_long_prompts_are_spread_and_reported_apart():
    conversations = with_long_prompts(workload(8), 0.25, num_words=300)
    long = [c[-1]["content"].startswith("Document ") for c in conversations]
    assert long == [False, False, False, True] * 2
    # Each long context is its own (no prefix cache serves one from another) and about as long as asked.
    assert (
        conversations[3][-1]["content"].split("\n\n")[0] != conversations[7][-1]["content"].split("\n\n")[0]
    )
    assert len(conversations[3][-1]["content"].split()) >= 300
    # Short requests decode at 10 ms a token, long ones at 30 ms: the TPOT split shows each.
    results = [
        RequestResult(
            is_long=i % 2 == 1, is_ok=True, ttft=1.0, e2e=1.0 + 0.01 * (1 + 2 * (i % 2)) * 4, output_tokens=5
        )
        for i in range(4)
    ]
    run = serve_summary(results, elapsed=2.0, max_concurrency=4, request_rate=float("inf"))
    assert run["num_long"] == 2
    assert abs(run["tpot_s_short"]["p50"] - 0.01) < 1e-12 and abs(run["tpot_s_long"]["p50"] - 0.03) < 1e-12
    peer = dict(run, output_tokens_per_s=run["output_tokens_per_s"] * 2, tpot_s_short={"p50": 0.02})
    ratios = peer_ratios(run, peer)
    assert ratios["output_tokens_per_s"] == 0.5 and abs(ratios["tpot_s_short_p50"] - 0.5) < 1e-12
