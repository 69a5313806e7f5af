"""PyTorch checkpoints (`pytorch_model.bin`, or shards listed in `pytorch_model.bin.index.json`) read
without torch and without running their pickles' code, lazily like safetensors ones.

Many releases (older models, most EAGLE-3 drafters) ship only these. Such a file is a zip (torch >= 1.6)
of a pickle, `<archive>/data.pkl`, holding the state dict, and one uncompressed member per storage,
`<archive>/data/<key>`, its raw little-endian bytes. The pickle is read by an unpickler that knows only
what a state dict holds (an OrderedDict, torch's tensor rebuild functions and storage types) and refuses
any other global by name: a pickle is code, and a checkpoint from the hub must not run any (torch's own
`weights_only=True` rule). Each contiguous tensor becomes a safetensors_loader `CheckpointTensor` at its
storage's offset in the zip, read when used, nothing mapped; a strided one (rare in a state dict) is
read at once.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from xlaserve.models.safetensors_loader import CheckpointTensor, _np_dtype, check_index

INDEX_FILE = "pytorch_model.bin.index.json"
SINGLE_FILE = "pytorch_model.bin"
# torch's storage types -> numpy dtype names (the 16- and 8-bit floats from ml_dtypes).
_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip member's local header, before its name and extra


def torch_bin_files(model_dir: str) -> list[str]:
    """The PyTorch checkpoint files of `model_dir`: the index's shards, pytorch_model.bin, or none."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, SINGLE_FILE)
    return [single] if os.path.isfile(single) else []


def load_torch_bin(model_dir: str, *, progress: bool = True) -> dict[str, np.ndarray | CheckpointTensor]:
    """Every tensor of the PyTorch checkpoint in `model_dir`, under its stored name and dtype."""
    files = torch_bin_files(model_dir)
    if not files:
        raise ValueError(f"{model_dir!r} has no {SINGLE_FILE} or {INDEX_FILE}")
    tensors = {}
    for path in tqdm(files, desc="Reading PyTorch checkpoint files", unit="file", disable=not progress):
        tensors.update(read_torch_file(path))
    check_index(model_dir, INDEX_FILE, tensors)
    return tensors


def read_torch_file(path: str) -> dict[str, np.ndarray | CheckpointTensor]:
    """One PyTorch checkpoint file's tensors by name (ValueError naming the file for anything else)."""
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path}: not a zip-format PyTorch checkpoint (torch < 1.6 wrote another format): save it again "
            "with a newer torch, or as safetensors"
        )
    with zipfile.ZipFile(path) as archive:
        pickles = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
        if len(pickles) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {len(pickles)}")
        prefix = pickles[0][: -len("data.pkl")]
        members = {info.filename: info for info in archive.infolist()}
        with archive.open(pickles[0]) as f:
            state = _Unpickler(f, path).load()
    if not isinstance(state, dict) or not all(isinstance(v, _Tensor) for v in state.values()):
        raise ValueError(f"{path}: not a state dict (a mapping of names to tensors)")
    with open(path, "rb") as f:
        return {name: tensor.resolve(path, f, members, prefix) for name, tensor in state.items()}


@dataclass(frozen=True)
class _StorageType:
    name: str  # torch's, e.g. "BFloat16Storage"


@dataclass(frozen=True)
class _Storage:
    dtype: np.dtype
    key: str  # its member's name under <archive>/data/
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def resolve(self, path: str, f, members: dict, prefix: str) -> np.ndarray | CheckpointTensor:
        info = members.get(f"{prefix}data/{self.storage.key}")
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}: storage {self.storage.key!r} is missing or compressed")
        f.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
        start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]  # past name and extra
        itemsize = self.storage.dtype.itemsize
        if info.file_size != self.storage.numel * itemsize:
            raise ValueError(
                f"{path}: storage {self.storage.key!r} holds {info.file_size} bytes, not "
                f"{self.storage.numel} items"
            )
        if self.stride == _contiguous_strides(self.shape):
            end = self.offset + int(np.prod(self.shape, dtype=np.int64))
            if end > self.storage.numel:
                raise ValueError(f"{path}: a tensor reaches past its storage {self.storage.key!r}")
            return CheckpointTensor(path, start + self.offset * itemsize, self.shape, self.storage.dtype)
        storage = CheckpointTensor(path, start, (self.storage.numel,), self.storage.dtype).read()
        strides = tuple(s * itemsize for s in self.stride)
        view = np.lib.stride_tricks.as_strided(storage[self.offset :], self.shape, strides, writeable=False)
        return np.array(view)  # a strided view of the storage: copied out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _rebuild_tensor(storage, offset, shape, stride, *_):
    return _Tensor(storage, offset, tuple(shape), tuple(stride))


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    """A state dict's pickle, and nothing else: every global is looked up here, never imported."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)
        raise ValueError(
            f"{self.path}: the checkpoint's pickle names {module}.{name}, which a state dict of tensors "
            "does not need; it is not loaded (a pickle can run code). Save it as safetensors"
        )

    def persistent_load(self, pid):
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise ValueError(f"{self.path}: an unknown persistent id {pid!r} in the checkpoint's pickle")
        return _Storage(_np_dtype(_STORAGE_DTYPES[storage_type.name]), str(key), int(numel))
