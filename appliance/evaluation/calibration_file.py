"""A route's calibration on disk: written by `appliance eval calibrate` from an eval run's per-question
results, read once with the config (`[[routes]] calibration = "PATH"`). TOML, so an operator can read
and adjust it; the writer is here because the format is small and fixed (tomllib only reads). A
learned router's labelled table is numbers, so it lies beside the TOML as a NumPy `.npz` (no pickles)
named by the TOML's `[knn] table`."""

from __future__ import annotations

import io
import json
import math
import tomllib
import zipfile
from pathlib import Path

import numpy as np

from policy.router import BucketChoice, Calibration
from policy.router_knn import FEATURE_COLUMNS, Knn, KnnSettings, train


class CalibrationError(ValueError):
    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


def to_toml(calibration: Calibration, note: str, table: str | None = None) -> str:
    def array(values: tuple) -> str:
        return "[" + ", ".join(json.dumps(v) for v in values) + "]"

    lines = [f"# {line}" for line in note.splitlines()]
    lines += [f"tiers = {array(calibration.tiers)}", f"keep = {calibration.keep}"]
    if calibration.bucket_keep is not None:
        lines.append(f"bucket_keep = {calibration.bucket_keep}  # the buckets' tiers were chosen at this keep; the table's threshold is keep")
    lines.append(f"min_samples = {calibration.min_samples}")
    if calibration.accuracy:
        lines += [f"samples = {calibration.samples}", f"accuracy = {array(calibration.accuracy)}",
                  f"cost_nanousd = {array(calibration.cost_nanos)}"]
    lines.append("")
    if calibration.knn is not None and table is not None:
        s = calibration.knn.settings
        lines += ["[knn]", f"table = {json.dumps(table)}  # beside this file", f"embedder = {json.dumps(calibration.knn.embedder)}",
                  f"k = {s.k}", f"floor = {s.floor}", f"min_neighbours = {s.min_neighbours}", f"feature_weight = {s.feature_weight}",
                  f"sharpness = {s.sharpness}", f"prior = {s.prior}"]
        if s.task:
            lines.append("task = true  # each text starts with the system turn's task line")
        lines.append("")
    for name, choice in calibration.choices:
        lines += [f"[buckets.{json.dumps(name)}]", f"tier = {choice.tier}  # {calibration.tiers[choice.tier]}",
                  f"samples = {choice.samples}", f"accuracy = {array(choice.accuracy)}",
                  f"cost_nanousd = {array(choice.cost_nanos)}", ""]
    return "\n".join(lines)


def table_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}.knn.npz")


def write(path: Path, calibration: Calibration, note: str) -> None:
    table = None
    if calibration.knn is not None:
        knn, npz = calibration.knn, table_path(path)
        tmp_table = npz.with_name(npz.name + ".tmp")
        with tmp_table.open("wb") as fh:
            np.savez(fh, vectors=knn.vectors, features=knn.features, correct=knn.correct.astype(np.uint8),
                     cost_nanousd=knn.cost_nanos, texts=np.array(knn.texts, dtype=str))
        tmp_table.replace(npz)  # the table first: the TOML that names it is written last
        table = npz.name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_toml(calibration, note, table))
    tmp.replace(path)  # a reader never sees half a file


