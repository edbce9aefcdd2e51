"""`appliance doctor`: what a user needs to see when something is off. The checks gather one report
(plain values, `--json` prints it as it is); the text form is drawn from it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from appliance.cli.support import rows_renderable
from appliance.config.settings import ConfigError, Settings, find_config, load_settings
from engines.llamacpp.kernels import TILED_MATMUL_ENV  # needs no llama_cpp, whose absence doctor reports

_INTERESTING = ("avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_flags() -> str:
    """What llama.cpp was compiled with, and what the installer recorded about it."""
    try:
        from engines.llamacpp.runtime import system_info

        info = system_info().strip()
    except Exception as exc:  # an import failure is itself the diagnosis
        return f"llama.cpp not importable: {exc}"
    stamp = Path(sys.prefix) / "appliance-llama-build.txt"
    recorded = stamp.read_text().strip() if stamp.is_file() else "not recorded (not installed by installer/install.sh)"
    return f"{info}\ninstaller build: {recorded}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _devices() -> tuple[dict[str, Any], tuple]:
    """The devices llama.cpp sees and its backends, through the query the engine plans with; and the
    devices it offloads to."""
    try:
        from engines.llamacpp.devices import backends, ggml_devices, gpu_devices, nvidia_smi_devices, supports_offload

        offload = supports_offload()
        found = ggml_devices()
        gpus = gpu_devices()
    except Exception as exc:  # no llama_cpp: build_flags already says why
        return {"error": f"cannot ask llama.cpp ({exc})"}, ()
    listed = [{**dataclasses.asdict(d), "offloads_layers": d in gpus} for d in (found if found is not None else gpus)]
    unused = [d.description for d in nvidia_smi_devices()] if not offload else []
    return {"backends": list(backends()), "gpu_offload": offload, "devices": listed, "nvidia_gpus_unused": unused}, gpus


def _memory(settings: Settings, gpus: tuple) -> list[dict[str, Any]]:
    """Each local model's estimated memory, as the server budgets it (registry.memory_need), and the
    layers a llama.cpp model would offload now."""
    from appliance.fleet.files import ModelFileError, resolve
    from appliance.fleet.memory import ModelShapeError, gpu_plan, mlx_estimate, model_estimate, onnx_memory
    from appliance.fleet.registry import engine_for, memory_need

    rows = []
    for m in settings.models:
        if m.engine == "openai":
            continue
        engine = engine_for(m)
        row: dict[str, Any] = {"alias": m.alias, "engine": engine, "slots": m.slots}
        try:
            if engine == "mlx" and not (m.path is not None and m.path.is_dir()):
                # memory_need would convert the GGUF first: that is the first load's work, not a check's
                rows.append({**row, "error": "estimated once converted for MLX (at its first load)"})
                continue
            if engine == "mlx":
                e: Any = mlx_estimate(m.path, m.slots, m.context_length)  # type: ignore[arg-type]
            else:
                file = resolve(m, settings.server.data_dir)
                e = onnx_memory(file.stat().st_size, m.batch_tokens, m.context_length) if engine == "onnx" else model_estimate(m, file)
            total = memory_need(m, settings)
        except (ModelFileError, ModelShapeError, OSError) as exc:
            rows.append({**row, "error": str(exc)})
            continue
        row.update(weights_bytes=e.weights, kv_bytes=e.kv, other_bytes=e.compute + e.overhead, total_bytes=total)
        if engine == "llamacpp":
            plan = gpu_plan(m, file, gpus)
            row.update(gpu_layers=plan.gpu_layers, configured_gpu_layers=m.gpu_layers, why=plan.reason)
        elif engine == "onnx":
            row["why"] = f"the session, and one pass of {m.batch_tokens} padded tokens at its widest (a lower batch_tokens holds less)"
        rows.append(row)
    return rows


def _probe(base_url: str, key_env: str | None) -> dict[str, Any]:
    """Whether an upstream answers GET /models with the configured key."""
    import httpx

    key = os.environ.get(key_env) if key_env else None
    found: dict[str, Any] = {"key_env": key_env, "key_set": bool(key)}
    try:
        response = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=5, trust_env=False)
    except httpx.HTTPError as exc:
        return {**found, "answers": False, "why": type(exc).__name__}
    if response.status_code in (401, 403):
        return {**found, "answers": False, "why": f"HTTP {response.status_code}, the key is refused"}
    return {**found, "answers": response.status_code < 500, "why": None if response.status_code < 500 else f"HTTP {response.status_code}"}


def report(config: Path | None) -> dict[str, Any]:
    """Every check's finding, as plain values; `ok` is False where one found a problem."""
    found: dict[str, Any] = {"ok": True, "machine": {"system": platform.system(), "machine": platform.machine(),
                                                      "python": platform.python_version()}}
    flags = cpu_flags()
    found["cpu_features"] = [f for f in _INTERESTING if f in flags]
    found["llama_cpp"] = build_flags()
    found["llama_cpp_devices"], gpus = _devices()
    engines = []
    for name, module in (("llamacpp", "llama_cpp"), ("mlx", "mlx.core"), ("mlx-lm", "mlx_lm"), ("onnx", "onnxruntime")):
        importable = importlib.util.find_spec(module.split(".")[0]) is not None
        engines.append({"engine": name, "importable": importable,
                        "runs_here": importable and (name in ("llamacpp", "onnx") or platform.system() in ("Darwin", "Linux"))})
    found["engines"] = engines
    try:
        path = find_config(config)
        settings = load_settings(path)
    except ConfigError as exc:
        return {**found, "ok": False, "config_error": str(exc)}
    found["config"], found["data_dir"] = str(path.resolve()), str(settings.server.data_dir)
    invariant = [m.alias for m in settings.models if m.engine == "llamacpp" and m.batch_invariant]
    tiled = os.environ.get(TILED_MATMUL_ENV)
    found["kernels"] = {"batch_invariant_models": invariant, TILED_MATMUL_ENV: tiled,
                        "problem": bool(invariant) and tiled not in (None, "0")}
    found["ok"] &= not found["kernels"]["problem"]
    from appliance.fleet.files import ModelFileError, resolve, sha256

    models = []
    for m in settings.models:
        if m.engine == "openai":
            continue  # listed with their reachability below
        try:
            file = resolve(m, settings.server.data_dir)
            digest = sha256(file)
            models.append({"alias": m.alias, "file": str(file), "size_bytes": file.stat().st_size, "sha256": digest,
                           "matches_config": None if m.sha256 is None else digest == m.sha256})
        except ModelFileError as exc:
            models.append({"alias": m.alias, "error": str(exc)})
    found["models"] = models
    found["ok"] &= all("error" not in m and m["matches_config"] is not False for m in models)
    found["memory"] = _memory(settings, gpus)
    upstreams = [{"alias": m.alias, "upstream": u.name, "url": u.base_url, **_probe(u.base_url, u.api_key_env)}
                 for m in settings.models if m.engine == "openai" for u in m.upstreams]
    found["upstreams"] = upstreams
    found["ok"] &= all(u["answers"] for u in upstreams)
    from appliance.server.run import port_free

    found["port"] = {"host": settings.server.host, "port": settings.server.port,
                     "free": port_free(settings.server.host, settings.server.port)}
    return found


