"""`LLM`: the offline Python API (`generate`; `chat`, its conversations rendered by entrypoints/llm_chat.py;
with runner="pooling": `embed`, `classify`, `score`, `encode`, `reward`, entrypoints/llm_pooling.py; the
research stack, `update_weights`, `sleep`, `apply_model`..., entrypoints/llm_research.py), driving an
in-process EngineCore."""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

from xlaserve.config import EngineConfig
from xlaserve.engine.media import MediaPolicy
from xlaserve.engine.metrics import EngineMetrics, Metric
from xlaserve.engine.output_processor import OutputProcessor
from xlaserve.engine.processor import InputProcessor, PromptType
from xlaserve.engine.startup import start_engine
from xlaserve.entrypoints.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from xlaserve.entrypoints.llm_chat import ChatRenderer, Conversation
from xlaserve.entrypoints.llm_pooling import PoolingMethods, UseTqdm, progress_bar, speed_postfix
from xlaserve.entrypoints.llm_research import ResearchMethods
from xlaserve.executor import follow
from xlaserve.lora_request import LoRARequest
from xlaserve.outputs import RequestOutput
from xlaserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def serve_follower(model: str | None = None, **engine_args) -> None:
    """Process node_rank > 0 of a multi-host engine: hold this host's shards and run every step
    process 0 sends, until it shuts down. The process may then serve the next engine process 0 builds,
    over the same jax.distributed session (sharding/distributed.py). Process 0 lost between steps raises
    ProcessZeroLost; lost during a step, it ends this process (code 1: executor/step_channel.py
    StepReceiver), as a collective waiting on process 0 cannot be cancelled."""
    config = EngineConfig.from_kwargs(model, **engine_args)
    _, core = start_engine(config)
    try:
        follow(core.runner, config.parallel)
    finally:
        core.shutdown()


