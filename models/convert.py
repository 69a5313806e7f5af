"""`xlaserve convert`: any checkpoint -> our parameter pytree, written with orbax."""

from __future__ import annotations

import logging
import os
import shutil
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlaserve.config.generation import GENERATION_CONFIG_FILE
from xlaserve.kernels import get_attention_backend
from xlaserve.models.loader import load_checkpoint
from xlaserve.models.orbax_checkpoint import save_converted
from xlaserve.models.registry import get_model_class, model_config_from_hf
from xlaserve.models.weights import load_params

logger = logging.getLogger(__name__)


def convert_checkpoint(model: str | None, out_dir: str, dtype: str | None = None) -> str:
    """Load `model` (HF directory, .gguf, converted directory or the embedded alias), map it to the
    parameters of its registered module, cast them to `dtype` (default: the checkpoint's own
    floating dtype) and write them to `out_dir`. Returns the dtype written."""
    t0 = time.perf_counter()
    checkpoint = load_checkpoint(model)
    cfg = model_config_from_hf(checkpoint.hf_config)
    model_class = get_model_class(cfg.architecture)
    dtype = dtype or _stored_dtype(checkpoint.tensors)
    backend = get_attention_backend("reference")  # construction only; nothing runs
    _, state = load_params(
        model_class,
        cfg,
        checkpoint.tensors,
        dtype=jnp.dtype(dtype),
        make_model=lambda: model_class(cfg, backend, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)),
        place=lambda path, array: array,  # stay on the host
    )
    save_converted(
        out_dir,
        checkpoint.hf_config,
        nnx.to_pure_dict(state),
        checkpoint.tokenizer,
        dtype=dtype,
        source=checkpoint.source,
    )
    # The model's recommended sampling (requests' defaults: --generation-config auto) goes along.
    generation_config = os.path.join(model or "", GENERATION_CONFIG_FILE)
    if model is not None and os.path.isdir(model) and os.path.isfile(generation_config):
        shutil.copy(generation_config, out_dir)
    logger.info(
        "converted %s to %s (%s) in %.1fs", checkpoint.source, out_dir, dtype, time.perf_counter() - t0
    )
    return dtype


def _stored_dtype(tensors) -> str:
    """The dtype most of the checkpoint's floating parameters are stored in."""
    sizes: dict[str, int] = {}
    for value in tensors.values():
        name = np.dtype(value.dtype).name
        if name in ("float32", "float16", "bfloat16"):
            sizes[name] = sizes.get(name, 0) + value.size
    return max(sizes, key=sizes.get) if sizes else "float32"
