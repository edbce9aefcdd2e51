"""`appliance doctor`: what a user needs to see when something is off."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

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


def _devices(console: Console) -> tuple:
    """The devices llama.cpp sees and its backends, through the query the engine plans with."""
    try:
        from engines.llamacpp.devices import backends, ggml_devices, gpu_devices, nvidia_smi_devices, supports_offload

        offload = supports_offload()
        found = ggml_devices()
        gpus = gpu_devices()
    except Exception as exc:  # no llama_cpp: build_flags above already says why
        console.print(f"[bold]devices[/bold]: [red]cannot ask llama.cpp ({exc})[/red]")
        return ()
    console.print(f"[bold]llama.cpp backends[/bold]: {', '.join(backends()) or 'unknown'}; GPU offload: {'yes' if offload else 'no (a CPU build)'}")
    table = Table("device", "kind", "description", "free", "total", "offloads layers")
    for d in found if found is not None else gpus:
        table.add_row(d.name, d.kind, d.description, _mib(d.free), _mib(d.total), "yes" if d in gpus else "no")
    console.print(table)
    if not offload:
        nvidia = nvidia_smi_devices()
        if nvidia:
            console.print(f"  [yellow]note[/yellow]: nvidia-smi sees {len(nvidia)} NVIDIA GPU(s) ({nvidia[0].description}) that this "
                          "CPU build of llama.cpp cannot use: reinstall with APPLIANCE_GPU=cuda bash installer/install.sh (docs/gpu.md)")
    return gpus


def _memory(console: Console, settings: Settings, gpus: tuple) -> None:
    """Each local llama.cpp model's estimated memory and the layers it would offload now."""
    from appliance.fleet.files import ModelFileError, resolve
    from appliance.fleet.memory import ModelShapeError, gpu_plan, model_estimate
    from appliance.fleet.registry import engine_for

    table = Table("alias", "weights", "KV cache", "compute", "total", "gpu_layers", "why")
    for m in settings.models:
        if m.engine == "openai" or engine_for(m) != "llamacpp":
            continue
        try:
            file = resolve(m, settings.server.data_dir)
            e = model_estimate(m, file)
        except (ModelFileError, ModelShapeError) as exc:
            table.add_row(m.alias, f"[red]{exc}[/red]", "", "", "", "", "")
            continue
        plan = gpu_plan(m, file, gpus)
        table.add_row(m.alias, _mib(e.weights), _mib(e.kv), _mib(e.compute), _mib(e.total), f"{plan.gpu_layers} ({m.gpu_layers})", plan.reason)
    if table.row_count:
        console.print("[bold]memory[/bold] (estimated; docs/gpu.md)")
        console.print(table)


def _probe(base_url: str, key_env: str | None) -> tuple[str, str]:
    """Whether an upstream answers GET /models with the configured key: (key state, answer)."""
    import httpx

    key = os.environ.get(key_env) if key_env else None
    key_state = "-" if key_env is None else (f"${key_env} set" if key else f"[red]${key_env} not set[/red]")
    try:
        response = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=5, trust_env=False)
    except httpx.HTTPError as exc:
        return key_state, f"[red]no: {type(exc).__name__}[/red]"
    if response.status_code in (401, 403):
        return key_state, f"[red]no: HTTP {response.status_code}, the key is refused[/red]"
    return key_state, "yes" if response.status_code < 500 else f"[red]no: HTTP {response.status_code}[/red]"


def run_doctor(config: Path | None) -> int:
    console = Console(width=None if sys.stdout.isatty() else 200)
    ok = True
    console.print(f"[bold]machine[/bold]: {platform.system()} {platform.machine()}, Python {platform.python_version()}")
    flags = cpu_flags()
    if flags:
        console.print("[bold]cpu features[/bold]: " + " ".join(f for f in _INTERESTING if f in flags))
        if "amx_tile" in flags:
            console.print("  note: AMX present; llama.cpp's native build crashes in its AMX matmul here, so the installer builds without it")
    console.print(f"[bold]llama.cpp[/bold]: {build_flags()}")
    gpus = _devices(console)
    engines = Table("engine", "importable", "runs here")
    for name, module in (("llamacpp", "llama_cpp"), ("mlx", "mlx.core"), ("mlx-lm", "mlx_lm")):
        found = importlib.util.find_spec(module.split(".")[0]) is not None
        runs = found and (name == "llamacpp" or platform.system() in ("Darwin", "Linux"))
        engines.add_row(name, "yes" if found else "no", "yes" if runs else "no")
    console.print(engines)
    try:
        path = find_config(config)
        settings = load_settings(path)
    except ConfigError as exc:
        console.print(f"[red]config[/red]: {exc}")
        return 1
    console.print(f"[bold]config[/bold]: {path.resolve()}")
    console.print(f"[bold]data dir[/bold]: {settings.server.data_dir}")
    invariant = [m.alias for m in settings.models if m.engine == "llamacpp" and m.batch_invariant]
    tiled = os.environ.get(TILED_MATMUL_ENV)
    if invariant and tiled not in (None, "0"):
        ok = False
        console.print(f"[red]kernels[/red]: {TILED_MATMUL_ENV}={tiled} in the environment: K-quant models among "
                      f"{', '.join(invariant)} are not batch-invariant (unset it; docs/architecture.md, Batch invariance)")
    else:
        console.print("[bold]kernels[/bold]: K-quant tiled matmul " + ("off (batch-invariant models)" if invariant else "on"))
    from appliance.fleet.files import ModelFileError, resolve, sha256

    models = Table("alias", "file", "size", "sha256", "matches config")
    for m in settings.models:
        if m.engine == "openai":
            continue  # listed with their reachability below
        try:
            file = resolve(m, settings.server.data_dir)
            digest = sha256(file)
            match = "-" if m.sha256 is None else ("yes" if digest == m.sha256 else "[red]NO[/red]")
            ok &= match != "[red]NO[/red]"
            models.add_row(m.alias, str(file), f"{file.stat().st_size / 1e6:.1f} MB", digest, match)
        except ModelFileError as exc:
            ok = False
            models.add_row(m.alias, f"[red]{exc}[/red]", "", "", "")
    console.print(models)
    _memory(console, settings, gpus)
    upstream = [m for m in settings.models if m.engine == "openai"]
    if upstream:
        reach = Table("alias", "upstream", "url", "key", "answers")
        for m in upstream:
            for u in m.upstreams:
                key, answer = _probe(u.base_url, u.api_key_env)
                ok &= answer.startswith("yes")
                reach.add_row(m.alias, u.name, u.base_url, key, answer)
        console.print(reach)
    from appliance.server.run import port_free

    free = port_free(settings.server.host, settings.server.port)
    console.print(f"[bold]port[/bold]: {settings.server.host}:{settings.server.port} {'free' if free else '[yellow]in use[/yellow]'}")
    return 0 if ok else 1
