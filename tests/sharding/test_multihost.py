"""Tensor parallelism across two processes (jax.distributed over loopback): `xlaserve generate` with TP 2
over 2 x 1 devices and `xlaserve serve` with TP 8 over 2 x 4 fake CPU devices answer as one process on
one device does, and a follower whose step diverges stops the engine with a clear error.

These cases start their own processes, not the session's fake-mesh worker (helpers/tp_run.py): apart
from test_sharding.py they are scheduled beside it on the other xdist worker (tests/conftest.py). The
cases over 2 x 1 devices share one launch (`launch`): its two processes build their engines one after
another over one jax.distributed session, each shut down before the next, so each case's answers also
show that an engine built after others in the same processes answers as a fresh one would."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers.tiny_models import TINY_PROCESS_XLA_FLAGS, elemental_emitters
from helpers.two_processes import free_port, run_two_processes


def _generated_text(stdout: str) -> str:
    # gloo's C++ logging shares stdout; the generated text is the last other line.
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo]")][-1]


CLI = [sys.executable, "-m", "xlaserve.entrypoints.cli", "--log-level", "WARNING"]


def _generate_args(model: str) -> list[str]:
    """`xlaserve generate` with helpers/multihost_process.py's ENGINE settings: the launch's engines of
    those settings (research, then process_0_lost.py's) load its programs from the persistent cache."""
    from helpers.multihost_process import ENGINE

    return [
        "generate",
        "The capital of France is",
        "--model",
        model,
        "--raw",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--max-model-len",
        str(ENGINE["max_model_len"]),
        "--max-num-batched-tokens",
        str(ENGINE["max_num_batched_tokens"]),
        "--max-num-seqs",
        str(ENGINE["max_num_seqs"]),
        "--kv-cache-memory",
        str(ENGINE["kv_cache_memory"]),
        "--enforce-eager",
        "--dtype",
        ENGINE["dtype"],
    ]


@pytest.fixture(scope="module")
def one_process_text(tiny_llama_2kv) -> str:
    """What `xlaserve generate` writes in one process on one device: both two-process cases' reference.
    Run in this process (compiled as the subprocesses compile: TINY_PROCESS_XLA_FLAGS' emitters): one
    process start fewer."""
    import contextlib
    import io

    from xlaserve.entrypoints import cli

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), elemental_emitters():
        assert cli.main(["--log-level", "WARNING", *_generate_args(tiny_llama_2kv)]) == 0
    return _generated_text(stdout.getvalue())


@pytest.fixture(scope="module")
def launch(tiny_llama_2kv, tmp_path_factory) -> dict:
    """helpers/multihost_process.py's cases over two processes of one device each, in one launch:
    `xlaserve generate` (TP 2) first, then pipeline stages (over the session a tensor-parallel engine
    joined on process 0, and process 1's own), the research stack, LoRA, pooling and two vision-language
    models, each engine built after the last one's shutdown. {label: process 0's answers}; the inputs
    each test's reference needs under "inputs"."""
    import transformers

    from helpers.eagle3_cases import save_echo_eagle3
    from helpers.lora_adapters import make_adapter
    from helpers.multihost_process import WARMED
    from helpers.tiny_models import save_tiny_llama
    from helpers.tiny_vlm import save_tiny_qwen2_5_vl, save_tiny_qwen3_vl

    tmp_path = tmp_path_factory.mktemp("multihost")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_2kv, dtype="float32")
    adapters = [str(tmp_path / name) for name in "ab"]
    for seed, directory in enumerate(adapters):
        make_adapter(base, 8, 16, False, ["q_proj", "v_proj", "o_proj", "down_proj"], directory, seed)
    new_model = save_tiny_llama(str(tmp_path / "new"), seed=1, num_key_value_heads=2)
    qwen2_5_vl = save_tiny_qwen2_5_vl(str(tmp_path / "qwen2_5_vl"))
    qwen3_vl = save_tiny_qwen3_vl(
        str(tmp_path / "qwen3_vl"), num_layers=4, deepstack_visual_indexes=(0, 1, 2)
    )
    stages = {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, **WARMED}
    llama = {"model": tiny_llama_2kv}
    eagle3 = {"method": "eagle3", "model": save_echo_eagle3(tmp_path / "eagle3", tiny_llama_2kv)}
    cases = {
        "generate": {"case": "generate", "argv": _generate_args(tiny_llama_2kv)},
        "pipeline": {"case": "pipeline", **llama, "new_model": new_model, "adapters": adapters},
        "research": {"case": "research", **llama, "new_model": new_model},
        "lora": {"case": "lora", **llama, "adapters": adapters},
        "pool": {"case": "pool", **llama},
        "vlm": {"case": "vlm", "model": qwen2_5_vl},
        "vlm_pipeline": {"case": "vlm", "model": qwen3_vl, "engine": stages},
        "eagle3": {"case": "speculative", **llama, "engine": {"speculative_config": eagle3}},
    }
    run = run_two_processes("multihost_process.py", {"cases": cases}, devices_per_process=1, timeout_s=1800)
    run["inputs"] = {
        "adapters": adapters,
        "new_model": new_model,
        "qwen2_5_vl": qwen2_5_vl,
        "qwen3_vl": qwen3_vl,
    }
    return run


