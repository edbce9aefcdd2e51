"""`appliance models quantize SRC --engine mlx`: mlx-lm's own quantization (affine, bits and group
size) for the MLX engine, from a GGUF (converted first, so no hub download) or an MLX folder.

An already quantized model is dequantized to float16 first, since mlx-lm quantizes only float
weights; the result keeps the tokenizer, the chat template and the link to the source GGUF.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engines.mlx.convert import ConversionError, gguf_to_mlx, source_of, write_source

MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class MlxQuantized:
    folder: Path
    bits: int
    group_size: int
    bytes: int  # the weights' size on disk


def quantize_mlx(source: Path, out: Path, bits: int, group_size: int) -> MlxQuantized:
    if bits not in MLX_BITS:
        raise ConversionError(f"MLX quantizes to {', '.join(map(str, MLX_BITS))} bits, not {bits}")
    if group_size not in MLX_GROUP_SIZES:
        raise ConversionError(f"MLX quantizes in groups of {', '.join(map(str, MLX_GROUP_SIZES))}, not {group_size}")
    if out.exists():
        raise ConversionError(f"{out} exists; give another --out")
    from mlx_lm.convert import convert

    with tempfile.TemporaryDirectory(prefix="mlx-quantize-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        work = Path(tmp)
        gguf: Path | None = None
        if source.is_file():
            gguf = source
            folder = work / "converted"
            gguf_to_mlx(source, folder)
        elif (source / "config.json").is_file():
            folder, gguf = source, source_of(source)
        else:
            raise ConversionError(f"{source} is neither a GGUF file nor an MLX model folder (no config.json)")
        if "quantization" in json.loads((folder / "config.json").read_text()):
            dense = work / "float16"
            _quiet(lambda: convert(str(folder), str(dense), dequantize=True, dtype=_float_type()))
            folder = dense
        staged = work / "quantized"
        _quiet(lambda: convert(str(folder), str(staged), quantize=True, q_bits=bits, q_group_size=group_size))
        if gguf is not None:
            write_source(staged, gguf)
        shutil.move(str(staged), out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return MlxQuantized(out, bits, group_size, size)


def _quiet(work) -> None:  # type: ignore[no-untyped-def]
    """mlx-lm's convert prints its progress; the CLI shows its own."""
    with contextlib.redirect_stdout(io.StringIO()):
        work()


def _float_type() -> str:
    """float16 where the GPU computes in it (Apple silicon); on a CPU, float16 arithmetic is
    emulated and a model in it decodes about twenty times slower than in float32."""
    import platform
    import sys

    return "float16" if sys.platform == "darwin" and platform.machine() == "arm64" else "float32"
