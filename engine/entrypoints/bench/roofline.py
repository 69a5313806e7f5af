"""`xlaserve bench latency|throughput --roofline`: a decode step against the time to read the weights.

A decode step reads every weight once (the KV it reads is small at short contexts), so at small
batches its floor is the weights' bytes over the device's bandwidth. This sets the run's mean time
per output token (one step per token for every running request) beside that floor: the weights'
bytes (`xlaserve:model_weight_bytes`, as the engine holds them) over the copy bandwidth measured on
this device by the attention bench's `copy_bandwidth` (a device-to-device copy: bytes read plus
bytes written per second, the rate the attention bench compares its KV reads with). Issue 37's GPU
target: batch 1 within 1.15x of the floor. Use prompts of a few tokens (`--input-len 16`), so that
the steps are decodes; at batch 64 the ratio shows what the batch adds on top of the weights.
"""

from __future__ import annotations

BATCH_1_TARGET = 1.15  # a batch-1 decode step's time over the weights' read time, on a GPU


def measure(llm, run: dict, is_batch_1: bool) -> dict:
    """The roofline figures of `run` (a `run_xlaserve` report) on `llm`'s device."""
    import jax  # here, not at import: the CLI starts without jax (tests/layout/test_install.py)

    from xlaserve.entrypoints.bench.attention import copy_bandwidth
    from xlaserve.kernels.backend import GPU_PLATFORMS

    on_gpu = jax.default_backend() in GPU_PLATFORMS
    bandwidth, how = copy_bandwidth(2**30 if on_gpu else 2**26, min_seconds=1.0 if on_gpu else 0.2)
    weight_bytes = next(m.value for m in llm.get_metrics() if m.name == "xlaserve:model_weight_bytes")
    floor_s = weight_bytes / bandwidth
    tpot_s = run["tpot_s"]["mean"]
    report = {
        "device": str(jax.devices()[0]),
        "weight_bytes": weight_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "copy_bandwidth_how": how,
        "weight_read_s": floor_s,
        "tpot_s": tpot_s,
        "ratio": tpot_s / floor_s,
    }
    if is_batch_1:
        report["target"] = BATCH_1_TARGET
        report["met"] = on_gpu and report["ratio"] <= BATCH_1_TARGET
    return report


def print_roofline(r: dict) -> None:
    target = ""
    if "target" in r:
        verdict = (
            "met" if r["met"] else "not met" if "cuda" in r["device"].lower() else "judged on a GPU only"
        )
        target = f" (batch-1 target <= {r['target']}: {verdict})"
    print(
        f"roofline on {r['device']}: weights {r['weight_bytes'] / 2**20:.1f} MiB at "
        f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s ({r['copy_bandwidth_how']}) = "
        f"{r['weight_read_s'] * 1e3:.2f} ms a step; TPOT {r['tpot_s'] * 1e3:.2f} ms: "
        f"{r['ratio']:.2f}x{target}"
    )
