"""rackserve/gguf_file.py against gguf-py's own GGUFReader (the reference, which llama.cpp's
project maintains): a file written by gguf-py's GGUFWriter with every metadata type (nested arrays
and a custom alignment among them) and plain, bf16 and block-quantized tensors reads back with the
same values, names, types, shapes and bytes; a file that is not GGUF, or is cut short, is refused
with the reason."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from rackserve.gguf_file import GGUFFile

VT = gguf.GGUFValueType


def _write(path: str) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ☃")
    w.add_string("t.empty", "")
    w.add_array("t.strings", ["a", "", "Ġthe", "<|im_end|>", "😀"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.none", [])
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("plain.i32", np.arange(7, dtype=np.int32))
    w.add_tensor("plain.3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                  gguf.GGMLQuantizationType.BF16):
        data = rng.standard_normal((6, 64)).astype(np.float32)
        w.add_tensor(f"blocks.{qtype.name}", quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_reads_what_gguf_pys_reader_reads(tmp_path):
    path = str(tmp_path / "all.gguf")
    _write(path)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}   # its header pseudo-fields
    assert list(ours.metadata) == list(fields)
    # What was written, where gguf-py's ReaderField.contents() flattens it ([1, 2, 3]).
    assert ours.metadata.pop("t.nested") == [[1, 2], [3]]
    for key, field in fields.items():
        if key == "t.nested":
            continue
        want, got = field.contents(), ours.metadata[key]
        assert got == want and type(got) is type(want), key
    assert ours.metadata["general.alignment"] == 64 and ours.metadata["t.u64"] == 2**63 + 5
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for got, want in zip(ours.tensors, ref.tensors):
        assert got.tensor_type == want.tensor_type and got.shape == tuple(want.shape.tolist()), got.name
        assert got.n_elements == want.n_elements, got.name
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape, got.name
        assert np.array_equal(got.data, want.data), got.name


def test_refuses_what_is_not_a_whole_gguf_file(tmp_path):
    path = tmp_path / "all.gguf"
    _write(str(path))
    whole = path.read_bytes()
    (tmp_path / "text.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(tmp_path / "text.gguf"))
    (tmp_path / "v9.gguf").write_bytes(whole[:4] + (9).to_bytes(4, "little") + whole[8:])
    with pytest.raises(ValueError, match="version 9"):
        GGUFFile(str(tmp_path / "v9.gguf"))
    (tmp_path / "cut.gguf").write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(str(tmp_path / "cut.gguf"))
    (tmp_path / "header.gguf").write_bytes(whole[:200])      # cut inside the metadata
    with pytest.raises(ValueError, match="header is cut short"):
        GGUFFile(str(tmp_path / "header.gguf"))
