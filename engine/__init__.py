"""xlaserve's engine: `from xlaserve import LLM, SamplingParams`."""

from xlaserve.entrypoints.beam_search import BeamSearchOutput, BeamSearchParams
from xlaserve.lora_request import LoRARequest
from xlaserve.outputs import CompletionOutput, RequestOutput
from xlaserve.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name):
    # LLM pulls in jax and the model code; host-only users (tests of the scheduler) skip that cost.
    if name == "LLM":
        from xlaserve.entrypoints.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from xlaserve.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