@pytest.mark.slow
def test_two_processes_tensor_parallel_2_match_one_process(launch, one_process_text):
    """`xlaserve generate` across two processes of one device each (TP 2: the two KV heads split
    between the processes; the server case below runs TP 8 over 2 x 4 devices), the launch's first engine
    (process 0's joins jax.distributed, process 1's runs over the session its script joined); the
    follower's `xlaserve generate` returned 0 once released (or the launch fails)."""
    assert _generated_text(launch["generate"]["stdout"]) == one_process_text
    assert _generated_text(launch["generate"]["stdout"]).strip()


def test_divergent_follower_stops_the_engine_with_a_clear_error():
    import threading

    from xlaserve.executor.step_channel import StepReceiver, StepSender
    from xlaserve.worker.input_batch import StepInputs, build_step_batch, sampling_tensors

    port = free_port()
    received = []

    def follower():
        receiver = StepReceiver("127.0.0.1", port, node_rank=1)
        while (inputs := receiver.recv()) is not None:
            received.append(inputs)
            receiver.report(np.array([7, 7], np.int32))  # not what process 0 sampled
        receiver.close()

    thread = threading.Thread(target=follower)
    thread.start()
    sender = StepSender("127.0.0.1", port, num_followers=1, timeout_s=30)
    inputs = StepInputs(build_step_batch([], 16, 16, 4, 16), sampling_tensors([], 16, 32, False), False, None)
    # A state model's prefix cache: slot copies before and after the forward travel with the step.
    copies = (np.array([[5], [2]], np.int32), np.array([[2, 3], [6, 7]], np.int32))
    hooks = {"lora": {"slot_ids": np.arange(16, dtype=np.int32)}, "empty": {}}
    sender.send(dataclasses.replace(inputs, state_copies=copies, hooks=hooks))
    with pytest.raises(RuntimeError, match="divergence at step 0: process 1"):
        sender.check(np.array([1, 2], np.int32))
    sender.close()
    thread.join(timeout=30)
    assert len(received) == 1 and received[0].batch.input_ids.shape == (16,)
    assert [c.tolist() for c in received[0].state_copies] == [c.tolist() for c in copies]
    assert {k: {n: a.tolist() for n, a in v.items()} for k, v in received[0].hooks.items()} == {
        "lora": {"slot_ids": list(range(16))},
        "empty": {},
    }


# Process 0's end of the step channel, in a process of its own so that it can die: once both followers
# have connected it idles past the first one's bound, sends each a call, and idles on.
_SENDER = """
import sys, time
from xlaserve.executor.follower_calls import Call
from xlaserve.executor.step_channel import StepSender
sender = StepSender("127.0.0.1", int(sys.argv[1]), num_followers=2, timeout_s=60)
time.sleep(2.5)
sender.send_call(Call("wake_up"))
time.sleep(600)
"""


