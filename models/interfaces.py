"""What a model class provides to the engine and the loader: the `CausalLM` protocol.

The registry maps a Hugging Face `architectures` entry to a class of this shape; the model runner,
the weight loader and `xlaserve convert` call these members directly. `DecoderOnlyLM`
(models/decoder.py) implements every one of them with Llama's defaults, so a family overrides only
what makes it different: its `config_class` (how it reads config.json), its decoder layer, and,
when the checkpoint or the cache differ from Llama's, `prepare_hf_tensors`, `layer_stacks` or
`kv_cache_spec`.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import jax
import numpy as np
from flax import nnx

from xlaserve.kernels import AttentionBackend, AttentionMetadata, KVCacheSpec
from xlaserve.models.config import TransformerConfig


class CausalLM(Protocol):
    """A decoder-only language model over the paged KV cache (the class, with its hooks)."""

    # The family's config dataclass; `config_class.from_hf(hf_config)` reads config.json for it.
    config_class: ClassVar[type[TransformerConfig]]
    # Why the family cannot be split over tensor-parallel ranks yet (None: it can; its parameters'
    # rules are in sharding/rules.py). The loader refuses tensor_parallel_size > 1 with this reason.
    tensor_parallel_unsupported: ClassVar[str | None]
    # The top-level modules of a vision-language model's encoder (its tower and projector): on pipeline
    # stages only the first, which encodes the images, holds them (worker/pipeline_stage.py).
    encoder_modules: ClassVar[tuple[str, ...]]

    def __init__(
        self, cfg: TransformerConfig, backend: AttentionBackend, *, dtype, rngs: nnx.Rngs
    ) -> None: ...

    @classmethod
    def kv_cache_spec(cls, cfg: TransformerConfig) -> KVCacheSpec:
        """The paged cache the runner allocates: K and V per layer, or MLA's one latent cache."""
        ...

    @classmethod
    def layer_stacks(cls, cfg: TransformerConfig) -> dict[str, range]:
        """Our stacked layer modules -> the Hugging Face layer indices each holds, in forward order."""
        ...

    @classmethod
    def prepare_hf_tensors(
        cls, cfg: TransformerConfig, tensors: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The checkpoint's tensors rewritten into the names and layout our modules map one to one
        (MoE: one tensor per expert -> one [num_experts, out, in] stack)."""
        ...

    def __call__(
        self,
        input_ids: jax.Array,  # [T]
        positions: jax.Array,  # [T]
        kv_cache,  # the cache_class of kv_cache_spec(cfg), donated
        md: AttentionMetadata,
    ) -> tuple[jax.Array, object]:  # hidden [T, D], the updated cache
        ...

    def compute_logits(self, hidden: jax.Array, head_dv: jax.Array | None = None) -> jax.Array:
        """[N, D] -> [N, V] float32; `head_dv` replaces the LM head's weight, as [D, V]."""
        ...


# The members a model class must have; the registry checks them when a family is registered.
CAUSAL_LM_MEMBERS = (
    "config_class",
    "kv_cache_spec",
    "layer_stacks",
    "prepare_hf_tensors",
    "__call__",
    "compute_logits",
)
