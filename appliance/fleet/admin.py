"""Model files the operator adds to the fleet: quantized with llama.cpp, registered in models.toml.

Registering adds a [[models]] table to the config file through appliance.config.writer, which
leaves the rest of the file as written and replaces it only once the new file parses.
"""

from __future__ import annotations

import ctypes
import re
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.config.settings import NAME, NAME_RULE, ConfigError, load_settings
from appliance.config.writer import append_table

# llama.cpp's file types we offer (llama_ftype); the names are what `--type` takes.
QUANT_TYPES = {
    "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
    "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32,
}
# Approximate bits per weight, to estimate an output's size for a progress bar.
BITS_PER_WEIGHT = {
    "F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_1": 6.0, "Q5_K_M": 5.69, "Q5_K_S": 5.54, "Q5_0": 5.5,
    "Q4_1": 5.0, "Q4_K_M": 4.89, "Q4_K_S": 4.58, "Q4_0": 4.5, "IQ4_NL": 4.5, "IQ4_XS": 4.25, "Q3_K_L": 4.27, "Q3_K_M": 3.91,
    "Q3_K_S": 3.5, "Q2_K": 3.35,
}
_FILE_TYPE_NAMES = {v: k for k, v in QUANT_TYPES.items()} | {0: "F32"}
_UNQUANTIZED = {"F32", "F16", "BF16"}


class ModelAdminError(Exception):
    """A one-line message for the operator."""


def file_type(path: Path) -> str:
    """The GGUF's llama.cpp file type (F16, Q4_1, ...), read from its metadata without its weights."""
    import llama_cpp as L

    from engines.llamacpp.runtime import init_backend

    init_backend()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelAdminError(f"{path}: llama.cpp cannot read this file as a GGUF model")
    try:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_model_meta_val_str(model, b"general.file_type", buf, 64)
        if n < 0:
            return "F32"  # older converters leave it out for unquantized files
        return _FILE_TYPE_NAMES.get(int(buf.value or b"0"), f"type {buf.value.decode()}")
    finally:
        L.llama_model_free(model)


def estimated_size(src: Path, source_type: str, type_name: str) -> int:
    return int(src.stat().st_size * BITS_PER_WEIGHT.get(type_name, 8) / BITS_PER_WEIGHT.get(source_type, 8))


def quantized_name(src: Path, type_name: str) -> Path:
    """model.Q4_1.gguf → model.Q8_0.gguf; model.gguf → model.Q8_0.gguf, beside the source."""
    stem = re.sub(r"[.-](F32|F16|BF16|I?Q\d[\w]*)$", "", src.stem, flags=re.IGNORECASE)
    return src.with_name(f"{stem}.{type_name}.gguf")


def quantize(src: Path, dst: Path, type_name: str, *, threads: int, allow_requantize: bool,
             progress: Callable[[int], None] | None = None) -> None:
    """Runs llama_model_quantize on a thread, reporting the output's size as it grows."""
    import llama_cpp as L

    from engines.llamacpp.runtime import init_backend

    if type_name not in QUANT_TYPES:
        raise ModelAdminError(f"--type: {type_name!r} is not one of {', '.join(QUANT_TYPES)}")
    if not src.is_file():
        raise ModelAdminError(f"{src}: no such file")
    if dst.exists():
        raise ModelAdminError(f"{dst} exists already; remove it or give --out")
    source_type = file_type(src)
    if source_type == type_name:
        raise ModelAdminError(f"{src} is already {type_name}")
    if source_type not in _UNQUANTIZED and not allow_requantize:
        raise ModelAdminError(
            f"{src} is already quantized ({source_type}); quantizing it again to {type_name} compounds the error. "
            "Start from an F16/BF16/F32 file, or pass --allow-requantize"
        )
    init_backend()
    params = L.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = QUANT_TYPES[type_name]
    params.allow_requantize = allow_requantize
    result: list[int] = []
    worker = threading.Thread(target=lambda: result.append(L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))),
                              name="quantize")
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        if progress is not None and dst.exists():
            progress(dst.stat().st_size)
    if not result or result[0] != 0:
        dst.unlink(missing_ok=True)
        raise ModelAdminError(f"llama.cpp could not quantize {src} to {type_name} (see the log above for why)")


def check_alias(alias: str) -> str:
    """Refused before any work is done; the settings reader refuses the same names."""
    if not NAME.match(alias):
        raise ModelAdminError(f"alias {alias!r}: expected {NAME_RULE}")
    return alias


# What `like` never copies: what names the other model's file, and its LoRA adapters (made for that file).
_NOT_COPIED = frozenset({"alias", "path", "package_file", "hf_repo", "hf_file", "sha256", "engine", "adapters", "tokenizer",
                         "tokenizer_package_file"})


def register(config: Path, alias: str, path: Path, sha256: str | None, *, like: str | None = None, engine: str | None = None) -> None:
    """Adds a [[models]] table for `path` (a GGUF with its sha256, or an MLX folder with
    engine "mlx"); the keys the operator wrote for the model `like` (the source's alias, when it
    came from this config) are copied, but its source and adapters."""
    check_alias(alias)
    settings = load_settings(config)
    if settings.model(alias) is not None:
        raise ModelAdminError(f"{config}: models: there is already a model with alias {alias!r}; choose another with --alias")
    values: dict[str, Any] = {"alias": alias, "path": str(path)}
    if sha256 is not None:
        values["sha256"] = sha256
    if engine is not None:
        values["engine"] = engine
    if like is not None:
        if settings.model(like) is None:
            raise ModelAdminError(f"{config}: models: there is no model with alias {like!r} to copy settings from")
        # Every key the operator wrote for that model, as written, but its source and its adapters.
        written = next(t for t in tomllib.loads(config.read_text()).get("models", []) if t.get("alias") == like)
        values |= {k: v for k, v in written.items() if k not in _NOT_COPIED and k not in values}
    try:
        append_table(config, "models", values)
    except ConfigError as exc:
        raise ModelAdminError(f"registering {alias!r} would make {exc}") from None


def alias_for(path: Path) -> str:
    """An alias the settings reader accepts, from a file's name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).lower()[:64].strip("-._") or "model"