def test_a_follower_stops_once_process_0_is_gone_and_waits_while_it_idles():
    """A follower waiting for process 0's next step: an idle process 0 (2.5 s without a message, past the
    follower's 1 s bound) keeps it waiting; a stopped one (SIGSTOP: a host gone silent, its connection
    left open) is noticed within the bound by ZMQ's heartbeats, a killed one (SIGKILL) at once, far
    within the other follower's 30 s bound: each a RuntimeError naming process 0's address."""
    import signal
    import time

    from xlaserve.executor.step_channel import StepReceiver

    port = free_port()
    process_0 = subprocess.Popen([sys.executable, "-c", _SENDER, str(port)])
    followers = [
        StepReceiver("127.0.0.1", port, rank, liveness_timeout_s=s) for rank, s in ((1, 1.0), (2, 30.0))
    ]
    lost = rf"lost process 0 \(its step channel at 127.0.0.1:{port} disconnected"
    try:
        assert [f.recv().method for f in followers] == ["wake_up", "wake_up"]
        for follower in followers:  # back to waiting for the next step, as `follow` is
            follower.answer_call(None)
        for rank, (follower, sig) in enumerate(zip(followers, (signal.SIGSTOP, signal.SIGKILL)), 1):
            process_0.send_signal(sig)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"process {rank}: {lost}"):
                follower.recv()
            assert time.monotonic() - start < 2.0
    finally:
        process_0.kill()
        process_0.wait()
        for follower in followers:
            follower.close()


def test_a_call_that_arrives_as_process_0_is_lost_is_not_run():
    """A call (or step) process 0 sent just before its connection closed: run, it could block the follower
    in a collective for good, so `recv` raises instead of returning it."""
    import time

    from xlaserve.executor.follower_calls import Call
    from xlaserve.executor.step_channel import ProcessZeroLost, StepReceiver, StepSender

    port = free_port()
    follower = StepReceiver("127.0.0.1", port, node_rank=1)
    sender = StepSender("127.0.0.1", port, num_followers=1, timeout_s=30)
    sender.send_call(Call("wake_up"))
    sender.close()  # the call, then the connection's end
    deadline = time.monotonic() + 30
    while not follower._is_lost and time.monotonic() < deadline:  # the watch thread saw it
        time.sleep(0.01)
    try:
        with pytest.raises(ProcessZeroLost, match=f"lost process 0 \\(its step channel at 127.0.0.1:{port}"):
            follower.recv()
    finally:
        follower.close()


def test_a_follower_exits_once_process_0_is_lost_during_a_step(tiny_llama_2kv, tmp_path):
    """Process 0 of a TP 2 engine goes silent (SIGSTOP) right after it sends a step, once the follower is
    inside it, the step's collective waiting on process 0 for good: the follower (serve_follower, the
    Python API, a 3 s liveness bound) logs why and exits, code 1, well within the bound below (room for a
    loaded machine; left alone, JAX's heartbeat timeout would abort it after 100 s)."""
    import time

    from helpers.process_0_lost import LIVENESS_S
    from helpers.two_processes import process_command, process_env

    port = free_port()
    arg = {"model": tiny_llama_2kv, "port": port, "in_step": str(tmp_path / "in_step")}
    arg["stopped"] = str(tmp_path / "stopped")
    logs = [tmp_path / f"process_{rank}.log" for rank in (0, 1)]
    processes = []
    for rank, log in enumerate(logs):
        with open(log, "w") as stderr:  # the process writes through its own copy
            command = process_command("process_0_lost.py", {**arg, "node_rank": rank})
            processes.append(
                subprocess.Popen(command, env=process_env(1), stdout=subprocess.DEVNULL, stderr=stderr)
            )
    process_0, follower = processes
    try:
        deadline = time.monotonic() + 600
        while not os.path.exists(arg["stopped"]):
            is_running = process_0.poll() is None and follower.poll() is None
            assert is_running and time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
            time.sleep(0.1)
        code = follower.wait(timeout=45)  # TimeoutExpired: it hangs
    finally:
        process_0.kill()
        process_0.wait()
        follower.kill()
        follower.wait()
    log_0, log_1 = (log.read_text() for log in logs)
    assert code == 1, log_1[-3000:]
    assert (
        f"process 1: lost process 0 (its step channel at 127.0.0.1:{port + 1} disconnected, or was silent "
        f"for {LIVENESS_S:g} s) during a step or call, whose collectives cannot complete without it: this "
        "follower exits (code 1)"
    ) in log_1, (log_0[-2000:], log_1[-3000:])


