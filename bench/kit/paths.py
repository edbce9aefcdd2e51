"""Where the bench keeps things: code in bench/, fleets beside their tables in bench/fleets/, kept run
outputs in bench/runs/, the economics workload in bench/workload/."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent  # the repository
FLEETS = BENCH / "fleets"  # fleet*.toml and the *.knn.npz tables they name
RUNS = BENCH / "runs"
DATA = BENCH / "data"
WORKLOAD = BENCH / "workload"
SPLITS = WORKLOAD / "splits"
CHECKER = WORKLOAD / "check.py"  # loaded by path (appliance's load_checker), as the server loads it
