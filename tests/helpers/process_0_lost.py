"""A tensor-parallel engine over two processes whose process 0 goes silent inside a step
(tests/sharding/test_multihost.py), run as `python process_0_lost.py ARG_JSON` (helpers/two_processes.py).

Process 0 sends step AT_STEP and waits until process 1 is inside it (process 1 creates arg["in_step"] as it
starts the step, whose first collective then waits on process 0), creates arg["stopped"] and stops itself
(SIGSTOP: a host gone silent, its connections left open, so that nothing but the step channel's liveness
bound notices). Process 1 follows through serve_follower, the Python API, with a liveness bound of
LIVENESS_S instead of 20 s.

arg: {"model", "node_rank", "port", "in_step", "stopped"}."""

import functools
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # `helpers` as the suite imports it

AT_STEP = 2  # a step after the first: the collectives' connections are up
LIVENESS_S = 3.0


def stop_inside_step(arg: dict) -> None:
    """Process 0: stop dead once process 1 is inside step AT_STEP."""
    from xlaserve.executor import multihost

    send, num_sent = multihost.StepSender.send, 0

    def send_then_stop(sender, inputs) -> None:
        nonlocal num_sent
        send(sender, inputs)
        num_sent += 1
        if num_sent == AT_STEP:
            deadline = time.monotonic() + 300
            while not os.path.exists(arg["in_step"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            open(arg["stopped"], "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)

    multihost.StepSender.send = send_then_stop


def say_inside_step(arg: dict) -> None:
    """Process 1: a short liveness bound, and arg["in_step"] created as step AT_STEP starts."""
    from xlaserve.executor import multihost
    from xlaserve.worker.model_runner import ModelRunner

    multihost.StepReceiver = functools.partial(multihost.StepReceiver, liveness_timeout_s=LIVENESS_S)
    run, num_run = ModelRunner.run, 0

    def run_saying(runner, inputs):
        nonlocal num_run
        num_run += 1
        if num_run == AT_STEP:
            open(arg["in_step"], "w").close()
        return run(runner, inputs)

    ModelRunner.run = run_saying


def main(arg: dict) -> None:
    from helpers.multihost_process import ENGINE, PROMPTS
    from helpers.tiny_models import compile_with_elemental_emitters_when
    from helpers.two_processes import engine_of_two
    from xlaserve import SamplingParams

    # No bits compared: the cheaper emitters, as the launch's tensor-parallel cases compile (the same
    # engine's programs there: loaded from the persistent cache where that launch ran first).
    compile_with_elemental_emitters_when(lambda: True)
    (say_inside_step if arg["node_rank"] else stop_inside_step)(arg)
    llm = engine_of_two(arg["model"], arg, **ENGINE)
    if llm is not None:  # process 0: never returns (stopped)
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
