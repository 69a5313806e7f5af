"""Host memory on a CPU device (engine/engine/host_memory.py): the greedy sampler's temporaries are
reused from step to step instead of faulted in fresh from the kernel at every call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from xlaserve.engine.host_memory import ENV, device_is_host_cpu

# The runner's sampler program over a batch-64 greedy step (logits [64, 49152]), called 20 times after
# one warm call; prints the minor page faults per call. keep_host_memory() runs first, as in the engine.
_SCRIPT = textwrap.dedent(
    """
    import json, resource
    from xlaserve.engine.host_memory import keep_host_memory
    applied = keep_host_memory()
    import jax, jax.numpy as jnp
    from xlaserve.worker.sampler import SamplingTensors, sample

    rows, vocab = 64, 49152
    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
    st = SamplingTensors(
        temperature=jnp.zeros(rows), top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.ones(rows),
        min_p=jnp.zeros(rows), seeds=jnp.zeros(rows, jnp.uint32), token_index=jnp.zeros(rows, jnp.int32),
    )
    f = jax.jit(lambda x, st: sample(x, st, with_logprobs=jnp.bool_(False)).token_ids)
    ids = f(logits, st).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        f(logits, st).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
    same = bool((ids == jnp.argmax(logits, -1)).all())
    print(json.dumps({"applied": applied, "faults": faults, "same": same}))
    """
)


def _run(keep: bool) -> dict:
    env = {**os.environ, ENV: "1" if keep else "0", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", _SCRIPT]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_sampler_temporaries_are_not_faulted_in_at_every_step():
    kept, default_malloc = _run(keep=True), _run(keep=False)
    assert kept["applied"] and not default_malloc["applied"]
    assert kept["same"] and default_malloc["same"]  # the greedy ids are argmax's either way
    # Without the settings each call faults in its ~24 MiB of temporaries (~6,000 pages of 4 KiB);
    # with them, the heap's pages are reused (what is left here comes and goes with the run: 0-1,300).
    assert default_malloc["faults"] > 1000, default_malloc
    assert kept["faults"] < default_malloc["faults"] / 3, (kept, default_malloc)


def test_platform_choice_follows_jax_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert device_is_host_cpu()
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not device_is_host_cpu()
