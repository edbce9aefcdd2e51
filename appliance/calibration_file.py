"""A route's calibration on disk: written by `appliance eval calibrate` from an eval run's per-question
results, read once with the config (`[[routes]] calibration = "PATH"`). TOML, so an operator can read
and adjust it; the writer is here because the format is small and fixed (tomllib only reads)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from policy.router import BucketChoice, Calibration


class CalibrationError(ValueError):
    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"{key}: {problem}")


def to_toml(calibration: Calibration, note: str) -> str:
    def array(values: tuple) -> str:
        return "[" + ", ".join(json.dumps(v) for v in values) + "]"

    lines = [f"# {line}" for line in note.splitlines()]
    lines += [f"tiers = {array(calibration.tiers)}", f"keep = {calibration.keep}", f"min_samples = {calibration.min_samples}", ""]
    for name, choice in calibration.choices:
        lines += [f"[buckets.{json.dumps(name)}]", f"tier = {choice.tier}  # {calibration.tiers[choice.tier]}",
                  f"samples = {choice.samples}", f"accuracy = {array(choice.accuracy)}",
                  f"cost_nanousd = {array(choice.cost_nanos)}", ""]
    return "\n".join(lines)


def write(path: Path, calibration: Calibration, note: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_toml(calibration, note))
    tmp.replace(path)  # a reader never sees half a file


def read(path: Path) -> Calibration:
    """Raises CalibrationError naming the key at fault."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise CalibrationError("(file)", f"cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CalibrationError("(syntax)", str(exc)) from None
    unknown = set(raw) - {"tiers", "keep", "min_samples", "buckets"}
    if unknown:
        raise CalibrationError(sorted(unknown)[0], "unknown key (expected tiers, keep, min_samples, buckets)")
    tiers = raw.get("tiers")
    if not isinstance(tiers, list) or not tiers or not all(isinstance(t, str) for t in tiers):
        raise CalibrationError("tiers", "expected a non-empty list of model aliases, cheapest first")
    keep = raw.get("keep", 0.9)
    if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0 < keep <= 1:
        raise CalibrationError("keep", f"expected a number in (0, 1], got {keep!r}")
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
    return Calibration(tuple(tiers), float(keep), min_samples, tuple(choices))
