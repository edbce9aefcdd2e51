"""What a served model is, as a client's model picker shows it: its file's format, architecture,
size label and quantization (read from the GGUF header, not the weights), its file size, context
length and what it can do. Ollama's /api/tags, /api/show and /api/ps are written from it."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.fleet.admin import QUANT_TYPES
from appliance.fleet.files import ModelFileError, resolve
from appliance.fleet.registry import LoadedModel

_QUANT_NAMES = {number: name for name, number in QUANT_TYPES.items()} | {0: "F32"}


@dataclass(frozen=True)
class Card:
    format: str  # "gguf", "mlx", "" for an upstream
    family: str  # general.architecture
    parameter_size: str  # general.size_label ("135M"), or ""
    quantization: str  # "Q4_1", or ""
    size_bytes: int
    digest: str  # of the file's path, size and time: a stable name, not a content hash
    modified_at: float
    context_length: int
    capabilities: tuple[str, ...]  # Ollama's words: completion, tools, embedding
    template: str


@functools.lru_cache(maxsize=64)
def _header_facts(path: str, size: int, mtime_ns: int) -> tuple[str, str, str]:
    from engines.llamacpp.gguf_header import GgufError, read_header

    try:
        metadata = read_header(Path(path)).metadata
    except GgufError:
        return "", "", ""
    file_type = metadata.get("general.file_type")
    return (str(metadata.get("general.architecture") or ""), str(metadata.get("general.size_label") or ""),
            _QUANT_NAMES.get(file_type, "") if isinstance(file_type, int) else "")


def card(model: LoadedModel, data_dir: Path) -> Card:
    s = model.settings
    kind = s.kind
    capabilities = ("embedding",) if kind == "embedding" else ("completion", "tools") if kind == "chat" else ()
    template = model.template.source if model.template is not None else ""
    path: Path | None = None
    if s.engine not in ("openai",):
        try:
            path = resolve(s, data_dir)
        except (ModelFileError, AssertionError):
            path = None
    if path is None or not path.is_file():
        return Card("", "", "", "", 0, _digest(s.alias, 0, 0), 0.0, model.engine.context_length, capabilities, template)
    stat = path.stat()
    family, size_label, quantization = _header_facts(str(path.resolve()), stat.st_size, stat.st_mtime_ns) \
        if path.suffix == ".gguf" else ("", "", "")
    return Card("gguf" if path.suffix == ".gguf" else s.engine, family, size_label, quantization, stat.st_size,
                _digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns), stat.st_mtime, model.engine.context_length,
                capabilities, template)


def _digest(*parts: Any) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()
