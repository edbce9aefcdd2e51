"""LoRA adapters on an MLX model without reloading or fusing: the projections an adapter touches
are wrapped once, and each wrapper adds the active adapters' low-rank products at a scale. The
engine switches the active set between steps (one set per step, as in the llama.cpp engine).

Adapters are mlx-lm's format: a folder with `adapter_config.json` and `adapters.safetensors`
(tensors `<module path>.lora_a` of shape (in, rank) and `.lora_b` of shape (rank, out)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engines.interface import EngineError


@dataclass(frozen=True)
class LoraWeights:
    path: Path
    alpha: float  # lora_parameters.scale: what a request's scale 1.0 applies
    pairs: dict[str, tuple[mx.array, mx.array]]  # module path -> (A, B)


def adapter_files(path: Path) -> tuple[Path, Path]:
    """The config and weights of an adapter given as its folder or its safetensors file."""
    folder = path if path.is_dir() else path.parent
    weights = path if path.is_file() else folder / "adapters.safetensors"
    config = folder / "adapter_config.json"
    if not weights.is_file() or not config.is_file():
        raise EngineError(f"{path} is not an mlx-lm LoRA adapter (a folder with adapter_config.json and adapters.safetensors)")
    return config, weights


def read_adapter(path: Path) -> LoraWeights:
    config_file, weights_file = adapter_files(path)
    try:
        config = json.loads(config_file.read_text())
        tensors = mx.load(str(weights_file))
    except (OSError, ValueError, RuntimeError) as exc:
        raise EngineError(f"cannot read the adapter at {path}: {exc}") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise EngineError(f"{config_file}: fine_tune_type {kind!r}: only LoRA adapters can be switched per request")
    alpha = float((config.get("lora_parameters") or {}).get("scale", 20.0))  # mlx-lm's default
    pairs: dict[str, tuple[mx.array, mx.array]] = {}
    for name, a in tensors.items():
        if name.endswith(".lora_a"):
            module = name[: -len(".lora_a")]
            b = tensors.get(module + ".lora_b")
            if b is None or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
                raise EngineError(f"{weights_file}: {module}: lora_a and lora_b do not pair up")
            pairs[module] = (a, b)
    if not pairs:
        raise EngineError(f"{weights_file}: no lora_a/lora_b tensors")
    # MLX arrays are lazy and bound to the thread's stream that made them: evaluate them here, so
    # that the model's thread only ever reads finished arrays.
    mx.eval([t for pair in pairs.values() for t in pair])
    return LoraWeights(path, alpha, pairs)


class _Bank:
    """The wrapper's adapters, held outside the module's parameter tree (so mlx-lm's own walks
    over the model's parameters never see them)."""

    def __init__(self) -> None:
        self.pairs: dict[str, tuple[mx.array, mx.array, float]] = {}  # adapter -> (A, B, alpha)
        self.active: list[tuple[mx.array, mx.array, float]] = []


class AdapterLinear(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.bank = _Bank()

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        for a, b, scale in self.bank.active:
            y = y + (scale * ((x @ a) @ b)).astype(y.dtype)
        return y


class AdapterSet:
    """The adapters loaded on one model, and which of them the next forward pass applies."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._wrappers: dict[str, AdapterLinear] = {}
        self._loaded: dict[str, LoraWeights] = {}
        self.active_key: tuple[tuple[str, float], ...] = ()

    def load(self, name: str, weights: LoraWeights) -> None:
        modules = dict(self.model.named_modules())
        for path, (a, b) in weights.pairs.items():
            target = self._wrappers.get(path) or modules.get(path)
            if target is None:
                raise EngineError(f"{weights.path}: the model has no module {path}")
            out_dim = self._out_features(target.base if isinstance(target, AdapterLinear) else target)
            if out_dim is not None and b.shape[1] != out_dim:
                raise EngineError(f"{weights.path}: {path}: lora_b has {b.shape[1]} outputs, the layer {out_dim}")
        self.unload(name)
        for path, (a, b) in weights.pairs.items():
            wrapper = self._wrappers.get(path)
            if wrapper is None:
                wrapper = AdapterLinear(modules[path])
                self.model.update_modules(tree_unflatten([(path, wrapper)]))
                self._wrappers[path] = wrapper
            dtype = self._dtype(wrapper.base)
            cast = (a.astype(dtype), b.astype(dtype))
            mx.eval(cast)  # see read_adapter: finished arrays only
            wrapper.bank.pairs[name] = (*cast, weights.alpha)
        self._loaded[name] = weights
        self.active_key = ()
        self.activate(())

    def unload(self, name: str) -> None:
        for wrapper in self._wrappers.values():
            wrapper.bank.pairs.pop(name, None)
        self._loaded.pop(name, None)
        if any(n == name for n, _ in self.active_key):
            self.activate(())

    def weights(self, name: str) -> LoraWeights | None:
        """What is loaded under `name` now."""
        return self._loaded.get(name)

    def activate(self, key: tuple[tuple[str, float], ...]) -> None:
        """Applies these adapters at these scales in every following forward pass."""
        for wrapper in self._wrappers.values():
            wrapper.bank.active = [(a, b, alpha * scale) for name, scale in key if name in wrapper.bank.pairs
                                   for a, b, alpha in (wrapper.bank.pairs[name],)]
        self.active_key = key

    @staticmethod
    def _out_features(layer: Any) -> int | None:
        weight = getattr(layer, "weight", None)
        return int(weight.shape[0]) if weight is not None else None

    @staticmethod
    def _dtype(layer: Any) -> mx.Dtype:
        scales = getattr(layer, "scales", None)
        return scales.dtype if scales is not None else layer.weight.dtype
