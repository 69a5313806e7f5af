"""`python -m xlaserve.entrypoints.bench.attention` (`xlaserve bench attention`): its verdict logic on given
timings, and a run at CPU scale."""

from __future__ import annotations

from xlaserve.entrypoints.bench import attention as bench
from xlaserve.entrypoints.bench.attention import GPU_CASES, Timing

BANDWIDTH = 4.0e12  # bytes/s


def timing(case: str, kernel: str, share: float, tiling: str = "default") -> Timing:
    """A Timing of `case` whose KV read reaches `share` of BANDWIDTH."""
    shape = GPU_CASES[case]
    kv_bytes = shape.kv_bytes_read()
    return Timing(case, kernel, tiling, kv_bytes / (share * BANDWIDTH), kv_bytes, shape.attention_flops())


def test_verdict_names_target_order_and_split_kv():
    timings = [
        timing("decode b64 ctx4k", "reference", 0.3),
        timing("decode b64 ctx4k", "pallas", 0.75),
        timing("decode b64 ctx4k", "jax-triton", 0.6),
        timing("mixed 512 tokens", "pallas", 0.5),
        timing("mixed 512 tokens", "jax-triton", 0.4),
        timing("decode b8 ctx4k", "pallas", 0.2),
        timing("decode b8 ctx4k", "pallas", 0.6, "num_kv_splits=8"),
        timing("decode b64 ctx4k", "pallas", 0.74, "num_kv_splits=2"),
    ]
    lines = bench.verdict(timings, BANDWIDTH, on_gpu=True, failed=set()).splitlines()
    assert lines[0].startswith("- Decode target") and ": met: pallas (default) reads KV at 75%." in lines[0]
    assert (
        lines[1]
        == "- Fastest first (decode b64 + mixed, best tilings): AUTO_GPU_ORDER = ('pallas', 'jax-triton')."
    )
    # The best batch-8 tiling is the split one (60% of copy against 75% at batch 64): it keeps up.
    assert lines[2] == "- Decode at batch 8 reads KV at 60% of copy, best tiling (pallas): keeps up."
    assert lines[3] == (
        "- Split-KV on decode b8 ctx4k: best num_kv_splits=8 at 60% of copy, against 20% unsplit (default): "
        "make it the default for such steps."
    )
    assert lines[4].endswith("against 75% unsplit (default): not worth it here.")


def test_verdict_reports_a_missed_target_and_failed_kernels():
    timings = [timing("decode b64 ctx4k", "pallas", 0.5)]
    text = bench.verdict(timings, BANDWIDTH, on_gpu=True, failed={"jax-triton"})
    assert "FAILED the check against the reference: jax-triton" in text
    assert ": NOT met: pallas (default) reads KV at 50%." in text


def test_cpu_run_checks_times_and_appends_its_section(tmp_path):
    notes = tmp_path / "KERNELS.md"
    notes.write_text("# Attention kernels\n\nDesign notes.\n")
    assert bench.main(["--out", str(notes)]) == 0
    text = notes.read_text()
    assert text.startswith("# Attention kernels\n\nDesign notes.\n\n## Measurements\n")
    assert "| mixed f32 | pallas |" in text and "| no |" not in text  # checked against the reference
    assert "| decode b4 ctx256 | pallas | default |" in text
    assert "On CPU: no verdict on speed" in text


def test_cli_hands_its_flags_to_the_bench():
    """`xlaserve bench attention FLAGS` parses FLAGS with the bench's own parser (the CLI declares none,
    so its start imports no jax)."""
    from xlaserve.entrypoints import cli

    args = cli.build_parser().parse_args(["bench", "attention", "--quick", "--out", "notes.md"])
    assert args.func is cli.cmd_bench_attention
    assert args.attention_args == ["--quick", "--out", "notes.md"]
