"""Converted checkpoints: our parameter pytree written with orbax, so loading skips the conversion.

`xlaserve convert MODEL OUT_DIR` loads MODEL in any format, maps it to our modules' parameters
(transposed to [in, out], layers stacked, cast to one dtype) and writes

    OUT_DIR/params/               the parameter pytree (orbax PyTree checkpoint, OCDBT, uncompressed)
    OUT_DIR/config.json           the Hugging Face config, completed (see loader.complete_config)
    OUT_DIR/tokenizer*.json ...   the tokenizer, chat template included
    OUT_DIR/xlaserve_orbax.json   this marker: format version, dtype, source

Loading reads the arrays back as they will be placed: no per-tensor transpose, stack or
dequantization. They are stored uncompressed: zstd saves a third of the disk but more than doubles
the restore time. orbax is imported only on these paths (it takes ~1.5 s to import).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from xlaserve.models.model_path import MARKER_FILE, is_orbax_checkpoint  # noqa: F401 (moved there)

PARAMS_DIR = "params"
FORMAT_VERSION = 2  # 2: Phi-3's fused qkv_proj and gate_up_proj regrouped by head (models/phi3.py)


class ConvertedParams(dict):
    """Our parameter paths (("layers", "self_attn", "q_proj", "kernel"), ...) -> arrays already in
    our layout, as `load_params` expects them; what an orbax checkpoint holds instead of HF tensors."""


def flatten_tree(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """A nested dict of parameters (nnx's pure dict, orbax's restored tree) -> {path tuple: leaf}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten_tree(value, (*prefix, str(key))))
        else:
            flat[(*prefix, str(key))] = value
    return flat


def save_converted(
    out_dir: str, hf_config: dict[str, Any], params: dict, tokenizer, *, dtype: str, source: str
) -> None:
    """Write `params` (our pure-dict pytree of host arrays) with config, tokenizer and marker."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    params_dir = os.path.join(out_dir, PARAMS_DIR)
    if os.path.exists(params_dir):
        raise ValueError(
            f"{out_dir!r} already holds a converted checkpoint ({PARAMS_DIR}/); choose an empty directory"
        )
    os.makedirs(out_dir, exist_ok=True)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as checkpointer:
        checkpointer.save(params_dir, args=ocp.args.PyTreeSave(params))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, default=_json_default)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, MARKER_FILE), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "dtype": dtype, "source": source}, f, indent=2)


def _json_default(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"config value {value!r} is not JSON serializable")


def load_converted(path: str) -> tuple[dict[str, Any], ConvertedParams, dict[str, Any]]:
    """(hf_config, params, marker) of a directory written by `save_converted`."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    with open(os.path.join(path, MARKER_FILE)) as f:
        marker = json.load(f)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path!r} is a converted checkpoint of format version {marker.get('format_version')!r}; "
            f"this xlaserve reads version {FORMAT_VERSION}: convert the model again"
        )
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        tree = checkpointer.restore(os.path.join(path, PARAMS_DIR))  # numpy arrays, on the host
    return hf_config, ConvertedParams(flatten_tree(tree)), marker
