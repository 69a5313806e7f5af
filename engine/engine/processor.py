"""Input processing: prompts to validated Requests (tokenize, check limits, resolve seeds)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from xlaserve.config import EngineConfig, KVTransferConfig
from xlaserve.core.limits import RequestLimits, check_prompt_length
from xlaserve.core.multimodal import MultiModalFeature
from xlaserve.core.request import Request, child_request_id
from xlaserve.engine.media import MediaError
from xlaserve.engine.media_uuids import check_uuids
from xlaserve.engine.mm_processor import MultiModalProcessor, as_videos
from xlaserve.engine.pooling_inputs import PoolingInputs
from xlaserve.engine.structured_output import check_grammar
from xlaserve.lora_request import LoRARequest
from xlaserve.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, as_token_ids

PromptType = str | dict[str, Any]

# SamplingParams fields that carry token ids, checked against the vocabulary at admission: an id
# past it would index past the [R, V] logit arrays inside the step and take the engine down.
# A field missing from SamplingParams is skipped, so a feature adds its name here as it lands
# (a dict's keys are the ids, as in OpenAI's logit_bias; nested lists are flattened).
TOKEN_ID_FIELDS = ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words_token_ids")


class InputProcessor(PoolingInputs):
    """Turns a prompt and its SamplingParams into the core's Requests; bad input is a ValueError
    naming the field and the limit, raised before anything reaches the engine.

    `tokenizer` is None for an engine built with skip_tokenizer_init: prompts must then be token ids.
    `limits`: the KV cache's (the front end of a core in another process checks them up front; the
    offline engine's scheduler checks them as it adds a request).
    """

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None,
        seed: int,
        limits: RequestLimits | None = None,
        *,
        pooling_task: str | None = None,
        hidden_size: int = 0,
        pooling_type: str = "LAST",
        num_labels: int = 0,
        is_matryoshka: bool = False,
        matryoshka_dimensions: Sequence[int] | None = None,
        mm_processor: MultiModalProcessor | None = None,
        kv_transfer: KVTransferConfig | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        generation_eos_token_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        # The generation config's end-of-sequence ids besides eos_token_id (Llama 3's <|eot_id|> beside
        # <|end_of_text|>): every request stops at them too, unless it ignores EOS (vLLM's).
        self.extra_eos_token_ids = [
            t for t in dict.fromkeys(generation_eos_token_ids) if t != eos_token_id and t < vocab_size
        ]
        # The engine's max_logprobs, resolved against the vocabulary (ModelConfig.max_logprobs_of).
        self.max_logprobs = max_logprobs
        # Disaggregated prefill's role (None: off): which kv_transfer_params a request may carry.
        self.kv_transfer = kv_transfer
        # A vision-language model's processor (engine/engine/mm_processor.py); None: text only.
        self.mm_processor = mm_processor
        # A pooling engine's task (worker/pooler.py; None: a generate engine) and hidden size.
        self.pooling_task = pooling_task
        self.hidden_size = hidden_size
        # The engine's pooling (pooler_config's: a request's STEP settings need STEP) and a classifier's
        # number of labels (0: no head), the width of its head's outputs.
        self.pooling_type = pooling_type
        self.num_labels = num_labels
        # Which `dimensions` the model takes (config.json's Matryoshka facts: check_matryoshka).
        self.is_matryoshka = is_matryoshka
        self.matryoshka_dimensions = None if matryoshka_dimensions is None else tuple(matryoshka_dimensions)
        self.max_model_len = max_model_len
        self.limits = limits
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._seeds = random.Random(seed)

    @classmethod
    def for_engine(
        cls, config: EngineConfig, tokenizer, info, max_model_len: int, limits: RequestLimits | None = None
    ) -> InputProcessor:
        """The processor of an engine of `config` (the offline `LLM`'s and `AsyncLLM`'s): `info` is what
        the started engine reports of its model (vocab_size, eos_token_id, pooling_task, hidden_size,
        id2label, the Matryoshka facts), and the model directory's multimodal processor comes with it."""
        model = config.model
        return cls(
            tokenizer,
            max_model_len,
            info.vocab_size,
            info.eos_token_id,
            model.seed,
            limits,
            pooling_task=info.pooling_task,
            hidden_size=info.hidden_size,
            pooling_type=model.pooling_type,
            num_labels=len(info.id2label),
            is_matryoshka=info.is_matryoshka,
            matryoshka_dimensions=info.matryoshka_dimensions,
            mm_processor=MultiModalProcessor.for_model(
                model.model, tokenizer, model.limit_mm_per_prompt, model.mm_processor_kwargs_dict
            ),
            kv_transfer=config.cache.kv_transfer,
            max_logprobs=model.max_logprobs_of(info.vocab_size),
            generation_eos_token_ids=model.generation_eos_token_ids,
        )

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self._encode(prompt["prompt"])
        raise ValueError(
            f"prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got "
            f"{type(prompt).__name__}"
        )

    def process(
        self, prompt: PromptType, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """(text or None, token ids, images): `tokenize`, or for a prompt with `multi_modal_data`
        ({"prompt": text with one placeholder per image, "multi_modal_data": {"image": image | list}})
        the model's processor: placeholders expanded, images as features (a prompt's
        `mm_processor_kwargs`, vLLM's, the processor's settings for it alone)."""
        kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data")):
            self.check_mm_processor_kwargs(kwargs)
            return (*self.tokenize(prompt), [])
        data = prompt["multi_modal_data"]
        if self.mm_processor is None:
            raise ValueError("multi_modal_data: this model takes text only")
        if not isinstance(data, dict) or not data or set(data) - {"image", "video"}:
            raise ValueError(
                f"multi_modal_data must be {{'image': image or list, 'video': frames or list}}, got keys "
                f"{list(data) if isinstance(data, dict) else type(data).__name__}"
            )
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError("multi_modal_data needs the prompt as text ({'prompt': str}), with placeholders")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        videos = as_videos(data.get("video", []))
        uuids = prompt.get("multi_modal_uuids") or {}
        if not isinstance(uuids, dict) or set(uuids) - set(data):
            raise ValueError(
                "multi_modal_uuids must be {modality: uuid or list} for modalities of multi_modal_data, got "
                f"{list(uuids) if isinstance(uuids, dict) else type(uuids).__name__}"
            )
        uuids = {
            kind: check_uuids(uuids.get(kind), len(items), f"multi_modal_uuids.{kind}")
            for kind, items in (("image", images), ("video", videos))
        }
        ids, features = self.mm_processor.process(
            prompt["prompt"],
            images,
            videos,
            add_special_tokens=add_special_tokens,
            mm_processor_kwargs=kwargs,
            uuids=uuids,
        )
        return prompt["prompt"], ids, features

    def check_mm_processor_kwargs(self, kwargs: dict | None, field: str = "mm_processor_kwargs") -> None:
        """A request's mm_processor_kwargs where no media comes with them, checked as media's would be (a
        MediaError naming the key): a text-only model takes none."""
        if not kwargs:
            return
        if self.mm_processor is None:
            raise MediaError("this model takes text only: it has no multimodal processor", field)
        self.mm_processor.processor_for(kwargs, field)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "prompt is text, but the engine has no tokenizer (skip_tokenizer_init=True): "
                "pass {'prompt_token_ids': [...]}"
            )
        return self.tokenizer.encode(text)

    def truncate(
        self,
        prompt_token_ids: list[int],
        keep: int | None,
        has_images: bool = False,
        num_output_tokens: int = 1,
        *,
        side: str = "left",
    ) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens, or its first with `side`
        "right" (vLLM's truncation_side) (-1: as many as the context holds beside `num_output_tokens`,
        the request's max_tokens; None: the prompt as it is). A `keep`
        past that room, on a prompt that needs cutting to fit, is a ValueError naming the field (vLLM's),
        as is a prompt with images that needs cutting (its placeholders would be)."""
        if keep is None:
            return prompt_token_ids
        room = self.max_model_len - num_output_tokens
        if room < 1:  # no prompt fits beside max_tokens: the length check blames max_tokens
            return prompt_token_ids
        keep = room if keep == -1 else keep
        if keep > room and len(prompt_token_ids) > room:
            raise ValueError(
                f"truncate_prompt_tokens={keep} keeps more of this {len(prompt_token_ids)}-token prompt than "
                f"the context leaves it: max_model_len {self.max_model_len} - {num_output_tokens} tokens for "
                f"the output = {room}; request at most {room}, or -1"
            )
        if len(prompt_token_ids) <= keep:
            return prompt_token_ids
        if has_images:
            raise ValueError(
                "truncate_prompt_tokens: a prompt with images is not cut (its images' placeholders would be)"
            )
        return prompt_token_ids[:keep] if side == "right" else prompt_token_ids[-keep:]

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        check_prompt_length(len(prompt_token_ids), self.max_model_len)
        self._check_token_ids("prompt_token_ids", prompt_token_ids)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """ValueError if the prompt plus max_tokens can never run: past max_model_len, or more KV
        blocks than the cache holds (the scheduler's own rule, core/limits.py)."""
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} for the completion); reduce the prompt or max_tokens"
            )
        if self.limits is not None:
            self.limits.check(num_prompt_tokens, max_tokens)

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logprob counts against the engine's max_logprobs, token
        ids against this model's vocabulary, stop strings and grammars against having a tokenizer, and a
        grammar's compiling (ValueError, or StructuredOutputsError, naming the field)."""
        for name in ("logprobs", "prompt_logprobs"):
            self.check_num_logprobs(getattr(params, name), name)
        if self.tokenizer is None and params.stop:
            raise ValueError(
                f"stop strings {params.stop!r} need a tokenizer to be matched, and the engine has none "
                "(skip_tokenizer_init=True): use stop_token_ids"
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs needs a tokenizer to build its token masks, and the engine has none "
                    "(skip_tokenizer_init=True)"
                )
            check_grammar(params.structured_outputs)
        if params.bad_words and self.tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer, and the engine has none (skip_tokenizer_init=True): use "
                "logit_bias to ban token ids"
            )
        for name in TOKEN_ID_FIELDS:
            value = getattr(params, name, None)
            if value:
                self._check_token_ids(name, _flat_token_ids(value))
        self._check_kv_transfer(params.kv_transfer_params or {})

    def check_num_logprobs(self, num_logprobs: int | None, name: str) -> None:
        """ValueError naming `name` (the caller's field) where `num_logprobs` is past max_logprobs (-1,
        the whole vocabulary, is its size: vLLM's rule)."""
        num = self.resolve_num_logprobs(num_logprobs)
        if num is not None and num > self.max_logprobs:
            asked = f"-1 (the whole vocabulary, {num})" if num_logprobs == -1 else num
            raise ValueError(
                f"{name} must be at most {self.max_logprobs} (the engine's max_logprobs), got {asked}"
            )

    def resolve_num_logprobs(self, num_logprobs: int | None) -> int | None:
        """A logprob count as the engine reads it: vLLM's -1 is every token of the model's vocabulary."""
        return self.vocab_size if num_logprobs == -1 else num_logprobs

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """Each bad word's token ids (vLLM's rule): the word with its leading whitespace stripped, and
        after a space where that makes a new first token and as many tokens (a word at a text's start
        and in its middle tokenize apart), deduplicated and checked against the vocabulary (a request
        with a word of several tokens does not draft under speculative decoding: core/spec_decode.py)."""
        if not params.bad_words:
            return params.bad_words_token_ids
        found: list[list[int]] = list(params.bad_words_token_ids or ())
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            is_new_word = bool(spaced) and spaced[0] != plain[0] and len(spaced) == len(plain)
            for ids in (plain, spaced) if is_new_word else (plain,):
                if ids not in found:
                    found.append(ids)
        self._check_token_ids("bad_words", _flat_token_ids(found))
        return found

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        """The request's stop_token_ids, then the generation config's other EOS ids (not under
        ignore_eos): min_tokens keeps them all out, and one sampled ends the request as a stop token."""
        if params.ignore_eos:
            return params.stop_token_ids
        return params.stop_token_ids + [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]

    def _check_kv_transfer(self, kv_params: dict) -> None:
        """A request asking to prefill for a consumer needs a producer, one naming a producer a consumer."""
        transfer = self.kv_transfer
        for name, role, is_role in (
            ("do_remote_decode", "kv_producer", transfer is not None and transfer.is_producer),
            ("do_remote_prefill", "kv_consumer", transfer is not None and transfer.is_consumer),
        ):
            if kv_params.get(name) and not is_role:
                raise ValueError(
                    f"kv_transfer_params.{name} needs an engine started as a {role} (or kv_both): "
                    f'--kv-transfer-config \'{{"kv_connector": "JaxConnector", "kv_role": "{role}"}}\''
                )

    def _check_token_ids(self, name: str, token_ids) -> None:
        bad = [t for t in token_ids if not (_is_token_id(t) and 0 <= t < self.vocab_size)]
        if bad:
            # The message starts with the field's name: the server reports it as the 400's `param`.
            raise ValueError(
                f"{name} must be token ids in [0, {self.vocab_size}) (the model's vocab_size), got {bad[:4]}"
            )

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> list[Request]:
        """One Request, or n children of parent `request_id` for n > 1 (sharing the prompt's blocks
        through the prefix cache)."""
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        params = dataclasses.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            bad_words_token_ids=self.bad_words_token_ids(params),
            stop_token_ids=self._stop_token_ids(params),
            logprobs=self.resolve_num_logprobs(params.logprobs),
            prompt_logprobs=self.resolve_num_logprobs(params.prompt_logprobs),
        )
        is_parent = params.n > 1
        requests = []
        for i in range(params.n):
            rid = child_request_id(request_id, i) if is_parent else request_id
            seed = params.seed + i if params.seed is not None else self._seeds.getrandbits(32)
            requests.append(
                Request(
                    rid,
                    prompt_token_ids,
                    params,
                    eos_token_id=self.eos_token_id,
                    arrival_time=arrival_time,
                    priority=priority,
                    cache_salt=cache_salt,
                    sampling_seed=seed,
                    parent_id=request_id if is_parent else None,
                    lora_request=lora_request,
                    mm_features=mm_features,
                )
            )
        return requests


def _is_token_id(value) -> bool:
    # bool is an int subclass, but True as a token id is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _flat_token_ids(value) -> list:
    """The token ids a field holds: a dict's keys (str keys from JSON converted), nested lists flattened."""
    if isinstance(value, dict):
        return [int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k for k in value]
    ids = []
    for item in value:
        ids.extend(_flat_token_ids(item) if isinstance(item, (list, tuple)) else [item])
    return ids
