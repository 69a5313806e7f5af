"""Our GGUF header parser (models/gguf_reader.py) reads what gguf's own GGUFReader reads: every
metadata value and every tensor's name, type, shape and bytes."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from helpers.smollm2 import smollm2_gguf_path
from xlaserve.models.gguf_loader import open_gguf, read_gguf_metadata
from xlaserve.models.gguf_reader import FastGGUFReader


def _reference_metadata(path: str) -> dict:
    return read_gguf_metadata(GGUFReader(path))  # gguf's reader through the field-by-field path


def _assert_same(path: str) -> FastGGUFReader:
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert isinstance(ours, FastGGUFReader)
    assert read_gguf_metadata(ours) == _reference_metadata(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        np.testing.assert_array_equal(a.data, b.data)
    return ours


def test_embedded_model_reads_as_ggufs_reader_reads_it():
    reader = _assert_same(smollm2_gguf_path())
    assert len(reader.metadata["tokenizer.ggml.tokens"]) == 49152


def test_every_value_type_and_plain_and_quantized_tensors(tmp_path):
    path = str(tmp_path / "mixed.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 2**31)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 1e-5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.25])
    writer.add_array("t.strs", ["a", "", "Ġthe"])
    writer.add_uint32("general.alignment", 64)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain16", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = rng.standard_normal((2, 64)).astype(np.float32)
    writer.add_tensor("q8", quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = _assert_same(path)
    metadata = reader.metadata
    assert metadata["t.f32"] == 1e-5 and metadata["t.str"] == "héllo ✓" and metadata["t.bool"] is True
    assert metadata["t.strs"] == ["a", "", "Ġthe"] and metadata["t.i64"] == -(2**40)
