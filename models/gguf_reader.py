"""A GGUF header parser for start-up: metadata as Python values, tensors memory-mapped.

`gguf.GGUFReader` builds a numpy slice per metadata item (~250k for a 49k-token vocabulary with
merges: ~1 s of every start on SmolLM2). Here strings are decoded straight from the mapped bytes
and numeric arrays are one `frombuffer` each: the same metadata and tensors in ~0.1 s. Little-endian
files only (what llama.cpp writes); `open_gguf` falls back to GGUFReader otherwise.

No jax: the front end reads a GGUF's tokenizer through here (models/tokenizer.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Tensor types stored as plain numpy elements; every other type is blocks of bytes.
_PLAIN_TENSORS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class NotLittleEndianGGUF(ValueError):
    pass


@dataclass
class GGUFTensor:
    """One tensor, as GGUFReader's ReaderTensor: `shape` lists dims innermost first; `data` is a
    read-only view of the mapping, [rows..., bytes per row] uint8 for block-quantized types, found at
    byte `data_offset` of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray
    data_offset: int


class FastGGUFReader:
    """`metadata` (key -> Python value, as `read_gguf_metadata` gives) and `tensors`."""

    def __init__(self, path: str):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(np.asarray(self.data))
        self._pos = 0
        magic, version = self._unpack("<II")
        if magic != _MAGIC:
            raise ValueError("GGUF magic not found")
        if version & 0xFFFF == 0:  # a big-endian file reads its version byte-swapped
            raise NotLittleEndianGGUF("big-endian GGUF")
        num_tensors, num_kv = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {
            "GGUF.version": version,
            "GGUF.tensor_count": num_tensors,
            "GGUF.kv_count": num_kv,
        }
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            value = self._value(GGUFValueType(value_type))
            if value_type == GGUFValueType.FLOAT32:  # the shortest float32 repr, as read_gguf_metadata
                value = float(str(np.float32(value)))
            self.metadata[key] = value
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            tensor_type, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(tensor_type), offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._pos)
        start = self._pos + 8
        self._pos = start + length
        return str(self._buf[start : self._pos], "utf-8")

    def _value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type != GGUFValueType.ARRAY:
            return self._unpack(_SCALARS[value_type])[0]
        item_type, count = self._unpack("<IQ")
        item_type = GGUFValueType(item_type)
        if item_type == GGUFValueType.STRING:
            return [self._string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:
            return [self._value(item_type) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item_type])
        values = np.frombuffer(self._buf, dtype, count, self._pos)
        self._pos += dtype.itemsize * count
        return values.tolist()

    def _tensor(self, start: int, name: str, dims: tuple, tensor_type, offset: int) -> GGUFTensor:
        shape = tuple(int(d) for d in reversed(dims))
        if tensor_type in _PLAIN_TENSORS:
            dtype, byte_shape = np.dtype(_PLAIN_TENSORS[tensor_type]), shape
            count = int(np.prod(shape, dtype=np.int64))
        else:
            dtype, byte_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, tensor_type)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            count = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        begin = start + offset
        data = np.asarray(self.data[begin : begin + count * dtype.itemsize]).view(dtype).reshape(byte_shape)
        return GGUFTensor(name, tensor_type, np.array(dims, dtype=np.uint64), data, begin)


class _FastGGUFReader(GGUFReader):
    """`GGUFReader` slicing a plain ndarray view of the file instead of the `np.memmap` itself.

    The reader takes one slice per metadata item (~250k for a 49k-token vocabulary with merges);
    on a memmap every slice pays for `memmap.__array_finalize__`, which makes opening the file
    take ~3 s instead of ~1 s. The view shares the same mapping, so nothing is read eagerly.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = np.asarray(self.data)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def read_tensor_data(path: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes at `offset` of the file, read now into a new array of `dtype` and `shape` (the
    lazy GGUF tensors' read: a copy, never a view of a mapping that would outlive the load)."""
    num_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.fromfile(path, dtype=np.uint8, count=num_bytes, offset=offset)
    if raw.size != num_bytes:
        raise ValueError(
            f"{path}: a tensor's data ends past the end of the file (the file changed since its header "
            "was read)"
        )
    return raw.view(dtype).reshape(shape)


def read_block_fields(path: str, offset: int, block_bytes: int, num_blocks: int, fields: slice) -> np.ndarray:
    """Bytes `fields` of each of `num_blocks` blocks of `block_bytes` at `offset` (a quantized tensor's
    scales, without its codes), copied into a new [num_blocks, field bytes] uint8 array from a
    mapping that goes when this returns."""
    try:
        mapped = np.memmap(path, np.uint8, "r", offset=offset, shape=(num_blocks, block_bytes))
    except ValueError as error:  # the mapping would reach past the end of the file
        raise ValueError(
            f"{path}: a tensor's data ends past the end of the file (the file changed since its header "
            "was read)"
        ) from error
    return np.array(mapped[:, fields])  # a copy: the mapping goes with `mapped`


def open_gguf(path: str) -> FastGGUFReader | GGUFReader:
    """Parse the header of a GGUF file (tensors stay memory-mapped). ValueError if it is not GGUF.
    Our parser (models/gguf_reader.py, ~10x faster), or gguf's reader for a big-endian file."""
    try:
        try:
            return FastGGUFReader(path)
        except NotLittleEndianGGUF:
            pass
        try:
            return _FastGGUFReader(path)
        except (TypeError, AttributeError):  # a gguf release whose private reader internals changed
            return GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e!r}") from e


def read_gguf_metadata(reader: FastGGUFReader | GGUFReader) -> dict[str, Any]:
    """All metadata key/values as Python values (strings, numbers, lists)."""
    if isinstance(reader, FastGGUFReader):
        return dict(reader.metadata)
    metadata = {}
    for key, field in reader.fields.items():
        value = field.contents()
        # float32 metadata widened to a Python float reads 9.999999747378752e-06; the config the
        # file was converted from said 1e-05, which is the shortest float32 repr.
        if field.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        metadata[key] = value
    return metadata
