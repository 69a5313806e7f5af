"""Loading and placement: a checkpoint's tensors become the model's parameters on the mesh.

Everything the step needs to know about the model is decided here once: the dtype, the family's
config, the mesh and how each weight is sharded over it, the paged cache the model needs, and the
attention backend (run per device over the KV-head shards under tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from xlaserve.config import EngineConfig
from xlaserve.kernels import AttentionBackend, KVCacheSpec, MLACache, cpu_dot, cpu_ops, get_attention_backend
from xlaserve.kernels.dtype_ops import is_16bit_float, stacks_as_words
from xlaserve.models.config import TransformerConfig
from xlaserve.models.layers import Linear
from xlaserve.models.loader import DummyWeights
from xlaserve.models.prequantized import quantization_scheme
from xlaserve.models.quantization import weight_bytes
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.models.weights import load_params
from xlaserve.sharding import Placement, make_mesh
from xlaserve.sharding.attention import shard_attention_over_kv_heads
from xlaserve.sharding.context_parallel import (
    check_decode_context_parallel,
    check_prefill_context_parallel,
    decode_context_parallel,
    decode_context_parallel_cache_spec,
    prefill_context_parallel,
)
from xlaserve.sharding.layout import lay_out_for_mesh
from xlaserve.worker.kv_cache_groups import num_state_copy_slots
from xlaserve.worker.pipeline_stage import StageLayout, slice_to_stage, split_layers, stage_place

logger = logging.getLogger(__name__)


def cpu_has_native_bfloat16() -> bool:
    """AVX512-BF16 or AMX: XLA's CPU dots run bfloat16 natively (faster than float32 there)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str) -> tuple[jnp.dtype, str]:
    """The dtype the model computes in, and why: `auto` is bfloat16 wherever the device computes it
    natively (GPUs; CPUs with AVX512-BF16 or AMX), float32 elsewhere."""
    if name != "auto":
        return jnp.dtype(name), f"dtype={name}"
    platform = jax.default_backend()
    if platform != "cpu":
        return jnp.dtype(jnp.bfloat16), f"auto on {platform}: bfloat16"
    if cpu_has_native_bfloat16():
        return jnp.dtype(
            jnp.bfloat16
        ), "auto on a CPU with native bfloat16 dots (AVX512-BF16 or AMX): bfloat16"
    return jnp.dtype(jnp.float32), "auto on a CPU without native bfloat16 dots: float32"


@dataclass
class LoadedModel:
    """A model placed on its devices, and what was decided to get it there."""

    model_config: TransformerConfig  # the family's config class (MoE, MLA fields); KV heads replicated
    padded_vocab_size: int  # rows of the embedding and LM head (sharding/vocab.py); >= vocab_size
    dtype: jnp.dtype
    mesh: Mesh
    placement: Placement
    kv_spec: KVCacheSpec  # K and V per layer, or MLA's one latent cache
    backend: AttentionBackend
    graphdef: nnx.GraphDef
    params: nnx.State
    head_dv: jax.Array | None = None  # the tied LM head as [D, V], on CPU in 16 bits (see load_model)
    weight_bytes: int = 0  # params and head_dv on the devices (all shards of a sharded one)
    # The checkpoint's KV heads (MLA: its one latent), which the cache may hold copies of: a block leaves
    # the device with each once (worker/kv_offload.BlockLayout). 0: as many as the cache holds.
    kv_heads: int = 0
    stage: StageLayout | None = None  # what the weights were placed by (None: every module)


def _transposes_tied_head(dtype, float32_invariant: bool) -> bool:
    """Whether a tied LM head gets a [D, V] copy on CPU: 16-bit (below), and float32 with its batch
    invariance asked for (`batch_invariant_float32`), whose dots of many rows run in row tiles
    (kernels/dtype_ops.py: `by_row_tiles`): a loop that would read a transposed head as a copy made at
    every step, rounded as a plain [D, V] dot and not as the transposed read of a decode step's few
    rows."""
    return is_16bit_float(dtype) or (jnp.dtype(dtype) == jnp.float32 and float32_invariant)