def test_an_engine_over_another_session_than_the_live_one_is_refused_by_name(tiny_llama_2kv, monkeypatch):
    """jax.distributed is joined once per process: a later engine over the live session joins it as it is
    (the launch above), one naming other ports or processes is refused before it loads anything, and so
    is one needing cross-host transfers the session was joined without (here a session stands in for
    one the caller's code joined without them: xlaserve's own always has them; nothing joins
    jax.distributed)."""
    import jax

    from xlaserve import LLM
    from xlaserve.sharding import distributed

    def joined_twice(**_):
        raise AssertionError("jax.distributed.initialize called again")

    monkeypatch.setattr(jax.distributed, "initialize", joined_twice)
    monkeypatch.setattr(distributed, "_session", distributed.Session("127.0.0.1", 29500, 2, 0, False))
    distributed.initialize("127.0.0.1", 29500, 2, 0)  # the live session: nothing to do
    engine = {
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": 29600,
        "dtype": "float32",
    }
    with pytest.raises(ValueError, match=r"master_port=29600 \(the session's: 29500\)"):
        LLM(tiny_llama_2kv, tensor_parallel_size=2, **engine)
    with pytest.raises(ValueError, match=r"nnodes=3 \(the session's: 2\), node_rank=1 \(the session's: 0\)"):
        distributed.initialize("127.0.0.1", 29500, 3, 1)
    with pytest.raises(ValueError, match="pipeline stages across processes need cross-host transfers"):
        LLM(tiny_llama_2kv, pipeline_parallel_size=2, **(engine | {"master_port": 29500}))


def test_a_jax_distributed_session_the_callers_code_joined_is_adopted_or_refused_by_name(monkeypatch):
    """jax.distributed joined by the caller's own code before the first engine: an engine naming its
    coordinator, process count and rank runs over it (the launch's processes join it so), one naming
    others is refused by each differing field; here JAX's state stands in for a joined session."""
    import jax
    from jax._src import distributed as jax_distributed

    from xlaserve.sharding import distributed

    def joined_twice(**_):
        raise AssertionError("jax.distributed.initialize called again")

    monkeypatch.setattr(jax.distributed, "initialize", joined_twice)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    for name, value in {"coordinator_address": "10.0.0.1:29500", "num_processes": 4, "process_id": 2}.items():
        monkeypatch.setattr(jax_distributed.global_state, name, value)
    monkeypatch.setattr(distributed, "_session", None)
    with pytest.raises(ValueError, match=r"master_addr='10.0.0.2' \(the session's: '10.0.0.1'\), nnodes=2 "):
        distributed.initialize("10.0.0.2", 29500, 2, 2)
    with pytest.raises(ValueError, match=r"master_port=29501 \(the session's: 29500\), node_rank=1 \(the s"):
        distributed.initialize("10.0.0.1", 29501, 4, 1)
    distributed.initialize("10.0.0.1", 29500, 4, 2)
    assert distributed._session == distributed.Session("10.0.0.1", 29500, 4, 2, cross_host_transfers=False)


