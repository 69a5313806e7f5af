"""Hugging Face safetensors checkpoints (single file or sharded) -> numpy, without torch, read lazily.

`load_safetensors` reads only each file's JSON header: every tensor is a `CheckpointTensor`, which
reads its bytes from the file (a fresh array, `np.fromfile` at the offsets the header gives) each time
it is used as an array. So a start holds one tensor's host copy at a time, dropped once placed, not the
whole checkpoint, and a tensor nobody places (a vision tower in text-only mode) is never read. Nothing
maps the file: a checkpoint rewritten in place after a load (a trainer saving into the same directory
before `update_weights_from_path`) cannot fault a running engine, which holds only copies.
bfloat16 and float8 come out as ml_dtypes arrays (numpy has no such dtypes; ml_dtypes ships with jax).
"""

from __future__ import annotations

import json
import math
import os
import struct
from copy import copy as shallow_copy
from typing import Any

import numpy as np
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype -> numpy dtype name (the 16- and 8-bit floats from ml_dtypes).
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
# ndarray attributes a `CheckpointTensor` answers by reading itself (`.reshape`, `.T`, `.view`, ...);
# any other name is an AttributeError without a read (`hasattr(t, "q")` asks for a quantized table).
_ARRAY_ATTRIBUTES = frozenset(a for a in dir(np.ndarray) if not a.startswith("_"))


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


class CheckpointTensor(np.lib.mixins.NDArrayOperatorsMixin):
    """One tensor of a safetensors file, read from the file, as a new array, whenever it is used as one
    (`np.asarray`, an operator, a ufunc, indexing, an ndarray method). Its shape and dtype come from the
    header; `astype` is lazy too (the load's dtype cast). It holds a path and offsets, never the bytes
    nor a mapping, so keeping one costs nothing and reads the file as it is then."""

    __slots__ = ("path", "offset", "shape", "stored_dtype", "dtype")

    def __init__(self, path: str, offset: int, shape, stored_dtype: np.dtype, dtype: np.dtype | None = None):
        self.path, self.offset, self.shape = path, offset, tuple(shape)
        self.stored_dtype = stored_dtype
        self.dtype = stored_dtype if dtype is None else dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.stored_dtype.itemsize

    def read(self) -> np.ndarray:
        """The tensor's bytes, read now into a new array of its shape (and its `astype` dtype)."""
        raw = np.fromfile(self.path, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        if raw.size != self.nbytes:
            raise ValueError(
                f"{self.path}: a tensor's data ends past the end of the file (the file changed since "
                "its header was read)"
            )
        array = raw.view(self.stored_dtype).reshape(self.shape)
        return array if self.dtype == self.stored_dtype else array.astype(self.dtype)

    def astype(self, dtype, copy: bool = True) -> CheckpointTensor:
        cast = shallow_copy(self)  # of its class: a GGUF tensor (models/gguf_loader.py) stays one
        cast.dtype = np.dtype(dtype)
        return cast

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(x.read() if isinstance(x, CheckpointTensor) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, index) -> np.ndarray:
        return self.read()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name: str):
        if name not in _ARRAY_ATTRIBUTES:
            raise AttributeError(name)
        return getattr(self.read(), name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, shape={self.shape}, dtype={self.dtype})"

    def derived(self, compute, shape) -> DerivedTensor:
        """`compute(this tensor's array)`, of `shape` and this dtype, computed when used, not now: how the
        sharding layer pads the vocabulary and repeats KV heads without reading the checkpoint first."""
        return DerivedTensor(lambda: compute(self.read()), shape, self.dtype, source=self.path)


class DerivedTensor(CheckpointTensor):
    """A tensor computed from checkpoint tensors each time it is used (`compute()`: an array of `shape`),
    lazily as they are read: MoE experts stacked into one [E, ...] array, the vocabulary padded, KV
    heads repeated. A load places one parameter's at a time, as a plain checkpoint's."""

    __slots__ = ("compute",)

    def __init__(self, compute, shape, dtype: np.dtype, *, source: str):
        super().__init__(source, -1, shape, np.dtype(dtype))
        self.compute = compute

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self) -> np.ndarray:
        array = self.compute()
        return array if array.dtype == self.dtype else array.astype(self.dtype)


def split_halves(tensor, axis: int) -> tuple:
    """A fused tensor's two halves along `axis` (gate and up stored as one). A checkpoint's plain tensor
    gives two `DerivedTensor`s, each reading only its half from the file when used (through a read-only
    map of the tensor's bytes), so a start never holds a layer's fused tensor whole; another checkpoint
    tensor (a GGUF one) is read whole for each half when used; an array is split now."""
    if not isinstance(tensor, CheckpointTensor):
        return tuple(np.split(np.asarray(tensor), 2, axis=axis))
    half = tensor.shape[axis] // 2
    shape = (*tensor.shape[:axis], half, *tensor.shape[axis + 1 :])

    def part(i: int) -> DerivedTensor:
        index = (slice(None),) * axis + (slice(i * half, (i + 1) * half),)
        if type(tensor) is not CheckpointTensor:
            return tensor.derived(lambda whole: whole[index], shape)

        def read() -> np.ndarray:
            mapped = np.memmap(
                tensor.path, dtype=tensor.stored_dtype, mode="r", offset=tensor.offset, shape=tensor.shape
            )
            return np.array(mapped[index], dtype=tensor.dtype)

        return DerivedTensor(read, shape, tensor.dtype, source=tensor.path)

    return part(0), part(1)


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


def _file_tensors(path: str) -> dict[str, CheckpointTensor]:
    header, data_start = _read_header(path)
    size = os.path.getsize(path)
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which numpy cannot hold")
        dtype = _np_dtype(_DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise ValueError(
                f"{path}: tensor {key!r} has a bad data range {begin}..{end} for {shape} {dtype}"
            )
        tensors[key] = CheckpointTensor(path, data_start + begin, shape, dtype)
    return tensors


def load_safetensors(model_dir: str, *, progress: bool = True) -> dict[str, CheckpointTensor]:
    """Every tensor of the checkpoint in `model_dir`, under its stored name, in its stored dtype, as a
    `CheckpointTensor`: read from its file when used, one at a time (the module docstring)."""
    files = safetensors_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir!r} has no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    tensors: dict[str, CheckpointTensor] = {}
    for path in tqdm(files, desc="Reading safetensors headers", unit="file", disable=not progress):
        tensors.update(_file_tensors(path))
    check_index(model_dir, INDEX_FILE, tensors)
    return tensors


def check_index(model_dir: str, index_file: str, tensors) -> None:
    """ValueError naming them when tensors the directory's index lists are not in `tensors`."""
    index_path = os.path.join(model_dir, index_file)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            missing = set(json.load(f)["weight_map"]) - set(tensors)
        if missing:
            raise ValueError(
                f"{model_dir!r}: tensors listed in {index_file} are missing: {sorted(missing)[:5]}"
            )