def load_model(
    config: EngineConfig,
    hf_config: dict,
    tensors: dict[str, np.ndarray],
    devices=None,
    stage: StageLayout | None = None,
) -> LoadedModel:
    """Build the model of `hf_config` from `tensors` and place its parameters on `devices`. `stage`: a
    pipeline stage's layers (worker/pipeline_stage.py): only its weights are placed, and its KV cache
    spec counts only its layers. A vision-language model in text-only mode without stages loads as one
    stage of every layer that holds no encoder module (placeholders for the tower and projector)."""
    dtype, why = resolve_dtype(config.model.dtype)
    logger.info("computing in %s (%s)", dtype.name, why)
    parallel = config.parallel
    tp = parallel.tensor_parallel_size
    model_config = model_config_from_hf(hf_config)
    model_class = get_model_class(model_config.architecture)
    if stage is None and getattr(model_class, "encoder_modules", ()) and config.model.text_only_mode:
        stage = split_layers(model_config.num_layers, 1, model_class.encoder_modules, text_only=True)[0]
    if tp > 1 and model_class.tensor_parallel_unsupported:
        raise ValueError(
            f"tensor_parallel_size={tp}: {model_config.architecture} cannot be split over tensor-parallel "
            f"ranks yet ({model_class.tensor_parallel_unsupported}); use tensor_parallel_size=1 "
            "(data_parallel_size runs copies side by side)"
        )
    mesh = make_mesh(tp, devices, parallel.prefill_context_parallel_size)
    stacked = tuple(model_class.layer_stacks(model_config))
    placement = Placement(mesh, model_config, parallel.enable_expert_parallel, stacked_modules=stacked)
    checkpoint_config = model_config  # its KV heads as the checkpoint has them
    # KV heads repeated, Mamba2's B and C groups copied, the vocabulary padded (sharding/layout.py). The
    # model is built with the padded vocabulary; model_config keeps the real one (the input processor's
    # bound on token ids, the sampler's bound on what it may return).
    model_config, tensors, padded_vocab = lay_out_for_mesh(model_config, tensors, tp)
    model_shape = model_config.replace(vocab_size=padded_vocab)
    kv_spec = model_class.kv_cache_spec(model_config)  # K and V, or MLA's one latent cache
    if stage is not None:  # the stage's layers' K/V (a hybrid model's: and state rows) only
        if kv_spec.layer_kind == "hybrid":
            kv_spec = kv_spec.for_layers(stage.layers)
        else:
            kv_spec = dataclasses.replace(kv_spec, num_layers=len(stage.layers))
    # A hybrid model's state slots: one per request that can run, and as many for copies of states
    # (prefix-cache snapshots, drafts' backups: core/kv_cache_coordinator.py StateGroupBlocks).
    kv_spec = kv_spec.with_max_num_seqs(config.scheduler.max_num_seqs, num_state_copy_slots(config))
    backend = get_attention_backend(config.compilation.attention_backend, mla=kv_spec.cache_class is MLACache)
    if config.cache.kv_cache_dtype != "auto":
        if kv_spec.cache_class is MLACache:
            raise ValueError(
                f"kv_cache_dtype={config.cache.kv_cache_dtype!r} is not supported for latent attention "
                f"({model_config.architecture}); use kv_cache_dtype='auto'"
            )
        backend = backend.with_kv_cache_dtype(config.cache.kv_cache_dtype)
        logger.info("KV cache stored in %s (scale 1.0)", backend.kv_cache_dtype.name)
    dcp, pcp = parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
    if dcp > 1:  # K/V interleaved over the ranks that hold copies of a KV head (with PCP: tokens split too)
        check_decode_context_parallel(checkpoint_config, kv_spec, dcp, tp)
        check_prefill_context_parallel(model_config, kv_spec, pcp)
        kv_spec = decode_context_parallel_cache_spec(kv_spec, tp)  # MLA: a latent head per rank
        backend = decode_context_parallel(backend, mesh, dcp)
    elif pcp > 1:  # each group of devices computes its share of a step's tokens
        check_prefill_context_parallel(model_config, kv_spec, pcp)
        backend = prefill_context_parallel(backend, mesh)
    else:
        backend = shard_attention_over_kv_heads(backend, mesh)
    logger.info("attention backend: %s (%s)", backend.name, backend.reason)
    if jax.default_backend() == "cpu":  # the C++ ops the programs will call, built while the weights load
        cpu_ops.prepare_in_background(
            *([cpu_ops.TARGET] if backend.cache_words and dtype == jnp.bfloat16 else []),
            *([cpu_ops.QUANTIZED_TARGET] if config.model.quantization else []),
            # the dot the projections are packed for (kernels/cpu_dot.py `usable`)
            *([cpu_ops.BF16_MATMUL_TARGET] if dtype == jnp.bfloat16 and mesh.devices.size == 1 else []),
        )
    if padded_vocab != model_config.vocab_size:
        logger.info(
            "vocabulary padded from %d to %d to split over %d devices (padding ids are never sampled)",
            model_config.vocab_size,
            padded_vocab,
            tp,
        )
    scheme, tensors = quantization_scheme(config.model.quantization, hf_config, tensors)
    if scheme is not None:
        logger.info("weights kept quantized on the device: %s", scheme.describe())
    t0 = time.perf_counter()
    place = placement.place_param
    if stage is not None:
        stacks = model_class.layer_stacks(model_config)
        stage_args = (stage, stacks, model_config.tie_word_embeddings, placement.replicated)
        place = stage_place(place, *stage_args)
    graphdef, params = load_params(
        model_class,
        model_shape,
        tensors,
        dtype=dtype,
        make_model=lambda: model_class(model_shape, backend, dtype=dtype, rngs=nnx.Rngs(0)),
        place=place,
        sharding=placement.param_sharding,
        quantization=scheme,
    )
    if stage is not None and isinstance(tensors, DummyWeights):  # drawn whole: cut to the stage
        params = slice_to_stage(params, *stage_args)
    logger.info(
        "placed %s weights in %.2fs: %.1f MiB",
        model_class.__name__,
        time.perf_counter() - t0,
        weight_bytes(params) / 2**20,
    )
    head_dv = None
    is_cpu = jax.default_backend() == "cpu"
    if is_cpu and _transposes_tied_head(dtype, config.model.batch_invariant_float32):
        # XLA's CPU backend runs a 16-bit dot natively only with its weight as [in, out]: the tied
        # head (the embedding, [V, D]) would be converted to float32 whole at every step. One
        # transposed copy, made once, costs the table's memory again (kernels/dtype_ops.py).
        # A quantized table is already stored [D, V] (models/layers.py: Embedding): no copy.
        embedding = nnx.merge(graphdef, params).embed_tokens
        is_head = stage is None or stage.is_last  # a pipeline's other stages hold no head
        if model_config.tie_word_embeddings and tp == 1 and embedding.kernel_scale is None and is_head:
            head_dv = jax.jit(lambda table: table.T)(embedding.weight[...])
    if is_cpu and is_16bit_float(dtype):
        params = stacks_as_words(params, tuple(model_class.layer_stacks(model_config)))
        # Batch-invariant by construction, and the fastest dot here at any M: with invariance off too.
        if cpu_dot.usable(dtype, mesh.devices.size):
            graphdef, params = pack_projections(graphdef, params, stacked)
            head_dv = None if head_dv is None else cpu_dot.PackedWeight.pack(head_dv)
    num_weight_bytes = weight_bytes(params) + (0 if head_dv is None else weight_bytes(head_dv))
    return LoadedModel(
        model_config,
        padded_vocab,
        dtype,
        mesh,
        placement,
        kv_spec,
        backend,
        graphdef,
        params,
        head_dv,
        num_weight_bytes,
        1 if kv_spec.cache_class is MLACache else checkpoint_config.num_kv_heads,
        stage,
    )


def pack_projections(graphdef, params, stacks: tuple[str, ...]):
    """(graphdef, params) with the bfloat16 kernels of the stacks' `Linear`s and of an untied LM head
    packed for the CPU's batch-invariant dot (kernels/cpu_dot.py), read in place by the layer scan.
    Quantized kernels keep their own paths."""
    model = nnx.merge(graphdef, params)
    num_packed = 0
    for path, module in list(nnx.iter_graph(model)):
        if (
            not isinstance(module, Linear)
            or module.kernel_scale is not None
            or module.quant_dtype is not None
        ):
            continue
        kernel = module.kernel[...]
        in_stack = bool(path) and path[0] in stacks and kernel.ndim == 3
        is_head = tuple(path) == ("lm_head",) and kernel.ndim == 2
        if kernel.dtype in (jnp.uint16, jnp.bfloat16) and (in_stack or is_head):
            module.kernel = nnx.Param(jax.block_until_ready(cpu_dot.PackedWeight.pack(kernel)))
            kernel.delete()  # held only by the caller's old params: one weight's copy live at a time
            num_packed += 1
    logger.info("%d projections packed for the CPU's batch-invariant dot (kernels/cpu_dot.py)", num_packed)
    return nnx.split(model)
