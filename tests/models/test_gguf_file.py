"""Our GGUF container reader: the same metadata and tensors as ``gguf.GGUFReader`` (on the
built-in model and on a file holding every value type GGUFWriter can write), and a
``ModelLoadError`` naming the file for every cut or corrupt file."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from jaxllm.errors import ModelLoadError
from jaxllm.models.gguf_file import read_gguf


def _reader_fields(reader):
    """What the old loader's ``field()`` returned for every key (pseudo-fields dropped)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _assert_same_value(got, want, key):
    assert type(got) is type(want), (key, type(got), type(want))
    if isinstance(want, list):
        assert len(got) == len(want), key
        for g, w in zip(got, want):
            _assert_same_value(g, w, key)
    elif isinstance(want, float) and want != want:
        assert got != got, key
    else:
        assert got == want, (key, got, want)


def _assert_same_as_reader(path):
    import gguf
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    want = _reader_fields(reader)
    assert list(ours.fields) == list(want)
    for key, value in want.items():
        _assert_same_value(ours.fields[key], value, key)
        assert list(ours.field_types[key]) == list(reader.fields[key].types), key
    assert ours.version == reader.fields["GGUF.version"].contents()
    assert len(ours.tensors) == reader.fields["GGUF.tensor_count"].contents() == len(reader.tensors)
    assert len(ours.fields) == reader.fields["GGUF.kv_count"].contents()
    assert ours.alignment == reader.alignment and ours.data_offset == reader.data_offset
    for t, r in zip(ours.tensors, reader.tensors):
        assert t.name == r.name
        assert t.shape == tuple(r.shape.tolist()), t.name
        assert t.tensor_type == r.tensor_type and isinstance(t.tensor_type, gguf.GGMLQuantizationType)
        assert t.n_elements == r.n_elements and t.n_bytes == r.n_bytes and t.data_offset == r.data_offset
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert t.data.tobytes() == r.data.tobytes(), t.name
        assert not t.data.flags.writeable
    return ours


def test_builtin_model_reads_like_gguf_reader():
    from jaxllm.models.builtin import builtin_gguf_path
    g = _assert_same_as_reader(builtin_gguf_path())
    assert len(g.fields["tokenizer.ggml.tokens"]) == 49152
    assert all(type(s) is str for s in g.fields["tokenizer.ggml.merges"])
    assert type(g.fields["tokenizer.ggml.token_type"][0]) is int


# ------------------------------------------------------------------ a file with every value type

STRINGS = ["hello", "", "héllo wörld", "日本語", "emoji 🦙", "Ġthe", "<0x0A>", "a\x00b", "x" * 1000]


def _write_every_type(path, alignment=None):
    import gguf
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -2**31)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -2**63)
    w.add_float32("t.f32", 1.1)
    w.add_float32("t.f32_inf", float("-inf"))
    w.add_float32("t.f32_nan", float("nan"))
    w.add_float64("t.f64", 1.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo\nwörld 🦙")
    w.add_key_value("t.str_empty", "", V.STRING)
    w.add_array("t.arr_str", STRINGS)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25, 3.0e38])
    w.add_array("t.arr_bool", [True, False, True])
    for name, vt, vals in [("u8", V.UINT8, [0, 255]), ("i8", V.INT8, [-128, 127]),
                           ("u16", V.UINT16, [0, 65535]), ("i16", V.INT16, [-32768, 32767]),
                           ("u32", V.UINT32, [0, 2**32 - 1]), ("u64", V.UINT64, [0, 2**64 - 1]),
                           ("i64", V.INT64, [-2**63, 2**63 - 1]), ("f64", V.FLOAT64, [0.1, -1e300])]:
        w.add_key_value(f"t.arr_{name}", vals, V.ARRAY, sub_type=vt)
    w.add_key_value("t.arr_nested", [[1, 2, 3], [4]], V.ARRAY)
    w.add_key_value("t.arr_nested_str", [["a", "b"], ["ç"]], V.ARRAY)
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((4, 64)).astype(np.float32)
    tensors = {
        "f32": f32, "f32_1d": f32[0].copy(), "f32_3d": f32.reshape(2, 2, 64).copy(),
        "f16": f32.astype(np.float16), "f64": f32.astype(np.float64),
        "i8": np.arange(-64, 64, dtype=np.int8).reshape(2, 64), "i16": np.arange(128, dtype=np.int16),
        "i32": np.arange(128, dtype=np.int32).reshape(2, 64), "i64": np.arange(64, dtype=np.int64),
    }
    for name, t in tensors.items():
        w.add_tensor(name, t)
    for qt in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0,
               gguf.GGMLQuantizationType.BF16):
        q = gguf.quants.quantize(f32, qt)
        w.add_tensor(qt.name.lower(), q, raw_shape=q.shape, raw_dtype=qt)
        tensors[qt.name.lower()] = q
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture
def every_type(tmp_path):
    path = str(tmp_path / "every.gguf")
    return path, _write_every_type(path)


