"""A GGUF copied with its float32 matrices quantized, each to the type a function of its name
picks: one small file can hold several block types (per layer, as llama.cpp's mixed files
such as Q4_K_M hold several), so one engine runs them all."""

from __future__ import annotations

from typing import Callable

import gguf
import numpy as np

# Keys the writer sets itself (the header's, and the architecture from its constructor).
_OWN_KEYS = ("GGUF.", "general.architecture")


def requantize_gguf(src: str, out: str, type_of: Callable[[str], str | None]) -> None:
    """Writes ``src``'s metadata and tensors to ``out``; each 2-D float32 tensor named ``name``
    is quantized to ``gguf.GGMLQuantizationType[type_of(name)]`` (kept float32 when None),
    every other tensor copied as it is."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith(_OWN_KEYS):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data = np.asarray(t.data)                  # float32 [rows, cols]; blocks: uint8 [rows, bytes]
        qname = type_of(t.name) if t.tensor_type == gguf.GGMLQuantizationType.F32 and data.ndim == 2 else None
        if qname is None:
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
            continue
        qtype = gguf.GGMLQuantizationType[qname]
        q = gguf.quants.quantize(data, qtype)
        writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
