"""A small, fast reader of the GGUF container (versions 2 and 3, little-endian).

Why it exists: ``gguf.GGUFReader`` builds a numpy memmap view for every scalar, string
length and string body in the metadata.  A tokenizer stores ~50k token strings and as
many merges, so opening even the 98 MB built-in SmolLM2 file took ~4 s, most of a warm
``jaxllm generate``'s budget.  This module parses the same bytes with ``struct`` (tens of
milliseconds) and leaves only the tensor data memory-mapped.

What it returns (``read_gguf``) mirrors what the old loader got out of ``GGUFReader``:

* ``fields``: key -> plain Python value, as ``ReaderField.contents()`` gives it: ``int``,
  ``float`` (a float32 widened to a Python float), ``bool``, ``str``, and ``list`` for arrays
  (of str, int, float or bool).  Nested arrays come back as nested lists (``GGUFReader``
  flattens them; no known writer of models uses them).  ``GGUFReader``'s pseudo-fields
  ``GGUF.version``/``GGUF.tensor_count``/``GGUF.kv_count`` are not in ``fields``: see
  ``version``, ``len(tensors)`` and ``len(fields)``.  ``field_types`` gives each key's
  value type(s) the way ``ReaderField.types`` does (and, unlike it, an empty array's item
  type too).
* ``tensors``: name, shape as GGUF stores it (innermost dimension first), ggml type,
  element and byte counts, offsets, and ``data``: a read-only view of the memory-mapped
  file (a plain ndarray, not the slower np.memmap subclass) shaped exactly
  like ``ReaderTensor.data`` (typed with the reversed shape for F16/F32/F64/I8..I64, uint8
  rows of bytes for every other type, BF16 included), so ``gguf.quants.dequantize`` takes it.

Strings are UTF-8.  Keys and tensor names must decode (``GGUFReader`` refuses the file
otherwise, as we do); string *values* decode with ``errors="replace"``, where
``GGUFReader`` would raise only once the value was asked for.  Every way a file can be
short or malformed raises ``ModelLoadError`` naming the file and what is wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from jaxllm.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Fixed-size value types: (struct format, size, numpy dtype for arrays of them).
_SCALARS: dict[int, tuple[struct.Struct, int, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), 1, np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), 1, np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), 2, np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), 2, np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), 4, np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), 4, np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), 4, np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<?"), 1, np.dtype("?")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), 8, np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), 8, np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), 8, np.dtype("<f8")),
}
# The fewest bytes one array element of each type can take (a string is at least its
# 8-byte length, an array its 4-byte type and 8-byte count): lets a corrupt element count
# be refused before looping over it.
_MIN_ITEM = {**{t: s[1] for t, s in _SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}

_MAX_NESTING = 32

# ggml types whose data GGUFReader exposes typed (with the reversed shape); all others
# (quantized, BF16) are uint8 rows of bytes, which is what gguf.quants.dequantize expects.
_TYPED_DATA = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]          # as GGUF stores it: innermost (contiguous) dimension first
    tensor_type: GGMLQuantizationType
    n_elements: int
    n_bytes: int
    offset: int                     # from the start of the data section, as stored
    data_offset: int                # from the start of the file
    data: np.ndarray                # read-only view of the mapped file, shaped like ReaderTensor.data


@dataclass
class GGUFFile:
    path: str
    version: int
    fields: dict[str, object]
    # key -> value type, with the item type(s) of arrays after it: (UINT32,), (ARRAY, STRING),
    # (ARRAY, ARRAY, INT32) for an array of arrays of int32.
    field_types: dict[str, tuple[GGUFValueType, ...]]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int
    file_size: int
    _memmap: np.ndarray | None = field(default=None, repr=False)


class _Parser:
    """Walks the header region of a mapped file; ``where`` names what is being read, so a
    short or corrupt file is reported as e.g. "metadata key 29 ('tokenizer.ggml.merges')"."""

    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size = path, buf, size
        self.off = 0
        self.where = "the header"

    def fail(self, what: str):
        raise ModelLoadError(f"{self.path}: not a readable GGUF file: {what}")

    def truncated(self, need: int):
        self.fail(f"truncated in {self.where} (needs {need} bytes at offset {self.off}, "
                  f"the file has {self.size})")

    def unpack(self, st: struct.Struct):
        """The next value of format ``st``; a file too short for it is reported as truncated."""
        off = self.off
        if off + st.size > self.size:
            self.truncated(st.size)
        self.off = off + st.size
        return st.unpack_from(self.buf, off)[0]

    def u32(self) -> int:
        return self.unpack(_U32)

    def u64(self) -> int:
        return self.unpack(_U64)

    def raw_string(self) -> bytes:
        n = self.u64()
        if n > self.size - self.off:
            self.truncated(n)
        start = self.off
        self.off = start + n
        return self.buf[start:start + n]

    def name(self, what: str) -> str:
        raw = self.raw_string()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at offset {self.off - len(raw)} is not valid UTF-8: {raw[:40]!r}")

    def check_count(self, n: int, item_size: int, what: str):
        """Refuses a count that cannot fit in the rest of the file (a corrupt or cut file),
        before anything loops over it."""
        if n * item_size > self.size - self.off:
            self.fail(f"truncated in {self.where}: {n} {what} need at least {n * item_size} bytes at "
                      f"offset {self.off}, the file has {self.size}")

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            self.fail(f"unknown value type {raw} in {self.where}")

    def value(self, vtype: GGUFValueType, types: list[GGUFValueType], depth: int = 0):
        types.append(vtype)
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.unpack(scalar[0])
        if vtype == GGUFValueType.STRING:
            return self.raw_string().decode("utf-8", "replace")
        # ARRAY: item type, count, items.
        itype = self.value_type()
        count = self.u64()
        self.check_count(count, _MIN_ITEM[itype], f"array items of type {itype.name}")
        scalar = _SCALARS.get(itype)
        if scalar is not None:
            # One copy out of the map and one tolist(): Python ints/floats/bools, as
            # ReaderField.contents() returns them.
            _, n, dtype = scalar
            start = self.off
            self.off = start + n * count
            types.append(itype)
            return np.frombuffer(self.buf[start:self.off], dtype=dtype).tolist()
        if itype == GGUFValueType.STRING:
            types.append(itype)
            return self._strings(count)
        # Arrays of arrays: each element carries its own item type and count.  Record the
        # first element's types, as GGUFReader does.  A corrupt file could nest them deep
        # enough to exhaust Python's recursion limit; no real one nests more than twice.
        if depth >= _MAX_NESTING:
            self.fail(f"arrays nested more than {_MAX_NESTING} deep in {self.where}")
        out = []
        for i in range(count):
            sub: list[GGUFValueType] = []
            out.append(self.value(itype, sub, depth + 1))
            if i == 0:
                types.extend(sub)
        if count == 0:
            types.append(itype)
        return out

    def _strings(self, count: int) -> list[str]:
        # The hot loop (token lists, merges): locals only, one bounds check per string.
        buf, size, off = self.buf, self.size, self.off
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if off + 8 > size:
                self.off = off
                self.truncated(8)
            (n,) = unpack(buf, off)
            off += 8
            end = off + n
            if end > size:
                self.off = off
                self.truncated(n)
            append(buf[off:end].decode("utf-8", "replace"))
            off = end
        self.off = off
        return out


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses a GGUF file's header, metadata and tensor infos; maps the tensor data."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ModelLoadError(f"{path}: not a readable GGUF file: the file is empty")
            # Map rather than read: the metadata is parsed straight from the page cache and
            # the multi-hundred-MB tensor data is never read here.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    try:
        header = _parse(path, mm, size)
    finally:
        mm.close()   # every value parsed above is a copy, nothing still points into it
    version, fields, types, infos, end = header

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        if types["general.alignment"] != (GGUFValueType.UINT32,):
            raise ModelLoadError(f"{path}: not a readable GGUF file: general.alignment has type "
                                 f"{'/'.join(t.name for t in types['general.alignment'])}, expected UINT32")
        alignment = fields["general.alignment"]
        if alignment == 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"{path}: not a readable GGUF file: general.alignment {alignment} is not a "
                                 f"power of two")
    data_offset = end + (-end % alignment)

    # One read-only map of the whole file; each tensor's data is a view of it, as a plain
    # ndarray: gguf.quants slices its input thousands of times per tensor, and on the
    # np.memmap subclass every slice runs memmap's Python-level __array_finalize__ (~0.4 s
    # over the built-in model).  The views keep the map alive.
    memmap = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray) if infos else None
    tensors = []
    for name, dims, ggml_type, offset in infos:
        n_elements = 1
        for d in dims:
            n_elements *= d
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        np_shape = tuple(reversed(dims))
        item = _TYPED_DATA.get(ggml_type)
        if item is None:
            # Quantized (and BF16): rows of blocks, as gguf.quants.quant_shape_to_byte_shape.
            if not np_shape or np_shape[-1] % block_size:
                raise ModelLoadError(f"{path}: not a readable GGUF file: tensor {name!r} of type "
                                     f"{ggml_type.name} has shape {tuple(dims)}: its rows are not whole "
                                     f"{block_size}-element blocks")
            np_shape = (*np_shape[:-1], np_shape[-1] // block_size * type_size)
            item = np.uint8
        n_bytes = n_elements * type_size // block_size
        start = data_offset + offset
        if start + n_bytes > size:
            raise ModelLoadError(f"{path}: not a readable GGUF file: truncated in the data of tensor {name!r} "
                                 f"(needs bytes {start}..{start + n_bytes}, the file has {size})")
        data = memmap[start:start + n_bytes].view(item).reshape(np_shape)
        tensors.append(GGUFTensor(name, tuple(dims), ggml_type, n_elements, n_bytes, offset, start, data))
    return GGUFFile(path, version, fields, types, tensors, alignment, data_offset, size, memmap)


def _parse(path: str, buf, size: int):
    p = _Parser(path, buf, size)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        p.fail(f"bad magic {magic!r} (expected {GGUF_MAGIC!r})")
    p.off = 4
    version = p.u32()
    if version not in SUPPORTED_VERSIONS:
        # A big-endian file's version reads byte-swapped here: 3 -> 0x03000000.
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            p.fail(f"big-endian GGUF (version {version >> 24}) is not supported")
        p.fail(f"GGUF version {version} is not supported (supported: "
               f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
    tensor_count, kv_count = p.u64(), p.u64()
    p.check_count(kv_count, 8 + 4 + 1, "metadata entries")
    p.check_count(tensor_count, 8 + 4 + 4 + 8, "tensor infos")

    fields: dict[str, object] = {}
    types: dict[str, tuple[GGUFValueType, ...]] = {}
    for i in range(kv_count):
        p.where = f"metadata key {i}"
        key = p.name("a metadata key")
        p.where = f"metadata key {i} ({key!r})"
        if key in fields:
            p.fail(f"metadata key {key!r} appears twice")
        vtypes: list[GGUFValueType] = []
        fields[key] = p.value(p.value_type(), vtypes)
        types[key] = tuple(vtypes)

    infos = []
    seen = set()
    for i in range(tensor_count):
        p.where = f"tensor info {i}"
        name = p.name("a tensor name")
        p.where = f"tensor info {i} ({name!r})"
        if name in seen:
            p.fail(f"tensor {name!r} appears twice")
        seen.add(name)
        n_dims = p.u32()
        p.check_count(n_dims, 8, "dimensions")
        dims = [p.u64() for _ in range(n_dims)]
        raw_type = p.u32()
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            p.fail(f"tensor {name!r} has unknown ggml type {raw_type}")
        infos.append((name, dims, ggml_type, p.u64()))
    return version, fields, types, infos, p.off