def _show(console: Console, found: dict[str, Any]) -> None:
    def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
        console.print(rows_renderable(header, rows, console.width))

    machine = found["machine"]
    console.print(f"[bold]machine[/bold]: {machine['system']} {machine['machine']}, Python {machine['python']}")
    if found["cpu_features"]:
        console.print("[bold]cpu features[/bold]: " + " ".join(found["cpu_features"]))
        if "amx_tile" in found["cpu_features"]:
            console.print("  note: AMX present; llama.cpp's native build crashes in its AMX matmul here, so the installer builds without it")
    console.print(f"[bold]llama.cpp[/bold]: {found['llama_cpp']}")
    devices = found["llama_cpp_devices"]
    if "error" in devices:
        console.print(f"[bold]devices[/bold]: [red]{devices['error']}[/red]")
    else:
        offload = "yes" if devices["gpu_offload"] else "no (a CPU build)"
        console.print(f"[bold]llama.cpp backends[/bold]: {', '.join(devices['backends']) or 'unknown'}; GPU offload: {offload}")
        table(("device", "kind", "description", "free", "total", "offloads layers"),
              [(d["name"], d["kind"], d["description"], _mib(d["free"]), _mib(d["total"]), "yes" if d["offloads_layers"] else "no")
               for d in devices["devices"]])
        if devices["nvidia_gpus_unused"]:
            console.print(f"  [yellow]note[/yellow]: nvidia-smi sees {len(devices['nvidia_gpus_unused'])} NVIDIA GPU(s) "
                          f"({devices['nvidia_gpus_unused'][0]}) that this CPU build of llama.cpp cannot use: reinstall with "
                          "APPLIANCE_GPU=cuda bash installer/install.sh (docs/gpu.md)")
    table(("engine", "importable", "runs here"),
          [(e["engine"], "yes" if e["importable"] else "no", "yes" if e["runs_here"] else "no") for e in found["engines"]])
    if "config_error" in found:
        console.print(f"[red]config[/red]: {found['config_error']}")
        return
    console.print(f"[bold]config[/bold]: {found['config']}")
    console.print(f"[bold]data dir[/bold]: {found['data_dir']}")
    kernels = found["kernels"]
    if kernels["problem"]:
        console.print(f"[red]kernels[/red]: {TILED_MATMUL_ENV}={kernels[TILED_MATMUL_ENV]} in the environment: K-quant models among "
                      f"{', '.join(kernels['batch_invariant_models'])} are not batch-invariant (unset it; docs/architecture.md, Batch invariance)")
    else:
        console.print("[bold]kernels[/bold]: K-quant tiled matmul " + ("off (batch-invariant models)" if kernels["batch_invariant_models"] else "on"))

    def matches(m: dict[str, Any]) -> str:
        return "-" if m["matches_config"] is None else "yes" if m["matches_config"] else "[red]NO[/red]"

    table(("alias", "file", "size", "sha256", "matches config"),
          [(m["alias"], f"[red]{m['error']}[/red]", "", "", "") if "error" in m else
           (m["alias"], m["file"], f"{m['size_bytes'] / 1e6:.1f} MB", m["sha256"], matches(m)) for m in found["models"]])
    if found["memory"]:
        console.print("[bold]memory[/bold] (estimated, as the server budgets it; docs/gpu.md)")
        table(("alias", "engine", "slots", "weights", "KV cache", "compute, other", "total", "gpu_layers", "why"),
              [(r["alias"], r["engine"], str(r["slots"]), f"[red]{r['error']}[/red]", "", "", "", "", "") if "error" in r else
               (r["alias"], r["engine"], str(r["slots"]), _mib(r["weights_bytes"]), _mib(r["kv_bytes"]), _mib(r["other_bytes"]),
                _mib(r["total_bytes"]), f"{r['gpu_layers']} ({r['configured_gpu_layers']})" if "gpu_layers" in r else "-", r.get("why", ""))
               for r in found["memory"]])
    if found["upstreams"]:
        def key(u: dict[str, Any]) -> str:
            return "-" if u["key_env"] is None else f"${u['key_env']} set" if u["key_set"] else f"[red]${u['key_env']} not set[/red]"

        table(("alias", "upstream", "url", "key", "answers"),
              [(u["alias"], u["upstream"], u["url"], key(u), "yes" if u["answers"] else f"[red]no: {u['why']}[/red]") for u in found["upstreams"]])
    port = found["port"]
    console.print(f"[bold]port[/bold]: {port['host']}:{port['port']} {'free' if port['free'] else '[yellow]in use[/yellow]'}")


def run_doctor(config: Path | None, as_json: bool = False) -> int:
    found = report(config)
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        _show(Console(width=None if sys.stdout.isatty() else 200), found)
    return 0 if found["ok"] else 1