def read(path: Path) -> Calibration:
    """Raises CalibrationError naming the key at fault."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise CalibrationError("(file)", f"cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CalibrationError("(syntax)", str(exc)) from None
    known = ("tiers", "keep", "bucket_keep", "min_samples", "samples", "accuracy", "cost_nanousd", "knn", "buckets")
    unknown = set(raw) - set(known)
    if unknown:
        raise CalibrationError(min(unknown), f"unknown key (expected {', '.join(known)})")
    tiers = raw.get("tiers")
    if not isinstance(tiers, list) or not tiers or not all(isinstance(t, str) for t in tiers):
        raise CalibrationError("tiers", "expected a non-empty list of model aliases, cheapest first")
    keep, bucket_keep = raw.get("keep", 0.9), raw.get("bucket_keep")
    for name, value in (("keep", keep), ("bucket_keep", keep if bucket_keep is None else bucket_keep)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise CalibrationError(name, f"expected a number in (0, 1], got {value!r}")
    min_samples = raw.get("min_samples", 4)
    if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
        raise CalibrationError("min_samples", f"expected a positive integer, got {min_samples!r}")
    buckets = raw.get("buckets", {})
    if not isinstance(buckets, dict):
        raise CalibrationError("buckets", "expected tables: [buckets.\"NAME\"]")
    choices = []
    for name, table in sorted(buckets.items()):
        key = f"buckets.{json.dumps(name)}"
        if not isinstance(table, dict):
            raise CalibrationError(key, "expected a table")
        tier, samples = table.get("tier"), table.get("samples", 0)
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier < len(tiers):
            raise CalibrationError(f"{key}.tier", f"expected a tier index from 0 to {len(tiers) - 1}, got {tier!r}")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise CalibrationError(f"{key}.samples", f"expected a count, got {samples!r}")
        numbers = {}
        for field in ("accuracy", "cost_nanousd"):
            values = table.get(field, [0.0] * len(tiers))
            if not isinstance(values, list) or len(values) != len(tiers) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                raise CalibrationError(f"{key}.{field}", f"expected {len(tiers)} numbers, one per tier")
            numbers[field] = tuple(float(v) for v in values)
        choices.append((name, BucketChoice(tier, samples, numbers["accuracy"], numbers["cost_nanousd"])))
    samples = raw.get("samples", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise CalibrationError("samples", f"expected a count, got {samples!r}")
    measured = {field: _numbers(raw, field, len(tiers)) if field in raw else () for field in ("accuracy", "cost_nanousd")}
    knn = _knn(raw["knn"], path, len(tiers)) if "knn" in raw else None
    return Calibration(tuple(tiers), float(keep), min_samples, tuple(choices), knn, samples, measured["accuracy"], measured["cost_nanousd"],
                       None if bucket_keep is None else float(bucket_keep))


def _numbers(table: dict, field: str, count: int, key: str | None = None) -> tuple[float, ...]:
    values = table.get(field)
    if not isinstance(values, list) or len(values) != count or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise CalibrationError(key or field, f"expected {count} numbers, one per tier")
    return tuple(float(v) for v in values)


_KNN_KEYS = {"table": str, "embedder": str, "k": int, "floor": float, "min_neighbours": int, "feature_weight": float,
             "sharpness": float, "prior": float, "task": bool}
_ARRAYS = ("vectors", "features", "correct", "cost_nanousd", "texts")


def _knn(table: object, path: Path, tiers: int) -> Knn:
    if not isinstance(table, dict):
        raise CalibrationError("knn", "expected a table: [knn]")
    unknown = set(table) - set(_KNN_KEYS)
    if unknown:
        raise CalibrationError(f"knn.{min(unknown)}", f"unknown key (expected {', '.join(_KNN_KEYS)})")
    for key in ("table", "embedder"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise CalibrationError(f"knn.{key}", "expected a non-empty string")
    defaults = KnnSettings()
    values: dict[str, int | float] = {}
    for key, kind in _KNN_KEYS.items():
        if kind is str:
            continue
        if kind is bool:
            value = table.get(key, getattr(defaults, key))
            if not isinstance(value, bool):
                raise CalibrationError(f"knn.{key}", f"expected true or false, got {value!r}")
            values[key] = value
            continue
        value = table.get(key, getattr(defaults, key))
        ok = not isinstance(value, bool) and (isinstance(value, int) if kind is int else isinstance(value, int | float) and math.isfinite(value))
        limits = {"k": (1, None), "min_neighbours": (1, None), "floor": (-1, 1), "feature_weight": (0, 1), "sharpness": (0, None), "prior": (0, None)}[key]
        if not ok or value < limits[0] or (limits[1] is not None and value > limits[1]):
            span = f"from {limits[0]}" + (f" to {limits[1]}" if limits[1] is not None else "")
            raise CalibrationError(f"knn.{key}", f"expected {'an integer' if kind is int else 'a number'} {span}, got {value!r}")
        values[key] = value
    npz = path.parent / table["table"]

    def bad(problem: str) -> CalibrationError:
        return CalibrationError("knn.table", f"{npz}: {problem}")

    try:
        with np.load(npz, allow_pickle=False) as data:
            missing = [name for name in _ARRAYS if name not in data.files]
            if missing:
                raise bad(f"{missing[0]}: missing (expected arrays {', '.join(_ARRAYS)})")
            arrays = {name: data[name] for name in _ARRAYS}
    except OSError as exc:
        raise bad(f"cannot read: {exc.strerror or exc}") from None
    except (ValueError, zipfile.BadZipFile, EOFError, io.UnsupportedOperation) as exc:
        raise bad(f"not a NumPy .npz without pickles ({exc})") from None
    vectors, features, correct, cost, texts = (arrays[name] for name in _ARRAYS)
    n = len(texts)
    checks = (
        ("texts", texts.ndim == 1 and texts.dtype.kind == "U", "expected a list of strings"),
        ("vectors", vectors.ndim == 2 and vectors.shape[0] == n and vectors.shape[1] > 0 and vectors.dtype.kind == "f",
         f"expected {n} rows of floats, one per labelled request"),
        ("features", features.ndim == 2 and features.shape == (n, len(FEATURE_COLUMNS)) and features.dtype.kind == "f",
         f"expected {n} rows of {len(FEATURE_COLUMNS)} floats ({', '.join(FEATURE_COLUMNS)})"),
        ("correct", correct.ndim == 2 and correct.shape == (n, tiers) and correct.dtype.kind in "biu" and bool(np.isin(correct, (0, 1)).all()),
         f"expected {n} rows of {tiers} 0/1 values, one column per tier"),
        ("cost_nanousd", cost.ndim == 2 and cost.shape == (n, tiers) and cost.dtype.kind in "fiu",
         f"expected {n} rows of {tiers} numbers, one column per tier"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise bad(f"{name}: {expected}, got shape {arrays[name].shape} of {arrays[name].dtype}")
    for name in ("vectors", "features", "cost_nanousd"):
        if not np.isfinite(arrays[name]).all():
            raise bad(f"{name}: not every value is a finite number")
    if n and (np.linalg.norm(vectors, axis=1) < 1e-6).any():
        raise bad("vectors: a row of zeros (every labelled request needs its embedding)")
    settings = KnnSettings(**values)  # type: ignore[arg-type]
    return train(vectors, features, correct, cost, tuple(str(t) for t in texts), str(table["embedder"]), settings)