def test_every_value_type_round_trips(every_type):
    import gguf
    path, tensors = every_type
    g = read_gguf(path)
    f = g.fields
    assert g.version == 3 and g.alignment == 32
    assert f["general.architecture"] == "llama"
    expect = {
        "t.u8": 255, "t.i8": -128, "t.u16": 65535, "t.i16": -32768, "t.u32": 2**32 - 1, "t.i32": -2**31,
        "t.u64": 2**64 - 1, "t.i64": -2**63, "t.f32": float(np.float32(1.1)), "t.f32_inf": float("-inf"),
        "t.f64": 1.1, "t.true": True, "t.false": False, "t.str": "héllo\nwörld 🦙", "t.str_empty": "",
        "t.arr_str": STRINGS, "t.arr_i32": [1, -2, 3], "t.arr_f32": [0.5, -1.25, float(np.float32(3.0e38))],
        "t.arr_bool": [True, False, True], "t.arr_u8": [0, 255], "t.arr_i8": [-128, 127],
        "t.arr_u16": [0, 65535], "t.arr_i16": [-32768, 32767], "t.arr_u32": [0, 2**32 - 1],
        "t.arr_u64": [0, 2**64 - 1], "t.arr_i64": [-2**63, 2**63 - 1], "t.arr_f64": [0.1, -1e300],
        "t.arr_nested": [[1, 2, 3], [4]], "t.arr_nested_str": [["a", "b"], ["ç"]],
    }
    for key, value in expect.items():
        _assert_same_value(f[key], value, key)
    assert f["t.f32_nan"] != f["t.f32_nan"]
    V = gguf.GGUFValueType
    assert g.field_types["t.f64"] == (V.FLOAT64,)
    assert g.field_types["t.arr_str"] == (V.ARRAY, V.STRING)
    assert g.field_types["t.arr_nested"] == (V.ARRAY, V.ARRAY, V.INT32)

    by_name = {t.name: t for t in g.tensors}
    assert list(by_name) == list(tensors)
    for name, want in tensors.items():
        t = by_name[name]
        assert t.data.dtype == want.dtype and t.data.shape == want.shape, name
        np.testing.assert_array_equal(t.data, want, err_msg=name)
        assert t.data_offset % g.alignment == 0 and t.data_offset == g.data_offset + t.offset
    assert by_name["f32_3d"].shape == (64, 2, 2) and by_name["q8_0"].shape == (64, 4)
    assert by_name["q4_1"].tensor_type == gguf.GGMLQuantizationType.Q4_1 and by_name["q4_1"].n_elements == 256
    # gguf.quants.dequantize takes the data as it takes GGUFReader's.
    for name in ("q8_0", "q4_1", "bf16", "f16", "f32"):
        t = by_name[name]
        assert gguf.quants.dequantize(t.data, t.tensor_type).shape == (4, 64)