class LLM(PoolingMethods, ResearchMethods):
    """Generate text offline: `LLM().generate("Hello")`, `LLM(model).chat([...])`.

    `model`: an HF directory, a .gguf file, or None / "smollm2" for the embedded default model.
    Keyword arguments are vLLM's engine arguments (max_model_len, max_num_seqs, block_size, ...).
    With `skip_tokenizer_init=True` no tokenizer is loaded: prompts are {"prompt_token_ids": [...]},
    outputs carry token ids and empty text, and `chat` / `stream` are unavailable.
    """

    def __init__(self, model: str | None = None, *, mesh=None, **engine_args):
        """`mesh`: a `jax.sharding.Mesh` the engine shares with a trainer: it runs on that mesh's
        devices (tensor_parallel_size defaults to all of them), and `update_weights` takes the trainer's
        arrays on it device to device."""
        if mesh is not None and engine_args.get("tensor_parallel_size") is None:
            engine_args["tensor_parallel_size"] = mesh.devices.size // engine_args.get(
                "data_parallel_size", 1
            )
        self.config = EngineConfig.from_kwargs(model, **engine_args)
        self.default_sampling = self.config.model.sampling_defaults()
        self.config.model.log_sampling_defaults(self.default_sampling)
        parallel = self.config.parallel
        if parallel.node_rank != 0:
            raise ValueError(f"LLM runs on node_rank 0; node_rank={parallel.node_rank} runs serve_follower()")
        devices = None if mesh is None else list(mesh.devices.flat)
        model_info, self.engine_core = start_engine(self.config, devices)  # the one EngineConfig, built above
        self.tokenizer, self.max_model_len = model_info.tokenizer, self.engine_core.max_model_len
        if parallel.nnodes > 1:
            atexit.register(self.shutdown)
        self.input_processor = InputProcessor.for_engine(
            self.config, self.tokenizer, model_info, self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        executor = self.engine_core.executor
        self.metrics.record_engine(
            executor.weight_bytes, executor.num_kv_blocks, self.config.cache, self.max_model_len
        )
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Release the other processes of a multi-host engine (they exit their step loop, and may serve
        a next engine built over the same processes and ports)."""
        atexit.unregister(self.shutdown)  # its reference would keep this engine's arrays to the exit
        self.engine_core.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with (vLLM's): the model's generation_config.json
        (--generation-config, --override-generation-config) over SamplingParams' own defaults."""
        return SamplingParams(**self.default_sampling)

    # -- the public API -------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: UseTqdm = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (a string, {"prompt": ...} or {"prompt_token_ids": [...]}; for a
        vision-language model {"prompt": text with a placeholder per image, "multi_modal_data":
        {"image": PIL.Image | list}}); outputs come back in input order, final ones whatever a
        SamplingParams' output_kind says (as vLLM's). `lora_request`: one adapter for every prompt, or one
        (or None: the base model) per prompt; needs enable_lora=True. `use_tqdm`: a bool, or a tqdm-like
        callable that makes the progress bar (vLLM's)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.input_processor.process(p) for p in prompts]
        return self._generate(
            tokenized, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request
        )

    def _generate(self, tokenized, sampling_params, *, use_tqdm, priority=None, lora_request=None):
        """`tokenized`: (text, ids, images) per prompt (InputProcessor.process)."""
        self._require_runner("generate", "generate()")
        params = self._broadcast_params(sampling_params, len(tokenized))
        loras = self._broadcast_loras(lora_request, len(tokenized))
        tokenized = [
            self._truncated(prompt, p.truncate_prompt_tokens, p.max_tokens)
            for prompt, p in zip(tokenized, params)
        ]
        if sampling_params is None:
            params = [self._within_context(p, len(ids)) for p, (_, ids, _) in zip(params, tokenized)]
        for (_, ids, _), p in zip(tokenized, params):  # validate everything before adding anything
            self.input_processor.validate_prompt(ids)
            self.input_processor.validate_params(p)
        for lora in {lora for lora in loras if lora is not None}:
            self.engine_core.check_lora(lora)
        priorities = list(priority) if priority is not None else [0] * len(tokenized)
        return self._run(tokenized, params, priorities, use_tqdm, loras)

    def _truncated(self, prompt: tuple, keep: int | None, max_tokens: int | None) -> tuple:
        """A (text, ids, images) prompt cut to its last `keep` tokens (truncate_prompt_tokens; -1 leaves
        room for `max_tokens`); the text of a cut prompt is not its ids' any more, so the output decodes
        them."""
        text, ids, mm = prompt
        cut = self.input_processor.truncate(ids, keep, bool(mm), max_tokens or 1)
        return prompt if cut is ids else (None, cut, mm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str = "auto",
        use_tqdm: UseTqdm = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template.
        A vision-language model takes OpenAI's content parts: `image_url` (a data: URL) and `image_pil`
        (a PIL.Image) beside `text`; one that takes videos (the Qwen VL families) also `video_url` (a
        data: URL, its frames sampled as media_io_kwargs says: engine/engine/video.py).
        vLLM's rendering arguments: `continue_final_message` (the last message, the assistant's, is
        continued: needs add_generation_prompt=False), `tools` (OpenAI's function definitions, for
        the template to render), `chat_template_kwargs` (the template's own variables, e.g.
        Qwen3's `enable_thinking`) and `chat_template_content_format` (the server's
        --chat-template-content-format: "string" joins a message's parts into one string, "openai" gives
        the template lists of parts, "auto" the latter where the template loops over a message's
        content). `mm_processor_kwargs`: the processor's settings for these conversations (vLLM's; the
        Qwen families' min_pixels, max_pixels and fps)."""
        self._require_tokenizer("chat()")
        renderer = ChatRenderer(
            self.tokenizer,
            self.input_processor.mm_processor,
            MediaPolicy(video_num_frames=self.config.model.video_num_frames),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            chat_template_content_format=chat_template_content_format,
        )
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.input_processor.process(
                {**renderer.prompt(c), "mm_processor_kwargs": mm_processor_kwargs}, add_special_tokens=False
            )
            for c in conversations
        ]
        return self._generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: UseTqdm = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): each prompt's best `params.beam_width` beams, best
        first, in input order. Every step runs all prompts' live beams together, one token each; each
        prompt must leave room for max_tokens in the context."""
        self._require_runner("generate", "beam_search()")
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.check_width(self.input_processor.max_logprobs)
        tokenized = [
            self.input_processor.process(p)
            for p in ([prompts] if isinstance(prompts, (str, dict)) else prompts)
        ]
        loras = self._broadcast_loras(lora_request, len(tokenized))
        for _, ids, _ in tokenized:  # every step's prompt fits, before the first runs
            self.input_processor.validate_prompt(ids)
            self.input_processor.check_fits(len(ids), params.max_tokens)
        eos = self.input_processor.eos_token_id
        searches = [BeamSearch(ids, params, eos) for _, ids, _ in tokenized]
        step = params.step_params()
        steps = range(params.max_tokens)
        for _ in progress_bar(use_tqdm, iterable=steps, desc="Beam search steps") if use_tqdm else steps:
            live = [(search, i) for i, search in enumerate(searches) if not search.is_done]
            if not live:
                break
            beams = [(None, beam.tokens, tokenized[i][2]) for search, i in live for beam in search.beams]
            step_loras = [loras[i] for search, i in live for _ in search.beams]
            outputs = iter(self._generate(beams, step, use_tqdm=False, lora_request=step_loras))
            for search, _ in live:
                search.advance([next(outputs).outputs[0].logprobs[0] for _ in search.beams])
        decode = None if self.tokenizer is None else self.tokenizer.decode
        return [search.result(decode) for search in searches]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is generated (n must be 1)."""
        self._require_tokenizer("stream()")
        self._require_runner("generate", "stream()")
        params = sampling_params or self.get_default_sampling_params()
        text, ids, _ = self._truncated(
            (*self.input_processor.tokenize(prompt), []), params.truncate_prompt_tokens, params.max_tokens
        )
        if sampling_params is None:
            params = self._within_context(params, len(ids))
        if params.n != 1:
            raise ValueError(f"stream() takes n=1, got n={params.n}")
        request_id = str(next(self._request_counter))
        added = self._add_request(request_id, text, ids, params, 0, output_kind="delta")
        try:
            while self.engine_core.has_unfinished_requests():
                for output in self._step():
                    if output.request_id == request_id and output.outputs[0].text:
                        yield output.outputs[0].text
        finally:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(added)

    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms named like vLLM's (prefix `xlaserve:`)."""
        return self.metrics.snapshot()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; with `reset_running_requests` (vLLM's), the running requests'
        K/V too: they are preempted and recompute it (after a weight update: with the new weights)."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    # -- the loop -------------------------------------------------------------------------------

    def _require_runner(self, runner: str, what: str) -> None:
        if self.config.model.runner != runner:
            raise ValueError(
                f"{what} needs runner={runner!r}; this LLM runs runner={self.config.model.runner!r}"
            )

    def _require_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs a tokenizer, and this LLM was built with skip_tokenizer_init=True: "
                "use generate() with {'prompt_token_ids': [...]}"
            )

    def _within_context(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """The default params with a generation config's max_tokens cut to the room the prompt leaves
        (as the server cuts it), not an error for every prompt that leaves less."""
        room = max(1, self.max_model_len - num_prompt_tokens)
        if "max_tokens" not in self.default_sampling or params.max_tokens <= room:
            return params
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def _broadcast_params(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries; it must be one or one per prompt "
                f"({num_prompts})"
            )
        return list(sampling_params)

    @staticmethod
    def _broadcast_loras(lora_request, num_prompts: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * num_prompts
        if len(lora_request) != num_prompts:
            raise ValueError(
                f"lora_request has {len(lora_request)} entries; it must be one or one per prompt "
                f"({num_prompts})"
            )
        return list(lora_request)

    def _run(self, tokenized, params, priorities, use_tqdm: UseTqdm, loras) -> list[RequestOutput]:
        if self.engine_core.is_sleeping:  # before any request is added: none is left half-queued
            raise ValueError("the engine is asleep (sleep() was called): call wake_up() before generating")
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, ((text, ids, mm), p, prio, lora) in enumerate(zip(tokenized, params, priorities, loras)):
                request_id = str(next(self._request_counter))
                added += self._add_request(request_id, text, ids, p, prio, lora_request=lora, mm_features=mm)
                order[request_id] = i
            results: list[RequestOutput | None] = [None] * len(order)
            # As vLLM's: the bar counts completions (n per prompt) and shows the tokens per second.
            bar = progress_bar(
                use_tqdm,
                total=sum(p.n for p in params),
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix=speed_postfix(0, 0, 0.0),
            )
            num_input_tokens = num_output_tokens = 0
            with closing(bar):
                while self.engine_core.has_unfinished_requests():
                    for output in self._step():
                        if output.finished:
                            results[order[output.request_id]] = output
                            num_completions = len(output.outputs)
                            num_input_tokens += len(output.prompt_token_ids) * num_completions
                            num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            if use_tqdm:
                                elapsed = bar.format_dict["elapsed"]
                                bar.postfix = speed_postfix(num_input_tokens, num_output_tokens, elapsed)
                            bar.update(num_completions)
            return results
        except BaseException:
            # Nothing leaks: whatever this call added and did not finish is aborted.
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests(list(order))
            raise

    def _add_request(
        self,
        request_id,
        text,
        ids,
        params: SamplingParams,
        priority: int,
        output_kind: str = "final",
        lora_request: LoRARequest | None = None,
        mm_features=(),
    ) -> list[str]:
        now = time.time()
        requests = self.input_processor.make_requests(
            request_id,
            ids,
            params,
            arrival_time=now,
            priority=priority,
            lora_request=lora_request,
            mm_features=mm_features,
        )
        self.output_processor.add_requests(request_id, requests, text, ids, now, output_kind)
        for request in requests:
            self.engine_core.add_request(request)
        return [r.request_id for r in requests]

    def _step(self) -> list[RequestOutput]:
        if self.engine_core.is_sleeping:  # a stream resumed after sleep(mode="keep"): it would never end
            raise ValueError("the engine is asleep (sleep() was called): call wake_up() first")
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        self._record_stats()
        return processed.request_outputs

    def _record_stats(self) -> None:
        """The core's stats (its sleep state among them) and the outputs' into the metrics."""
        self.metrics.record_scheduler(self.engine_core.make_stats())
        self.metrics.record_iteration(self.output_processor.drain_stats())
