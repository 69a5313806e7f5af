"""Incremental detokenization and stop-string matching for one request.

Decoding the whole output at every step costs O(n) per token. Decoding a single new token is
wrong twice over: byte-level BPE splits one character over several tokens (each alone decodes to
"\\ufffd"), and SentencePiece-style decoders drop the leading space of the first token they see.
So, like vLLM, we decode a small window: `prefix_offset` marks text already emitted and kept only
as context, `read_offset` the end of what was emitted. Each step decodes ids[prefix:read] and
ids[prefix:]; the new text is the difference, emitted only when it does not end in "\\ufffd"
(an incomplete character that a later token will finish). The window is a few tokens long, so a
step costs O(1).

An engine without a tokenizer (skip_tokenizer_init) gets `NoTextDetokenizer`: token ids, no text.
"""

from __future__ import annotations

from xlaserve.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first output token (vLLM uses 5 as well).
_NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _added_tokens(tokenizer) -> dict[int, str]:
    """The tokenizer's added tokens (special or not), id -> text."""
    return {
        token_id: added.content for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
    }


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `skip_special_tokens=True` drops: the tokenizer's special and special added tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive, and watches for stop strings.

    `output_text` is the text so far (cut at a matched stop string); `token_ids` every output id,
    including ids that produce no text (special tokens, a stop token).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        special_ids: frozenset[int] | None = None,
    ):
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes without transformers' per-call Python work (the
        # same text: transformers adds only the clean-up, which `_decode` turns off anyway).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        # Computing the special ids walks the added vocabulary; the output processor passes them in.
        self._skipped_ids = (
            (special_token_ids(tokenizer) if special_ids is None else special_ids)
            if self.skip_special_tokens
            else frozenset()
        )
        # spaces_between_special_tokens=False (vLLM's): an added token's text when it follows another.
        self._joined_added_tokens = (
            None
            if params.skip_special_tokens or params.spaces_between_special_tokens
            else _added_tokens(tokenizer)
        )
        self._is_last_added = False
        self.stop = [params.stop] if isinstance(params.stop, str) else [s for s in params.stop or [] if s]
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # While streaming, hold back enough characters that a stop string completed by a later
        # token is never partly sent; with include_stop_str_in_output the stop string is output
        # anyway, so nothing needs holding back.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )

        self.token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        self._is_stopped = False
        self._match_end: int | None = None
        # Ids of the last update dropped because they came after the token that completed a stop
        # string (several ids arrive at once under speculative decoding).
        self.num_dropped_tokens = 0
        # The ids being decoded: a clean tail of the prompt as context, then the output ids that
        # produce text. Offsets index this list.
        self._ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        tail = [t for t in prompt_token_ids[-4 * _NUM_PROMPT_CONTEXT_TOKENS :] if t not in self._skipped_ids]
        context = tail[-_NUM_PROMPT_CONTEXT_TOKENS:]
        # A context that decodes to a replacement character (it starts or ends inside a multi-byte
        # character) would not be a stable prefix of the window's text; shrink it until it is.
        while context and _REPLACEMENT_CHAR in self._decode(context):
            context = context[1:]
        return context

    def _decode(self, ids: list[int]) -> str:
        # Special ids were already filtered out when skip_special_tokens is on. No clean-up: it
        # rewrites " ." to "." across window edges, so windowed text would not concatenate.
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _decode_window(self, flush: bool) -> str:
        """Text added by the ids past `read_offset`; with `flush`, even an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT_CHAR) and not flush):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode_next(self, token_id: int) -> str:
        """The text `token_id` adds (none yet if it leaves a character incomplete)."""
        added = self._joined_added_tokens
        is_joined = added is not None and token_id in added and self._is_last_added
        self._is_last_added = added is not None and token_id in added
        if not is_joined:
            self._ids.append(token_id)
            return self._decode_window(flush=False)
        # Nothing is pending: the window was emitted up to the added token before this one. This one
        # stays as the next token's context, so a decoder's space before that token is kept.
        self._ids.append(token_id)
        self._prefix_offset, self._read_offset = len(self._ids) - 1, len(self._ids)
        return added[token_id]

    def update(
        self, new_token_ids: list[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Detokenize `new_token_ids` and check stop strings in the text they added.

        stop_terminated: the last id is a stop token (EOS or stop_token_ids) that ended the request;
            its text is left out unless include_stop_str_in_output.
        finished: the request ends with this update, so bytes held back as an incomplete character
            are emitted (as "\\ufffd", matching `tokenizer.decode` of all ids).
        Returns the matched stop string (the text is then cut at it) or None.
        """
        if self._is_stopped:
            return None
        self.token_ids.extend(new_token_ids)
        ids_to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            ids_to_decode = new_token_ids[:-1]
        # Stop strings count only once min_tokens are out (vLLM): text before that is not searched.
        num_tokens_before = len(self.token_ids) - len(new_token_ids)
        stop_check_offset = len(self.output_text)
        text_ends = []  # the text's length after each new id
        for i, token_id in enumerate(ids_to_decode):
            if token_id not in self._skipped_ids:
                self.output_text += self._decode_next(token_id)
            if num_tokens_before + i + 1 <= self.min_tokens:
                stop_check_offset = len(self.output_text)
            text_ends.append(len(self.output_text))
        if finished:
            self.output_text += self._decode_window(flush=True)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match_end = len(self.output_text)
        stop = self._check_stop_strings(len(self.output_text) - stop_check_offset)
        if stop is not None and self._match_end is not None:
            match_end = self._match_end
            # Ids after the one that completed the stop string are not output (one step may carry
            # several: accepted speculative drafts).
            num_kept = next((i + 1 for i, end in enumerate(text_ends) if end >= match_end), len(text_ends))
            self.num_dropped_tokens = len(new_token_ids) - num_kept
            if self.num_dropped_tokens:
                del self.token_ids[-self.num_dropped_tokens :]
        return stop

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        if num_new_chars <= 0:
            return None
        text = self.output_text
        match_index, match = -1, None
        for stop in self.stop:
            # Earlier text was already searched: only a match that ends in the new characters is new.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (match is None or index < match_index):
                match_index, match = index, stop
        if match is None:
            return None
        end = match_index + len(match) if self.include_stop_str_in_output else match_index
        self._match_end = match_index + len(match)
        self.output_text = text[:end]
        self._is_stopped = True
        return match

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it, or only what is new since the last call (`delta`).

        Until `finished`, the last `stop_buffer_length` characters are held back, since they could
        be the start of a stop string that a later token completes.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last_offset = self._last_output_text_offset
        if length <= last_offset:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last_offset:length]


class NoTextDetokenizer:
    """The detokenizer of an engine without a tokenizer (skip_tokenizer_init, as vLLM's base
    IncrementalDetokenizer): it keeps the output ids and produces no text, so no stop string can
    match (the input processor refuses them)."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.output_text = ""

    def update(
        self, new_token_ids: list[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""


def make_detokenizer(
    tokenizer,
    prompt_token_ids: list[int],
    params: SamplingParams,
    special_ids: frozenset[int] | None = None,
) -> IncrementalDetokenizer | NoTextDetokenizer:
    """An `IncrementalDetokenizer`, or a `NoTextDetokenizer` when `tokenizer` is None or the request
    asks for no text (`params.detokenize` false)."""
    if tokenizer is None or not params.detokenize:
        return NoTextDetokenizer()
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params, special_ids)
