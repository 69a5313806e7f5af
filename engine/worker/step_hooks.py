"""The features' narrow hooks into a step: what each adds to the step's inputs, and what it reads from
its outputs.

The runner's step (worker/model_runner.py) is one piece of code whatever is on. It asks each hook for
the feature's host arrays of the step (`prepare`, before the batch is built, so a request the feature
fails gets dummy rows), gives the model's forward what the hooks pass it (`forward_inputs`), lets each hook
add device outputs from the forward's hidden states (`after_forward`) or once the step's tokens are
sampled (`after_sampling`), and read its results on the host (`read_output`). A feature that is off
has no hook. Speculative verification needs none: a step is always built for k verified drafts per
request, and without speculation k is 0 (worker/spec_decode.py), so the plain step is its degenerate case.

A hook's host arrays are a flat {field: ndarray} dict, so a multi-host engine sends them with the rest
of the step (`StepInputs.to_bytes`) without knowing the feature.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from xlaserve.worker.draft_model import DraftModel
from xlaserve.worker.lora_manager import LoRAManager
from xlaserve.worker.sampler import SamplingTensors

HostArrays = dict[str, np.ndarray]


class StepHook:
    """A feature's hook; every method's default adds nothing."""

    name = ""
    # Whether `forward_inputs` gives each pipeline stage what its layers need: the pipelined runner
    # (worker/pipeline_runner.py) refuses, by name, a hook that does not.
    runs_on_stages = False

    def prepare(self, scheduled, num_tokens: int, num_seqs: int, failed: set[str]) -> HostArrays:
        """The feature's host arrays for one step; a request whose part fails is added to `failed`."""
        return {}

    def forward_inputs(self, arrays: HostArrays, stage: int = 0) -> dict:
        """Keyword arguments of the model's forward (`arrays`: `prepare`'s, on the device), or of
        pipeline stage `stage`'s `run_layers` (hooks that `runs_on_stages`)."""
        return {}

    def after_forward(
        self, hidden: jax.Array, hidden_rd: jax.Array, arrays: HostArrays
    ) -> dict[str, jax.Array]:
        """Device outputs the feature adds from the forward's final-norm hidden states (hidden [T, D],
        hidden_rd [R, D]: each sequence's last token's); arrays the forward already returns, so no
        program is added (pooling: worker/pooler.py)."""
        return {}

    def read_output(self, scheduled, host: dict[str, np.ndarray], result) -> None:
        """Read the feature's per-request results from the step's host arrays into `result` (a
        ModelRunnerOutput); a request whose part fails is added to `result.failed_req_ids`."""

    def verify_inputs(self, arrays: HostArrays) -> tuple | None:
        """A proposer's q for the verifier ((q_buf [S, K, V], rows [R])), or None."""
        return None

    def after_sampling(
        self, batch, hidden, token_ids: jax.Array, num_accepted: jax.Array | None, st: SamplingTensors, arrays
    ) -> dict[str, jax.Array]:
        """Device outputs the feature adds to the step's, from its batch (on the device), the forward's
        final-norm hidden states [T, D] (or, where a hook's `forward_inputs` asked for them, the aux hidden
        states [T, n * D]: EAGLE-3's) and its sampled ids; `num_accepted`: the verifier's, or None in a
        step without drafts."""
        return {}

    def warm_up(self, batches: dict, num_seqs_for) -> list:
        """Before the compile guard arms: load or run what the feature needs; returns programs still to
        load or compile, as (a Program, its arguments), one per token bucket at most."""
        return []


class LoRAHook(StepHook):
    """Each token's adapter slot; the forward binds the slots to the projections (models/lora.py)."""

    name = "lora"
    runs_on_stages = True  # each stage gets the slots of its own layers (worker/lora_manager.py)

    def __init__(self, manager: LoRAManager):
        self.manager = manager

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> HostArrays:
        return {"slot_ids": self.manager.step_slot_ids(scheduled, num_tokens, failed)}

    def forward_inputs(self, arrays, stage=0) -> dict:
        return {"lora": self.manager.batch(arrays["slot_ids"], stage)}

    def warm_up(self, batches, num_seqs_for) -> list:
        self.manager.warm_up()
        return []


class DraftModelHook(StepHook):
    """A draft model proposes the next step's drafts on the device after the step's tokens are known,
    and hands the verifier the q its drafts were drawn from (worker/draft_model.py)."""

    name = "draft"

    def __init__(self, drafter: DraftModel):
        self.drafter = drafter

    def prepare(self, scheduled, num_tokens, num_seqs, failed) -> HostArrays:
        if not scheduled:  # warm-up, HLO inspection: a padding-only step must not forget the q rows
            return dataclasses.asdict(self.drafter.empty_inputs(num_tokens, num_seqs))
        return dataclasses.asdict(self.drafter.prepare(scheduled, num_tokens, num_seqs, failed))

    def forward_inputs(self, arrays, stage=0) -> dict:
        return self.drafter.forward_inputs()

    def verify_inputs(self, arrays) -> tuple:
        return self.drafter.verify_args(arrays["prob_rows"])

    def after_sampling(self, batch, hidden, token_ids, num_accepted, st, arrays) -> dict[str, jax.Array]:
        inputs = self.drafter.inputs_class(**arrays)
        return {"draft_ids": self.drafter.step(batch, hidden, token_ids, num_accepted, st, inputs)}

    def warm_up(self, batches, num_seqs_for) -> list:
        return [self.drafter.warm_up_step(batch, num_seqs_for(n)) for n, batch in batches.items()]