def test_every_value_type_reads_like_gguf_reader(tmp_path):
    # GGUFReader flattens nested arrays; everything else must agree exactly.
    import gguf
    path = str(tmp_path / "flat.gguf")
    tensors = _write_every_type(path, alignment=64)
    reader = gguf.GGUFReader(path)
    nested = [k for k, fld in reader.fields.items() if fld.types[:2] == [gguf.GGUFValueType.ARRAY] * 2]
    assert sorted(nested) == ["t.arr_nested", "t.arr_nested_str"]
    g = read_gguf(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0
    for key, value in _reader_fields(reader).items():
        if key not in nested:
            _assert_same_value(g.fields[key], value, key)
            assert list(g.field_types[key]) == list(reader.fields[key].types), key
    for t, r in zip(g.tensors, reader.tensors, strict=True):
        assert (t.name, t.shape, t.tensor_type, t.data_offset) == (r.name, tuple(r.shape.tolist()), r.tensor_type,
                                                                  r.data_offset)
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape
        assert t.data.tobytes() == r.data.tobytes() == tensors[t.name].tobytes()


# ------------------------------------------------------------------ hand-made files

def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _gguf(kvs: list[bytes], infos: list[bytes] = (), version=3, magic=b"GGUF", data=b"") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % 32) + data


def _kv(key, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _info(name, dims, ggml_type=0, offset=0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", ggml_type, offset)


def _write(tmp_path, name, content: bytes) -> str:
    p = str(tmp_path / name)
    with open(p, "wb") as f:
        f.write(content)
    return p


def test_empty_arrays_and_version_2(tmp_path):
    p = _write(tmp_path, "v2.gguf", _gguf([
        _kv("a.empty_str", 9, struct.pack("<IQ", 8, 0)), _kv("a.empty_i32", 9, struct.pack("<IQ", 5, 0)),
        _kv("a.bad_utf8", 8, _s(b"ok\xff\xfe")),
    ], [_info("w", [2, 1], 0, 0)], version=2, data=np.array([1.5, -2], np.float32).tobytes()))
    g = read_gguf(p)
    assert g.version == 2
    assert g.fields == {"a.empty_str": [], "a.empty_i32": [], "a.bad_utf8": "ok\ufffd\ufffd"}
    (t,) = g.tensors
    assert t.shape == (2, 1) and t.data.shape == (1, 2) and t.data.tolist() == [[1.5, -2.0]]


def _raises(path, *fragments):
    with pytest.raises(ModelLoadError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert path in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


@pytest.mark.parametrize("content, fragments", [
    (b"", ["empty"]),
    (b"GGML" + b"\0" * 40, ["bad magic"]),
    (b"PK\x03\x04 not a gguf at all, a zip", ["bad magic"]),
    (b"GG", ["bad magic"]),
    (_gguf([], version=1), ["version 1 is not supported"]),
    (_gguf([], version=4), ["version 4 is not supported"]),
    (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), ["big-endian"]),
    (_gguf([_kv("k", 13, b"\0" * 8)]), ["unknown value type 13", "metadata key 0 ('k')"]),
    (_gguf([_kv("k", 9, struct.pack("<IQ", 99, 1) + b"\0" * 8)]), ["unknown value type 99"]),
    (_gguf([_kv("k", 4, b"\0" * 4), _kv("k", 4, b"\0" * 4)]), ["'k' appears twice"]),
    (_gguf([_kv(b"\xff\xfe", 4, b"\0" * 4)]), ["not valid UTF-8"]),
    (_gguf([_kv("k", 9, struct.pack("<IQ", 8, 2**62))]), ["array items", "('k')"]),
    (_gguf([_kv("k", 8, struct.pack("<Q", 2**40))]), ["truncated", "('k')"]),
    (_gguf([], [_info("w", [4], 0, 0)] * 2, data=b"\0" * 16), ["'w' appears twice"]),
    (_gguf([], [_info("w", [4], 250, 0)], data=b"\0" * 16), ["unknown ggml type 250"]),
    (_gguf([], [_info("w", [33], 8, 0)], data=b"\0" * 64), ["not whole 32-element blocks"]),
    (_gguf([], [_info("w", [4], 0, 2**40)], data=b"\0" * 16), ["truncated in the data of tensor 'w'"]),
    (_gguf([_kv("general.alignment", 10, struct.pack("<Q", 32))]), ["general.alignment has type UINT64"]),
    (_gguf([_kv("general.alignment", 4, struct.pack("<I", 48))]), ["not a power of two"]),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**60), ["metadata entries"]),
    (_gguf([_kv("k", 9, struct.pack("<IQ", 9, 1) * 5000)]), ["nested more than", "('k')"]),
])
def test_corrupt_files_raise_naming_the_file(tmp_path, content, fragments):
    _raises(_write(tmp_path, "bad.gguf", content), *fragments)


