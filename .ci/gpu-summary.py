"""The engine's figures from one .ci/gpu-check part as a markdown table for engine/PERFORMANCE.md:
`python3 .ci/gpu-summary.py OUT` reads OUT/*.json (`bench --output-json` reports, named after their runs)
in the order they were written. The log beside them has the rest (start-up, programs compiled)."""

import glob
import json
import os
import sys

out = sys.argv[1]
paths = sorted(glob.glob(os.path.join(out, "*.json")), key=os.path.getmtime)
print(
    "| run | bench | prompts x (in, out) | req/s | output tok/s | TTFT mean | TPOT mean / p50 | host / step "
    "| TPOT over the weights' read time |"
)
print("|---|---|---|---|---|---|---|---|---|")
for path in paths:
    with open(path) as f:
        report = json.load(f)
    r = report["xlaserve"]
    roof = report.get("roofline")
    roofline = (
        f"{roof['ratio']:.2f}x of {roof['weight_read_s'] * 1e3:.2f} ms ({roof['device']}, "
        f"{roof['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)"
        if roof
        else ""
    )
    print(
        f"| {os.path.basename(path)[:-5]} | {report['bench']} | {report['num_prompts']} x "
        f"({report['input_len']}, {report['output_len']}) | {r['requests_per_s']:.2f} | "
        f"{r['output_tokens_per_s']:.1f} | {r['ttft_s']['mean'] * 1e3:.1f} ms | "
        f"{r['tpot_s']['mean'] * 1e3:.2f} / {r['tpot_s']['p50'] * 1e3:.2f} ms | "
        f"{r['host_ms_per_step']:.2f} ms | {roofline} |"
    )
if not paths:
    print(f"(no reports in {out})")