@pytest.mark.slow
def test_two_process_server_matches_one_process(tiny_llama_2kv, one_process_text, tmp_path):
    """`xlaserve serve` across two processes (TP 8 over 2 x 4 devices): the OpenAI API answers from
    process 0 as one process would, and SIGTERM on process 0 releases process 1."""
    import openai

    from helpers.server_harness import ServerProcess

    port = free_port()
    multi = ["-tp", "8", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    # The smallest buckets that hold the one request (its warm-up, in both processes, compiles every
    # program: token buckets 1, 4, 16 and request bucket 1, 10 programs instead of 32 and 4's 16).
    engine = [
        "--max-model-len",
        "128",
        "--max-num-batched-tokens",
        "16",
        "--max-num-seqs",
        "1",
        "--dtype",
        "float32",
    ]
    # Compared with one process's text: a tiny process's emitters (helpers/tiny_models.py).
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {TINY_PROCESS_XLA_FLAGS}"}
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xlaserve.entrypoints.cli",
            "serve",
            tiny_llama_2kv,
            *engine,
            *multi,
            "--node-rank",
            "1",
            "--kv-cache-memory",
            str(2**23),
        ],
        env=dict(os.environ, **env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = ServerProcess(
        str(tmp_path),
        str(tmp_path / "cache"),
        [*engine, *multi, "--node-rank", "0"],
        model=tiny_llama_2kv,
        env=env,
    )
    try:
        leader.wait_ready()
        client = openai.OpenAI(base_url=leader.url + "/v1", api_key="unused")
        served = (
            client.completions.create(
                model=tiny_llama_2kv, prompt="The capital of France is", max_tokens=8, temperature=0
            )
            .choices[0]
            .text
        )
    finally:
        code = leader.stop()
    _, follower_err = follower.communicate(timeout=120)
    assert code == 0, leader.log_tail()
    assert follower.returncode == 0, follower_err[-3000:]
    assert served.strip() and served == one_process_text


@pytest.mark.slow
def test_research_stack_across_two_processes(launch):
    """TP 2 over two processes of one device each (helpers/multihost_process.py): update_weights_from_path
    gives a one-device engine's answers on the new checkpoint, sleep(2)/wake_up gives the same bits back,
    update_weights in two parts (each writing some layers of the stacks, the shards cut in each process)
    brings the first checkpoint's bits back, and a tensor of the wrong shape is refused with nothing
    changed on either process (the follower's checksums would stop a diverged engine)."""
    from helpers.multihost_process import ENGINE, PROMPTS, answers
    from xlaserve import LLM

    new_model, run = launch["inputs"]["new_model"], launch["research"]
    assert len(PROMPTS) == 2 and run["updated"] > 0
    with elemental_emitters():  # as the launch's tensor-parallel cases compile
        reference = answers(LLM(new_model, **(ENGINE | {"tensor_parallel_size": 1})))
    assert run["after"]["tokens"] == reference["tokens"] != run["before"]["tokens"]
    np.testing.assert_allclose(run["after"]["logprobs"], reference["logprobs"], atol=1e-5)
    assert run["freed"] > 0 and run["placed"] == run["freed"]
    assert run["woken"] == run["after"]  # every float, exactly
    assert run["back"] == run["before"]
    assert "'model.layers.1.self_attn.q_proj.weight' has shape" in run["refused"]
    assert "'model.layers.0.self_attn.q_proj.weight' has shape" in run["refused_first"]
    assert run["after_refusal"] == run["before"]
    assert [m.split(" runs on one host")[0] for m in run["no_python_calls"]] == [
        "apply_model",
        "collective_rpc",
    ]


@pytest.mark.slow
def test_lora_across_two_processes(tiny_llama_2kv, launch):
    """TP 2 over two processes with one LoRA slot: adapter A, B, then A again (each written into the slot
    by process 0 while preparing a step, and by the follower from the same directory before that step)
    answer as one device with the same adapters does (helpers/multihost_process.py)."""
    from helpers.multihost_process import ENGINE, LORA, lora_rounds
    from xlaserve import LLM

    adapters, run = launch["inputs"]["adapters"], launch["lora"]
    with elemental_emitters():  # as the launch's tensor-parallel cases compile
        reference = lora_rounds(
            LLM(tiny_llama_2kv, **(ENGINE | LORA | {"tensor_parallel_size": 1})), adapters
        )
    assert run["loads"] == 3
    for got, want in zip(run["rounds"], reference, strict=True):
        assert got["tokens"] == want["tokens"]
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], atol=1e-5)
    assert (
        run["rounds"][0] == run["rounds"][2]
        and run["rounds"][0]["tokens"][0] != run["rounds"][1]["tokens"][0]
    )


@pytest.mark.slow
def test_pooling_across_two_processes(tiny_llama_2kv, launch):
    """A pooling engine (runner="pooling", MEAN pooled) with TP 2 over two processes: each prompt's
    embedding as one device gives it (helpers/multihost_process.py; process 0's outputs read through the
    pooling hook)."""
    from helpers.multihost_process import ENGINE, POOL, embeddings
    from xlaserve import LLM

    run = launch["pool"]
    with elemental_emitters():  # as the launch's tensor-parallel cases compile
        reference = embeddings(LLM(tiny_llama_2kv, **(ENGINE | POOL | {"tensor_parallel_size": 1})))
    assert len(run["embeddings"]) == len(reference) == 2
    np.testing.assert_allclose(run["embeddings"], reference, atol=1e-5)
    assert np.linalg.norm(reference, axis=1) == pytest.approx([1.0, 1.0])  # normalized, not empty


@pytest.mark.slow
def test_eagle3_across_two_processes(tiny_llama_2kv, launch):
    """An EAGLE-3 drafter (helpers/eagle3_cases.py's echo head) with TP 2 over two processes, its layer
    split over both as the target's layers are, the steps' host arrays it reads placed in each: the
    greedy tokens one device gives without speculation, and some drafts accepted."""
    from helpers.multihost_process import ENGINE, answers
    from xlaserve import LLM

    run = launch["eagle3"]
    with elemental_emitters():  # as the launch's tensor-parallel cases compile
        reference = answers(LLM(tiny_llama_2kv, **(ENGINE | {"tensor_parallel_size": 1})), max_tokens=16)
    assert run["tokens"] == reference["tokens"]
    np.testing.assert_allclose(run["logprobs"], reference["logprobs"], atol=1e-5)
    assert 0 < run["metrics"]["num_accepted_tokens"] < run["metrics"]["num_draft_tokens"]


