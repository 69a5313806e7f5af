"""xlaserve's engine: `from engine import LLM, SamplingParams`."""

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in jax and the model code; host-only users (tests of the scheduler) skip that cost.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
