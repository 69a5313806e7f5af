"""Hugging Face safetensors checkpoints (single file or sharded) -> numpy, without torch.

`safe_open(framework="np")` cannot build bfloat16 or float8 arrays (numpy has no such dtypes), so
those tensors are read from the file directly at the offsets its JSON header gives, as ml_dtypes
arrays (ml_dtypes ships with jax).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype -> ml_dtypes attribute, for dtypes numpy lacks.
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files of `model_dir`: the index's shards, model.safetensors, or every *.safetensors."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    if os.path.isfile(os.path.join(model_dir, SINGLE_FILE)):
        return [os.path.join(model_dir, SINGLE_FILE)]
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """(header, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return header, 8 + header_len


def _read_raw(path: str, entry: dict[str, Any], data_start: int) -> np.ndarray:
    import ml_dtypes

    dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[entry["dtype"]]))
    begin, end = entry["data_offsets"]
    raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
    return raw.view(dtype).reshape(entry["shape"])


def load_safetensors(model_dir: str, *, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in `model_dir`, under its stored name, in its stored dtype."""
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir!r} has no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    tensors: dict[str, np.ndarray] = {}
    with tqdm(desc="Reading safetensors", unit="tensor", disable=not progress) as bar:
        for path in files:
            header: dict[str, Any] | None = None
            with safe_open(path, framework="np") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                for key in keys:
                    if f.get_slice(key).get_dtype() in _ML_DTYPES:
                        if header is None:
                            header, data_start = _read_header(path)
                        tensors[key] = _read_raw(path, header[key], data_start)
                    else:
                        tensors[key] = f.get_tensor(key)
                    bar.update()
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            missing = set(json.load(f)["weight_map"]) - set(tensors)
        if missing:
            raise ValueError(
                f"{model_dir!r}: tensors listed in {INDEX_FILE} are missing: {sorted(missing)[:5]}"
            )
    return tensors
