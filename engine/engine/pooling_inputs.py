"""Input processing for a pooling engine (runner="pooling"): a pooling request's parameters checked
against what the model serves, and its Request. InputProcessor's (engine/engine/processor.py) part for
pooling: it holds the model facts these read (pooling_task, hidden_size, pooling_type, num_labels, the
Matryoshka facts) and validate_prompt."""

from __future__ import annotations

from xlaserve.core.request import Request
from xlaserve.pooling_params import TASKS_OF_MODEL, PoolingParams, check_matryoshka, output_width
from xlaserve.sampling_params import SamplingParams


class PoolingInputs:
    """InputProcessor's pooling methods (module doc)."""

    def validate_pooling(self, params: PoolingParams) -> None:
        """ValueError naming the field unless this engine serves `params.task` (and its dimensions)."""
        supported = TASKS_OF_MODEL.get(self.pooling_task, ())
        if self.pooling_task is None:
            raise ValueError(
                f"pooling_task {params.task!r} needs a pooling model: this engine runs runner='generate' "
                "(start it with runner='pooling')"
            )
        if params.task not in supported:
            raise ValueError(
                f"pooling_task {params.task!r} is not served by this {self.pooling_task} model; it serves "
                f"{list(supported)}"
            )
        if params.dimensions is not None:
            check_matryoshka(params.dimensions, self.is_matryoshka, self.matryoshka_dimensions)
            if params.dimensions > self.hidden_size:
                raise ValueError(
                    f"dimensions must be <= {self.hidden_size} (the model's hidden size), "
                    f"got {params.dimensions}"
                )
        for name in ("step_tag_id", "returned_token_ids"):
            if getattr(params, name) is not None and self.pooling_type != "STEP":
                raise ValueError(
                    f"{name} needs an engine started with pooling_type 'STEP' (pooler_config); this one "
                    f"pools {self.pooling_type}"
                )
        if params.returned_token_ids is not None:
            width = output_width(params.task, self.num_labels, self.hidden_size)
            if max(params.returned_token_ids) >= width:
                raise ValueError(
                    f"returned_token_ids must be < {width} (the width of this {params.task} output), "
                    f"got {list(params.returned_token_ids)}"
                )

    def make_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """A pooling request: the prompt is computed (in chunks when long) and pooled, never decoded.
        Its one-token sampling budget is never used; it keeps the admission rule the same. A
        `cache_salt` shares cached blocks only with requests of the same salt, as a generation's."""
        self.validate_prompt(prompt_token_ids)
        self.validate_pooling(params)
        return Request(
            request_id,
            prompt_token_ids,
            SamplingParams(max_tokens=1, temperature=0.0),
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=params,
        )