@pytest.mark.slow
def test_vision_language_model_across_two_processes(launch):
    """A Qwen2.5-VL (its tower, M-RoPE) with TP 2 over two processes: an image prompt, a two-image one and
    a text one answered together as one device answers them (the encoder's step arrays reach the follower
    under their own names; helpers/multihost_process.py)."""
    from helpers.multihost_process import ENGINE, image_answers
    from xlaserve import LLM

    model, run = launch["inputs"]["qwen2_5_vl"], launch["vlm"]
    with elemental_emitters():  # as the launch's tensor-parallel cases compile
        reference = image_answers(LLM(model, **(ENGINE | {"tensor_parallel_size": 1})), model)
    assert run["tokens"] == reference["tokens"]
    for got, want in zip(run["logprobs"], reference["logprobs"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow
def test_pipeline_stages_across_two_processes_run_lora_and_the_research_stack(tiny_llama_2kv, launch):
    """PP 2 over two processes of one device each (layer 0 on process 0, layer 1 and the sampler on process
    1; helpers/multihost_process.py "pipeline"), one launch: adapters A, B and the base model in one batch
    give one device's bits (each process's stage holds its layers' slots, the follower's written before
    the step); update_weights_from_path gives a fresh one-device engine's bits on the new checkpoint,
    sleep(2)/wake_up the same bits again, two partial updates (each touching both processes' stages) the
    first checkpoint's; a wrong shape on either process's stage is refused with nothing changed on either
    (the other tensor of the call, on the other process, not written). Built after the tensor-parallel
    `xlaserve generate` in the same processes (before stop 63 refused: the session process 0 joined for
    it had no cross-host transfers)."""
    from helpers.multihost_process import ENGINE, PIPELINE, adapter_batch, answers
    from xlaserve import LLM

    inputs, run = launch["inputs"], launch["pipeline"]
    adapters, new_model = inputs["adapters"], inputs["new_model"]
    assert run["executor"] == "MultiHostPipelineExecutor"
    one_device = ENGINE | PIPELINE | {"pipeline_parallel_size": 1}
    reference = LLM(tiny_llama_2kv, **one_device)
    assert run["adapters"] == adapter_batch(reference, adapters)  # every token id and logprob, exactly
    assert len({tuple(t) for t in run["adapters"]["tokens"]}) == 3
    assert run["before"] == answers(reference)
    assert run["updated"] > 0
    assert run["after"] == answers(LLM(new_model, **one_device)) and run["after"] != run["before"]
    assert run["freed"] > 0 and run["placed"] == run["freed"]
    assert run["woken"] == run["after"]
    assert run["back"] == run["before"]
    assert (
        "process 1: ValueError: weights: 'model.layers.1.self_attn.q_proj.weight' has shape" in run["refused"]
    )
    assert "'model.layers.0.self_attn.q_proj.weight' has shape" in run["refused_first"]
    assert run["after_refusal"] == run["before"]


@pytest.mark.slow
def test_vision_language_model_on_pipeline_stages_across_two_processes(launch):
    """A 4-layer Qwen3-VL on PP 2 over two processes of one device each: the tower on process 0's first
    stage, process 1's stage (layers 2-3) gets each step's M-RoPE positions with the step and the image
    rows its DeepStack layer 2 adds from process 0 over JAX's cross-host transfer; an image prompt, a
    two-image one and a text one answered together give one device's bits (helpers/multihost_process.py)."""
    from helpers.multihost_process import ENGINE, image_answers
    from xlaserve import LLM

    model, run = launch["inputs"]["qwen3_vl"], launch["vlm_pipeline"]
    reference = image_answers(LLM(model, **(ENGINE | {"tensor_parallel_size": 1})), model)
    assert run["tokens"] == reference["tokens"] and len({tuple(t) for t in run["tokens"]}) == 3
    assert run["logprobs"] == reference["logprobs"]  # every float, exactly
