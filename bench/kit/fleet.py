"""Fleet files (bench/fleets/*.toml) copied into a work folder, and the prices their models charge."""

from __future__ import annotations

from pathlib import Path

import tomlkit
from tomlkit.toml_document import TOMLDocument

from policy.budgets import Price


def fleet_document(fleet: Path) -> TOMLDocument:
    """A fleet file with its relative paths (adapters, calibrations: beside the fleet file) and `~`
    made absolute, so that a copy in a work folder reads the same files."""
    doc = tomlkit.parse(fleet.read_text())
    for model in doc.get("models", []):
        if "path" in model:
            model["path"] = str(Path(str(model["path"])).expanduser())
        for adapter in model.get("adapters", []):
            adapter["path"] = str((fleet.parent / Path(str(adapter["path"])).expanduser()).resolve())
    for route in doc.get("routes", []):
        if "calibration" in route:
            route["calibration"] = str((fleet.parent / str(route["calibration"])).resolve())
    return doc


def fleet_prices(doc: TOMLDocument) -> dict[str, Price]:
    """Each model's price by alias, as the ledger charges it (an adapter costs what its base does)."""
    return {str(m["alias"]): Price.per_million(float(m.get("price_input_per_mtok", 0)), float(m.get("price_output_per_mtok", 0)))
            for m in doc.get("models", [])}
