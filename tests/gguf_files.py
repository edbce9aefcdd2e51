"""Small real GGUF files that tests write themselves with the `gguf` package."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf


def rewrite_gguf(src: Path, dst: Path, edit: Callable[[str, Any], Any]) -> Path:
    """Copies a GGUF file, passing every metadata value through `edit(key, value)`."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, edit(field.name, field.contents()), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