def test_every_cut_raises_naming_the_file(every_type, tmp_path):
    path, _ = every_type
    full = open(path, "rb").read()
    g = read_gguf(path)
    end_of_data = max(t.data_offset + t.n_bytes for t in g.tensors)
    # Where each part of the file begins, found from the bytes themselves.
    tokens_at = full.index(b"t.arr_str")
    infos_at = full.index(_s("f32") + struct.pack("<I", 2))
    cut = str(tmp_path / "cut.gguf")
    # Every cut inside the header (metadata and tensor infos), then cuts through the data.
    for n in [*range(0, g.data_offset), *range(g.data_offset, end_of_data, 37), end_of_data - 1]:
        with open(cut, "wb") as f:
            f.write(full[:n])
        msg = _raises(cut)
        if tokens_at + 20 < n < tokens_at + 60:
            assert "truncated in metadata key" in msg and "'t.arr_str'" in msg, msg
        elif infos_at + 4 < n < g.data_offset - 40:
            assert "truncated in tensor info" in msg, msg
        elif n >= g.data_offset:
            assert "truncated in the data of tensor" in msg, msg


def test_loader_reports_a_cut_file(every_type, tmp_path):
    from jaxllm.models.loader import load_gguf
    path, _ = every_type
    cut = _write(tmp_path, "cut.gguf", open(path, "rb").read()[:500])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_gguf(cut)
    assert os.path.getsize(cut) == 500


def test_loader_dequantizes_long_rows_bit_for_bit():
    # The loader hands gguf.quants fewer, longer rows; for every type gguf can decode that
    # must give exactly the plain call's bits (random bytes: NaN/inf scales included).
    import gguf
    from types import SimpleNamespace
    from gguf.quants import _type_traits, dequantize
    from jaxllm.models.gguf_tensors import _dequantize_gguf_tensor
    rng = np.random.default_rng(1)
    for qtype in [*_type_traits, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32]:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        for shape in [(64, 2), (7, 3), (5, 4, 1), (1, 1)]:
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] * size), dtype=np.uint8)
            data = raw if qtype in _type_traits else raw.view({0: np.float32, 1: np.float16}[qtype.value])
            with np.errstate(all="ignore"):
                want = dequantize(data, qtype)
                got, err = _dequantize_gguf_tensor(dequantize, SimpleNamespace(data=data, tensor_type=qtype))
            assert err is None, qtype.name
            assert got.dtype == want.dtype and got.shape == want.shape, (qtype.name, shape)
            assert got.tobytes() == want.tobytes(), (qtype.name, shape)
    got, err = _dequantize_gguf_tensor(dequantize, SimpleNamespace(
        data=np.zeros((2, 36), np.uint8), tensor_type=gguf.GGMLQuantizationType.Q8_1))
    assert got is None and isinstance(err, NotImplementedError)
