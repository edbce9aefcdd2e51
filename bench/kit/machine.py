"""Notes on the machine and the code a bench measured, and how busy the CPUs are: on a 2-core machine
one busy core beside a server cuts its throughput many times over, so figures say what else ran."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.kit.paths import ROOT

CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_busy_s() -> float:
    """CPU seconds all processes on the machine have used (from /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def process_cpu_s(pid: int) -> float:
    """CPU seconds one process (all its threads) has used."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def wait_quiet(max_wait: float, exclude_pid: int | None = None, threshold: float = 0.1) -> float:
    """Wait (up to max_wait s) until other processes use under `threshold` cores over 3 s; return their last use."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, own0, self0 = cpu_busy_s(), process_cpu_s(exclude_pid) if exclude_pid else 0.0, time.process_time()
        time.sleep(3.0)
        own = (process_cpu_s(exclude_pid) if exclude_pid else 0.0) - own0
        others = max(0.0, cpu_busy_s() - busy0 - own - (time.process_time() - self0)) / 3.0
        if others < threshold or time.monotonic() >= deadline:
            return others
        log(f"waiting for a quiet machine: other processes use {others:.2f} cores")


def code_state() -> dict[str, Any]:
    """The commit our server ran from, and the files that differed from it (the bench measures the work tree)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip() or None,
            "modified": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line[3:]]}


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform(),
            "python": platform.python_version(), "loadavg": os.getloadavg()}
