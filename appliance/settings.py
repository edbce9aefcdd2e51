"""Typed settings parsed once from `models.toml`.

Every error names the file and the dotted key, so a user can fix it without reading code.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import calibration_file
from appliance.paths import default_data_dir
from policy.limits import LIMIT_LEVELS, LimitRule
from policy.router import Calibration

# openai: a model served by another server (engines/upstream); onnx: an embedding model run by onnxruntime
ENGINES = ("llamacpp", "mlx", "auto", "openai", "onnx")
KINDS = ("chat", "embedding", "draft")  # a draft model is loaded only inside the models it drafts for
POOLINGS = ("auto", "mean", "cls", "last")  # auto: what the model file declares (engines/embedding.py)
SPECULATION = ("auto", "off", "prompt_lookup", "draft")
TIERS = ("small", "mid", "frontier")
KV_CACHE_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
UNQUANTIZED_KV = ("f16", "bf16")
METRICS_AUTH = ("none", "admin")  # who may read /metrics: anyone who reaches the port, or admin keys


class ConfigError(ValueError):
    """A problem in a config file; `str()` is the one-line message shown to the user."""

    def __init__(self, file: str, key: str, problem: str) -> None:
        self.file, self.key, self.problem = file, key, problem
        super().__init__(f"{file}: {key}: {problem}")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    data_dir: Path = field(default_factory=default_data_dir)
    max_body_bytes: int = 4 * 1024 * 1024
    # Requests waiting for a slot, per model, before new ones get 503 + Retry-After.
    max_queue: int = 64
    shutdown_grace_s: float = 10.0
    # "normal": ledger commits survive a crashed process, not always a power cut; "full": both.
    sqlite_synchronous: str = "normal"
    # Folders besides data_dir whose files the admin API may name (adapters, quantize sources);
    # a path from the API that resolves anywhere else is refused.
    model_dirs: tuple[Path, ...] = ()
    # "none" keeps a loopback Prometheus working without a key; "admin" once the port is reachable
    # by others (per-model traffic, queue depths and spend are in the scrape).
    metrics_auth: str = "none"

    @property
    def api_path_roots(self) -> tuple[Path, ...]:
        return (self.data_dir, *self.model_dirs)


@dataclass(frozen=True)
class Defaults:
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class AdapterSettings:
    name: str  # requests pick it as `model: "<alias>:<name>"` or with the `adapters` field
    path: Path
    scale: float = 1.0


@dataclass(frozen=True)
class UpstreamSettings:
    """One OpenAI-compatible server behind an alias of engine "openai"."""

    name: str  # shown in errors, metrics and the admin API
    base_url: str  # up to and including /v1
    model: str  # the model's name on that server
    api_key_env: str | None = None  # the environment variable holding its key; never the key itself


@dataclass(frozen=True)
class UpstreamTuning:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # the longest silence before the first token or between two
    max_retries: int = 2  # before any token was streamed only
    retry_backoff_s: float = 0.25
    breaker_failures: int = 3
    breaker_cooldown_s: float = 30.0
    health_interval_s: float = 15.0


@dataclass(frozen=True)
class ModelSettings:
    alias: str
    engine: str
    kind: str
    # Exactly one source: a local path, a file inside an installed Python package, or a hub file.
    path: Path | None
    package_file: str | None
    hf_repo: str | None
    hf_file: str | None
    context_length: int  # per slot
    slots: int
    threads: int
    batch_tokens: int
    chat_template: str | None
    price_input_per_mtok: float
    price_output_per_mtok: float
    tier: str
    sha256: str | None = None
    prefills_per_step: int = 1  # prompts one slot-loop step advances; 0: as many as batch_tokens holds
    # Batch invariance: identical greedy output whatever shares the batch. Costs some speed.
    batch_invariant: bool = True
    kv_cache_type: str = "q8_0"
    # K and V may differ (kv_cache_type_k / kv_cache_type_v); both default to kv_cache_type.
    kv_cache_type_v: str = "q8_0"
    # Reuse KV of earlier prompts' prefixes across requests and slots (docs/architecture.md).
    prefix_cache: bool = True
    # Host RAM for prefixes evicted from the KV cache, LRU by bytes; 0 turns that tier off.
    prefix_cache_host_mb: int = 256
    # Speculative decoding: "auto" is "draft" when draft_model is set, else "off".
    speculation: str = "auto"
    draft_model: str | None = None  # the alias of another [[models]] entry
    speculation_max_tokens: int = 8
    speculation_fixed_tokens: int = 0  # 0: draft as many tokens as pay, measured per slot
    adapters: tuple[AdapterSettings, ...] = ()  # LoRA adapters loaded at start
    # engine = "openai": the servers that run it, spread by least outstanding requests.
    upstreams: tuple[UpstreamSettings, ...] = ()
    upstream: UpstreamTuning = field(default_factory=UpstreamTuning)
    # kind = "embedding": how token states become a vector, whether vectors are unit length, and
    # whether a request's `dimensions` may keep the first n (a model trained Matryoshka-style).
    pooling: str = "auto"
    normalize: bool = True
    matryoshka: bool = False
    # engine = "onnx": the tokenizer (tokenizer.json or a WordPiece vocab.txt), a path or a package file.
    tokenizer: Path | None = None
    tokenizer_package_file: str | None = None

    @property
    def speculation_mode(self) -> str:
        if self.speculation == "auto":
            return "draft" if self.draft_model else "off"
        return self.speculation


@dataclass(frozen=True)
class OpenPrincipal:
    user: str = "local"
    tenant: str = "local"
    app: str = "local"
    role: str = "developer"
    admin: bool = False


@dataclass(frozen=True)
class AuthSettings:
    # "keys": every API request needs a key. "open": no key, every request is `open_principal`;
    # only when the config says so, for local development.
    mode: str = "keys"
    open_principal: OpenPrincipal = field(default_factory=OpenPrincipal)
    # How long a checked key is trusted before it is looked up again (a revocation by the CLI
    # takes effect within this; one through the admin API takes effect at once).
    key_cache_s: float = 5.0


@dataclass(frozen=True)
class BudgetSettings:
    enabled: bool = True
    # A reservation's lease; running requests renew theirs, so only a crashed process's expire.
    lease_s: float = 300.0
    # When a level cannot cover max_tokens, lower it to what the level can pay for, if that leaves
    # at least `min_tokens`; otherwise refuse.
    clamp_max_tokens: bool = True
    min_tokens: int = 16


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = True
    # "minilm": all-MiniLM-L6-v2 (int8 ONNX, shipped in a package); or the alias of a model of
    # kind "embedding" in this file, served by its engine.
    embedder: str = "minilm"
    # Tuned on tests/data/cache_pairs.jsonl with the near-miss guards (bench/cache_quality.py).
    similarity_threshold: float = 0.70
    judge_band: float = 0.70
    judge_model: str | None = None  # a chat model asked "same answer?" in the band; none: band is a miss
    judge_min_probability: float = 0.85
    freshness_s: float = 7 * 86400
    serve_unverified: bool = True
    max_temperature: float = 0.3
    max_entries_per_tenant: int = 10_000
    sweep_interval_s: float = 300.0  # 0: no background sweeps (POST /admin/cache/sweep still runs one)
    sweep_batch: int = 2
    agree_threshold: float = 0.90  # a re-asked answer this similar to the stored one agrees


@dataclass(frozen=True)
class RouteSettings:
    """A routed alias (for example `model: "auto"`): requests to it are classified and sent to the
    smallest tier that does the job, escalating when an answer fails its validators."""

    alias: str
    tiers: tuple[str, ...]  # chat model aliases, cheapest first
    default_response: str = "I can't give a reliable answer to that right now. Please try again later or rephrase."
    min_confidence: float = 0.0  # geometric-mean token probability an answer needs
    max_repetition: float = 0.5
    classifier_model: str | None = None  # asked for a tier when the heuristics are unsure
    classifier_below: float = 0.6
    cooldown_s: float = 30.0  # a model that failed to serve is skipped this long
    attempt_timeout_s: float = 120.0  # an attempt slower than this is abandoned for the next tier
    role_floor: tuple[tuple[str, str], ...] = ()  # (role, tier name)
    role_ceiling: tuple[tuple[str, str], ...] = ()
    calibration: Calibration | None = None  # measured tier per kind of request (`appliance eval calibrate`)

    def tier_index(self, name: str) -> int:
        """small, mid, frontier onto this route's tiers (frontier is always the last)."""
        if name == "frontier":
            return len(self.tiers) - 1
        return min(len(self.tiers) - 1, ("small", "mid").index(name))


@dataclass(frozen=True)
class TracingSettings:
    # Spans are kept in the appliance's database (GET /admin/traces) ...
    store: bool = True
    retention_days: float = 7.0
    max_spans: int = 500_000
    # ... and, when enabled, exported over OTLP/HTTP (protobuf) to a collector, Jaeger or Tempo.
    enabled: bool = False
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "appliance"
    sample_ratio: float = 1.0
    export_interval_ms: int = 2000


@dataclass(frozen=True)
class Settings:
    file: Path
    server: ServerSettings
    defaults: Defaults
    models: tuple[ModelSettings, ...]
    auth: AuthSettings = field(default_factory=AuthSettings)
    budgets: BudgetSettings = field(default_factory=BudgetSettings)
    limits: tuple[LimitRule, ...] = ()
    cache: CacheSettings = field(default_factory=CacheSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    routes: tuple[RouteSettings, ...] = ()
    # Personal data in a request: "off", "flag" (traced and counted), or "block" (refused, 400).
    guard_pii: str = "flag"
    # An optional LLM judge for text the injection patterns are unsure about: a local chat model's
    # P(yes) to "does this try to instruct the system?"; at or above the threshold the request is
    # flagged, or refused with judge_action = "block". Its tokens are charged like any call.
    guard_judge_model: str | None = None
    guard_judge_action: str = "flag"
    guard_judge_threshold: float = 0.5

    def route(self, alias: str) -> RouteSettings | None:
        return next((r for r in self.routes if r.alias == alias), None)

    def model(self, alias: str) -> ModelSettings | None:
        return next((m for m in self.models if m.alias == alias), None)


class _Reader:
    """Pulls typed values out of one TOML table, naming the dotted key on any error."""

    def __init__(self, file: str, prefix: str, table: dict[str, Any], known: set[str]) -> None:
        self.file, self.prefix, self.table = file, prefix, table
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(file, self.key(unknown[0]), f"unknown key (known keys: {', '.join(sorted(known))})")

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def fail(self, name: str, problem: str) -> ConfigError:
        return ConfigError(self.file, self.key(name), problem)

    def string(self, name: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str | None:
        value = self.table.get(name, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(name, f"expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(name, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(self, name: str, default: int, minimum: int = 1, maximum: int | None = None) -> int:
        value = self.table.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"expected an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise self.fail(name, f"expected an integer {bound}, got {value}")
        return value

    def number(self, name: str, default: float, minimum: float = 0.0, maximum: float | None = None) -> float:
        value = self.table.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, f"expected a number, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
            raise self.fail(name, f"expected a number {bound}, got {value}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.table.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {value!r}")
        return value

    def subtable(self, name: str) -> dict[str, Any]:
        value = self.table.get(name, {})
        if not isinstance(value, dict):
            raise self.fail(name, f"expected a table, got {type(value).__name__}")
        return value


def _server(file: str, table: dict[str, Any], base: Path) -> ServerSettings:
    r = _Reader(file, "server", table, {"host", "port", "data_dir", "max_body_bytes", "max_queue", "shutdown_grace_s", "sqlite_synchronous",
                                         "model_dirs", "metrics_auth"})
    data_dir_text = r.string("data_dir")
    data_dir = default_data_dir()
    if data_dir_text is not None:
        data_dir = (base / os.path.expanduser(data_dir_text)).resolve()
    dirs = table.get("model_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) and d.strip() for d in dirs):
        raise r.fail("model_dirs", f"expected a list of folder paths, got {dirs!r}")
    return ServerSettings(
        host=r.string("host", "127.0.0.1") or "127.0.0.1",
        port=r.integer("port", 8080, minimum=0, maximum=65535),
        data_dir=data_dir,
        max_body_bytes=r.integer("max_body_bytes", 4 * 1024 * 1024, minimum=1024),
        max_queue=r.integer("max_queue", 64, minimum=0),
        shutdown_grace_s=r.number("shutdown_grace_s", 10.0),
        sqlite_synchronous=r.string("sqlite_synchronous", "normal", ("normal", "full")) or "normal",
        model_dirs=tuple((base / os.path.expanduser(d)).resolve() for d in dirs),
        metrics_auth=r.string("metrics_auth", ServerSettings.metrics_auth, METRICS_AUTH) or ServerSettings.metrics_auth,
    )


def _defaults(file: str, table: dict[str, Any]) -> Defaults:
    r = _Reader(file, "defaults", table, {"max_tokens", "temperature", "top_p"})
    return Defaults(
        max_tokens=r.integer("max_tokens", 1024),
        temperature=r.number("temperature", 1.0, maximum=2.0),
        top_p=r.number("top_p", 1.0, maximum=1.0),
    )


def _auth(file: str, table: dict[str, Any]) -> AuthSettings:
    r = _Reader(file, "auth", table, {"mode", "open_principal", "key_cache_s"})
    o = _Reader(file, "auth.open_principal", r.subtable("open_principal"), {"user", "tenant", "app", "role", "admin"})
    principal = OpenPrincipal(
        user=o.string("user", "local") or "local",
        tenant=o.string("tenant", "local") or "local",
        app=o.string("app", "local") or "local",
        role=o.string("role", "developer") or "developer",
        admin=o.boolean("admin", False),
    )
    return AuthSettings(
        mode=r.string("mode", "keys", ("keys", "open")) or "keys",
        open_principal=principal,
        key_cache_s=r.number("key_cache_s", 5.0, maximum=3600.0),
    )


def _budgets(file: str, table: dict[str, Any]) -> BudgetSettings:
    r = _Reader(file, "budgets", table, {"enabled", "lease_s", "clamp_max_tokens", "min_tokens"})
    return BudgetSettings(
        enabled=r.boolean("enabled", True),
        lease_s=r.number("lease_s", 300.0, minimum=1.0),
        clamp_max_tokens=r.boolean("clamp_max_tokens", True),
        min_tokens=r.integer("min_tokens", 16),
    )


def _cache(file: str, table: dict[str, Any]) -> CacheSettings:
    r = _Reader(file, "cache", table, {
        "enabled", "embedder", "similarity_threshold", "judge_band", "judge_model", "judge_min_probability", "freshness_s",
        "serve_unverified", "max_temperature", "max_entries_per_tenant", "sweep_interval_s", "sweep_batch", "agree_threshold",
    })
    threshold = r.number("similarity_threshold", 0.70, maximum=1.0)
    band = r.number("judge_band", threshold, maximum=1.0)
    if band > threshold:
        raise r.fail("judge_band", f"must be at most similarity_threshold ({threshold}), got {band}")
    return CacheSettings(
        enabled=r.boolean("enabled", True),
        embedder=r.string("embedder", "minilm") or "minilm",
        similarity_threshold=threshold,
        judge_band=band,
        judge_model=r.string("judge_model"),
        judge_min_probability=r.number("judge_min_probability", 0.85, maximum=1.0),
        freshness_s=r.number("freshness_s", 7 * 86400.0, minimum=1.0),
        serve_unverified=r.boolean("serve_unverified", True),
        max_temperature=r.number("max_temperature", 0.3, maximum=2.0),
        max_entries_per_tenant=r.integer("max_entries_per_tenant", 10_000),
        sweep_interval_s=r.number("sweep_interval_s", 300.0),
        sweep_batch=r.integer("sweep_batch", 2),
        agree_threshold=r.number("agree_threshold", 0.90, maximum=1.0),
    )


def _tracing(file: str, table: dict[str, Any]) -> TracingSettings:
    r = _Reader(file, "tracing", table, {"enabled", "otlp_endpoint", "service_name", "sample_ratio", "export_interval_ms",
                                         "store", "retention_days", "max_spans"})
    endpoint = r.string("otlp_endpoint", "http://127.0.0.1:4318/v1/traces") or ""
    if not endpoint.startswith(("http://", "https://")):
        raise r.fail("otlp_endpoint", f"expected an http:// or https:// URL, got {endpoint!r}")
    return TracingSettings(
        store=r.boolean("store", True),
        retention_days=r.number("retention_days", 7.0, minimum=0.01),
        max_spans=r.integer("max_spans", 500_000, minimum=100),
        enabled=r.boolean("enabled", False),
        otlp_endpoint=endpoint,
        service_name=r.string("service_name", "appliance") or "appliance",
        sample_ratio=r.number("sample_ratio", 1.0, maximum=1.0),
        export_interval_ms=r.integer("export_interval_ms", 2000, minimum=10),
    )


def _calibration(file: str, key: str, value: str | None, base: Path, tiers: tuple[str, ...]) -> Calibration | None:
    """Read once with the config; a problem names the calibration file and its key, and which route uses it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    try:
        calibration = calibration_file.read(path)
    except calibration_file.CalibrationError as exc:
        raise ConfigError(str(path), exc.key, f"{exc.problem} (the calibration of {file}: {key})") from None
    if calibration.tiers != tiers:
        raise ConfigError(file, key, f"{path} was measured with tiers {list(calibration.tiers)}, this route has {list(tiers)}: "
                                     "remove this key, then run `appliance eval router` and `appliance eval calibrate` again")
    return calibration


def _routes(file: str, raw: object, models: tuple[ModelSettings, ...], base: Path) -> tuple[RouteSettings, ...]:
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(file, "routes", "expected an array of tables: [[routes]]")
    chat = {m.alias for m in models if m.kind == "chat"}
    upstream = {m.alias for m in models if m.engine == "openai"}
    routes = []
    for i, table in enumerate(raw):
        r = _Reader(file, f"routes[{i}]", table, {
            "alias", "tiers", "default_response", "min_confidence", "max_repetition", "classifier_model", "classifier_below",
            "cooldown_s", "role_floor", "role_ceiling", "attempt_timeout_s", "calibration"})
        alias = r.string("alias")
        if alias is None:
            raise r.fail("alias", "missing: the name clients send as `model`, for example \"auto\"")
        if not NAME.match(alias):
            raise r.fail("alias", f"expected {NAME_RULE}, got {alias!r}")
        if alias in {m.alias for m in models}:
            raise r.fail("alias", f"{alias!r} is already a model's alias")
        tiers = table.get("tiers")
        if not isinstance(tiers, list) or not tiers or not all(isinstance(t, str) for t in tiers):
            raise r.fail("tiers", "expected a non-empty list of chat model aliases, cheapest first")
        unknown = [t for t in tiers if t not in chat]
        if unknown:
            raise r.fail("tiers", f"{unknown[0]!r} is not the alias of a chat model in this file")
        classifier = r.string("classifier_model")
        if classifier is not None and classifier not in chat:
            raise r.fail("classifier_model", f"{classifier!r} is not the alias of a chat model in this file")
        if classifier is not None and classifier in upstream:
            raise r.fail("classifier_model", f"{classifier!r} runs upstream; the classifier's answer is forced by a grammar, so it must be a local model")
        bounds = {}
        for key in ("role_floor", "role_ceiling"):
            sub = r.subtable(key)
            for role, tier in sub.items():
                if tier not in TIERS:
                    raise ConfigError(file, f"routes[{i}].{key}.{role}", f"expected one of {', '.join(TIERS)}, got {tier!r}")
            bounds[key] = tuple(sorted(sub.items()))
        calibration = _calibration(file, f"routes[{i}].calibration", r.string("calibration"), base, tuple(tiers))
        routes.append(RouteSettings(
            alias=alias,
            tiers=tuple(tiers),
            default_response=r.string("default_response", RouteSettings.default_response) or RouteSettings.default_response,
            min_confidence=r.number("min_confidence", 0.0, maximum=1.0),
            max_repetition=r.number("max_repetition", 0.5, maximum=1.0),
            classifier_model=classifier,
            classifier_below=r.number("classifier_below", 0.6, maximum=1.0),
            cooldown_s=r.number("cooldown_s", 30.0),
            attempt_timeout_s=r.number("attempt_timeout_s", 120.0, minimum=0.1),
            role_floor=bounds["role_floor"],
            role_ceiling=bounds["role_ceiling"],
            calibration=calibration,
        ))
    aliases = [r.alias for r in routes]
    for i, a in enumerate(aliases):
        if a in aliases[:i]:
            raise ConfigError(file, f"routes[{i}].alias", f"duplicate route {a!r}")
    return tuple(routes)


def _limits(file: str, raw: object) -> tuple[LimitRule, ...]:
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(file, "limits", "expected an array of tables: [[limits]]")
    rules = []
    seen: set[tuple[str, str]] = set()
    for i, table in enumerate(raw):
        r = _Reader(file, f"limits[{i}]", table, {"level", "name", "requests_per_minute", "tokens_per_minute"})
        level = r.string("level", None, LIMIT_LEVELS)
        if level is None:
            raise r.fail("level", f"missing: one of {', '.join(LIMIT_LEVELS)}")
        name = r.string("name", "*") or "*"
        if (level, name) in seen:
            raise r.fail("name", f"a second rule for {level} {name!r}")
        seen.add((level, name))
        rpm = r.integer("requests_per_minute", 0) if "requests_per_minute" in table else None
        tpm = r.integer("tokens_per_minute", 0) if "tokens_per_minute" in table else None
        if rpm is None and tpm is None:
            raise r.fail("requests_per_minute", "give requests_per_minute, tokens_per_minute, or both")
        rules.append(LimitRule(level, name, rpm, tpm))
    return tuple(rules)


_MODEL_KEYS = {
    "alias", "engine", "kind", "path", "package_file", "hf_repo", "hf_file", "sha256", "context_length",
    "slots", "threads", "batch_tokens", "prefills_per_step", "chat_template", "price_input_per_mtok", "price_output_per_mtok",
    "tier", "batch_invariant", "kv_cache_type", "kv_cache_type_k", "kv_cache_type_v", "prefix_cache", "prefix_cache_host_mb",
    "speculation", "draft_model", "speculation_max_tokens", "speculation_fixed_tokens", "adapters",
    "pooling", "normalize", "matryoshka", "tokenizer", "tokenizer_package_file",
}
_EMBEDDING_KEYS = ("pooling", "normalize", "matryoshka", "tokenizer", "tokenizer_package_file")
# engine = "openai" takes these instead of a file and the local engine's knobs.
_UPSTREAM_MODEL_KEYS = {
    "alias", "engine", "kind", "context_length", "price_input_per_mtok", "price_output_per_mtok", "tier",
    "base_url", "upstream_model", "api_key_env", "upstreams", "connect_timeout_s", "read_timeout_s", "max_retries",
    "retry_backoff_s", "breaker_failures", "breaker_cooldown_s", "health_interval_s",
}
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A model's alias, a route's alias and an adapter's name: what clients send as `model` ("alias" or
# "alias:adapter", so no ':'), and what the admin API writes into this file, so nothing TOML could read.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_RULE = "letters, digits, '.', '_' or '-' (no ':'), starting with a letter or digit, up to 64 characters"


def _adapters(file: str, index: int, raw: object, base: Path) -> tuple[AdapterSettings, ...]:
    where = f"models[{index}].adapters"
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(file, where, "expected an array of tables: [[models.adapters]] with name and path")
    out: list[AdapterSettings] = []
    for i, table in enumerate(raw):
        r = _Reader(file, f"{where}[{i}]", table, {"name", "path", "scale"})
        name = r.string("name")
        if name is None or not NAME.match(name):
            raise r.fail("name", f"expected {NAME_RULE}")
        if any(a.name == name for a in out):
            raise r.fail("name", f"a second adapter named {name!r}")
        path = r.string("path")
        if path is None:
            raise r.fail("path", "missing: the adapter's GGUF file")
        out.append(AdapterSettings(name, (base / os.path.expanduser(path)).resolve(), r.number("scale", 1.0, minimum=-10.0, maximum=10.0)))
    return tuple(out)


def _alias(r: _Reader) -> str:
    alias = r.string("alias")
    if alias is None:
        raise r.fail("alias", "missing: every model needs an alias, the name clients send as `model`")
    if not NAME.match(alias):
        raise r.fail("alias", f"expected {NAME_RULE}, got {alias!r}")
    return alias


def _upstream(r: _Reader, default_model: str, name: str) -> UpstreamSettings:
    url = r.string("base_url")
    if url is None:
        raise r.fail("base_url", "missing: the server's OpenAI API root, for example \"http://gpu1:8000/v1\"")
    if not url.startswith(("http://", "https://")):
        raise r.fail("base_url", f"expected an http:// or https:// URL, got {url!r}")
    env = r.string("api_key_env")
    if env is not None and not ENV_NAME.match(env):
        raise r.fail("api_key_env", f"expected the name of an environment variable (the key itself never goes in the file), got {env!r}")
    model = r.string("model" if "model" in r.table else "upstream_model", default_model) or default_model
    url = url.rstrip("/")
    return UpstreamSettings(r.string("name") or name, url, model, env)


def _upstream_model(file: str, index: int, table: dict[str, Any]) -> ModelSettings:
    """A model served by other servers: where they are and how to treat them when they fail."""
    where = f"models[{index}]"
    if "api_key" in table:
        raise ConfigError(file, f"{where}.api_key", "never put a key in the file: name the environment variable that holds it in api_key_env")
    local_only = sorted(set(table) & (_MODEL_KEYS - _UPSTREAM_MODEL_KEYS))
    if local_only:
        raise ConfigError(file, f"{where}.{local_only[0]}", "applies to local engines only; this model has engine = \"openai\"")
    r = _Reader(file, where, table, _UPSTREAM_MODEL_KEYS)
    alias = _alias(r)
    kind = r.string("kind", "chat", KINDS) or "chat"
    if kind != "chat":
        raise r.fail("kind", "an upstream model serves chat completions only")
    upstream_model = r.string("upstream_model", alias) or alias
    listed = table.get("upstreams")
    if listed is not None and "base_url" in table:
        raise r.fail("upstreams", "give base_url for one server or [[models.upstreams]] for several, not both")
    if listed is None:
        if "base_url" not in table:
            raise r.fail("base_url", "missing: an upstream model needs base_url (or [[models.upstreams]] tables)")
        upstreams = (_upstream(_Reader(file, where, {k: table[k] for k in ("base_url", "api_key_env", "upstream_model") if k in table},
                                       {"base_url", "api_key_env", "upstream_model"}), upstream_model, ""),)
    else:
        if not isinstance(listed, list) or not listed or not all(isinstance(t, dict) for t in listed):
            raise r.fail("upstreams", "expected an array of tables: [[models.upstreams]] with base_url (and model, api_key_env, name)")
        if "api_key_env" in table:
            raise r.fail("api_key_env", "with [[models.upstreams]], give api_key_env in each upstream's table")
        upstreams = tuple(
            _upstream(_Reader(file, f"{where}.upstreams[{i}]", t, {"base_url", "model", "api_key_env", "name"}), upstream_model, "")
            for i, t in enumerate(listed))
    named = []
    for i, u in enumerate(upstreams):
        name = u.name or u.base_url.split("://", 1)[1].split("/", 1)[0]
        if name in [n.name for n in named]:
            name = f"{name}#{i}"
        named.append(UpstreamSettings(name, u.base_url, u.model, u.api_key_env))
    tuning = UpstreamTuning(
        connect_timeout_s=r.number("connect_timeout_s", 5.0, minimum=0.05),
        read_timeout_s=r.number("read_timeout_s", 60.0, minimum=0.05),
        max_retries=r.integer("max_retries", 2, minimum=0, maximum=10),
        retry_backoff_s=r.number("retry_backoff_s", 0.25, maximum=60.0),
        breaker_failures=r.integer("breaker_failures", 3, maximum=1000),
        breaker_cooldown_s=r.number("breaker_cooldown_s", 30.0, minimum=0.1),
        health_interval_s=r.number("health_interval_s", 15.0),
    )
    return ModelSettings(
        alias=alias, engine="openai", kind=kind, path=None, package_file=None, hf_repo=None, hf_file=None,
        context_length=r.integer("context_length", 32768, minimum=64), slots=1, threads=1, batch_tokens=1, chat_template=None,
        price_input_per_mtok=r.number("price_input_per_mtok", 0.0), price_output_per_mtok=r.number("price_output_per_mtok", 0.0),
        tier=r.string("tier", "frontier", TIERS) or "frontier", prefix_cache=False, speculation="off",
        upstreams=tuple(named), upstream=tuning,
    )


def _model(file: str, index: int, table: dict[str, Any], base: Path) -> ModelSettings:
    if table.get("engine") == "openai":
        return _upstream_model(file, index, table)
    r = _Reader(file, f"models[{index}]", table, _MODEL_KEYS)
    alias = _alias(r)
    sources = [k for k in ("path", "package_file", "hf_repo") if k in table]
    if len(sources) != 1:
        raise r.fail("path", "give exactly one source: `path`, `package_file`, or `hf_repo` with `hf_file`")
    if ("hf_repo" in table) != ("hf_file" in table):
        raise r.fail("hf_file", "`hf_repo` and `hf_file` go together")
    path_text = r.string("path")
    path = (base / os.path.expanduser(path_text)).resolve() if path_text else None
    template_text = r.string("chat_template")
    template = None
    if template_text is not None:
        # A template may be given inline or as a file next to the config.
        candidate = base / template_text
        template = candidate.read_text() if "{" not in template_text and candidate.is_file() else template_text
    sha = r.string("sha256")
    if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha.lower())):
        raise r.fail("sha256", "expected 64 hexadecimal digits")
    slots = r.integer("slots", 4, maximum=256)
    kv_both = r.string("kv_cache_type", "q8_0", KV_CACHE_TYPES) or "q8_0"
    kv_k = r.string("kv_cache_type_k", kv_both, KV_CACHE_TYPES) or kv_both
    kv_v = r.string("kv_cache_type_v", kv_both, KV_CACHE_TYPES) or kv_both
    invariant = r.boolean("batch_invariant", True)
    engine = r.string("engine", "llamacpp", ENGINES) or "llamacpp"
    kind = r.string("kind", "chat", KINDS) or "chat"
    if engine == "onnx" and kind != "embedding":
        raise r.fail("engine", "the onnx engine serves embedding models only: add kind = \"embedding\"")
    if kind != "embedding" and (stray := [k for k in _EMBEDDING_KEYS if k in table]):
        raise r.fail(stray[0], "applies to models of kind \"embedding\" only")
    tokenizer_keys = [k for k in ("tokenizer", "tokenizer_package_file") if k in table]
    if engine == "onnx" and len(tokenizer_keys) != 1:
        raise r.fail("tokenizer", "an onnx model needs exactly one of `tokenizer` (a tokenizer.json or vocab.txt) or `tokenizer_package_file`")
    if engine != "onnx" and tokenizer_keys:
        raise r.fail(tokenizer_keys[0], "applies to engine = \"onnx\" only (a GGUF file carries its tokenizer)")
    tokenizer_text = r.string("tokenizer")
    # llama.cpp reads a quantized V only inside flash attention, and the invariant layout runs flash
    # attention only with a quantized cache (docs/architecture.md#batch-invariance).
    if invariant and (kv_k in UNQUANTIZED_KV) != (kv_v in UNQUANTIZED_KV):
        raise r.fail("kv_cache_type_v", f"with batch_invariant = true, K and V must both be quantized or both unquantized (got {kv_k} and {kv_v})")
    return ModelSettings(
        alias=alias,
        engine=engine,
        kind=kind,
        path=path,
        package_file=r.string("package_file"),
        hf_repo=r.string("hf_repo"),
        hf_file=r.string("hf_file"),
        sha256=sha.lower() if sha else None,
        # An onnx model (BERT-like) has 512 learned positions; its passes are padded, inputs x longest.
        context_length=r.integer("context_length", 512 if engine == "onnx" else 4096, minimum=64),
        slots=slots,
        threads=r.integer("threads", max(1, os.cpu_count() or 1), maximum=1024),
        batch_tokens=r.integer("batch_tokens", 8192 if engine == "onnx" else 512, minimum=slots),
        # An embedding request has no first token to hurry: its inputs share steps.
        prefills_per_step=r.integer("prefills_per_step", 0 if table.get("kind") == "embedding" else 1, minimum=0),
        chat_template=template,
        price_input_per_mtok=r.number("price_input_per_mtok", 0.0),
        price_output_per_mtok=r.number("price_output_per_mtok", 0.0),
        tier=r.string("tier", "small", TIERS) or "small",
        batch_invariant=r.boolean("batch_invariant", True),
        kv_cache_type=kv_k,
        kv_cache_type_v=kv_v,
        prefix_cache=r.boolean("prefix_cache", True),
        prefix_cache_host_mb=r.integer("prefix_cache_host_mb", 256, minimum=0, maximum=1 << 20),
        speculation=r.string("speculation", "auto", SPECULATION) or "auto",
        draft_model=r.string("draft_model"),
        speculation_max_tokens=r.integer("speculation_max_tokens", 8, minimum=1, maximum=64),
        speculation_fixed_tokens=r.integer("speculation_fixed_tokens", 0, minimum=0, maximum=64),
        adapters=_adapters(file, index, table.get("adapters", []), base),
        pooling=r.string("pooling", "auto", POOLINGS) or "auto",
        normalize=r.boolean("normalize", True),
        matryoshka=r.boolean("matryoshka", False),
        tokenizer=(base / os.path.expanduser(tokenizer_text)).resolve() if tokenizer_text else None,
        tokenizer_package_file=r.string("tokenizer_package_file"),
    )


def parse_settings(text: str, file: str = "models.toml", base: Path | None = None) -> Settings:
    """Parse config text; raises ConfigError naming `file` and the key at fault."""
    base = base or Path(file).resolve().parent
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "(syntax)", str(exc)) from None
    top = _Reader(file, "", raw, {"server", "defaults", "models", "auth", "budgets", "limits", "cache", "tracing", "routes", "guardrails"})
    models_raw = raw.get("models", [])
    if not isinstance(models_raw, list) or not all(isinstance(m, dict) for m in models_raw):
        raise top.fail("models", "expected an array of tables: [[models]]")
    if not models_raw:
        raise top.fail("models", "no models declared: add at least one [[models]] table")
    models = tuple(_model(file, i, m, base) for i, m in enumerate(models_raw))
    seen: set[str] = set()
    for i, m in enumerate(models):
        if m.alias in seen:
            raise ConfigError(file, f"models[{i}].alias", f"duplicate alias {m.alias!r}")
        seen.add(m.alias)
    by_alias = {m.alias: m for m in models}
    for i, m in enumerate(models):
        if m.draft_model is not None:
            draft = by_alias.get(m.draft_model)
            if draft is None or draft.kind == "embedding" or draft.alias == m.alias or draft.engine == "openai":
                raise ConfigError(file, f"models[{i}].draft_model", f"{m.draft_model!r} is not the alias of another chat or draft model in this file")
        if m.speculation == "draft" and m.draft_model is None:
            raise ConfigError(file, f"models[{i}].speculation", "\"draft\" needs draft_model, the alias of the model that drafts")
        if m.speculation_fixed_tokens > m.speculation_max_tokens:
            raise ConfigError(file, f"models[{i}].speculation_fixed_tokens", f"more than speculation_max_tokens ({m.speculation_max_tokens})")
    if not any(m.kind != "draft" for m in models):
        raise top.fail("models", "every model is a draft model: declare at least one chat or embedding model")
    guard = _Reader(file, "guardrails", top.subtable("guardrails"), {"pii", "judge_model", "judge_action", "judge_threshold"})
    settings = Settings(
        file=Path(file),
        server=_server(file, top.subtable("server"), base),
        defaults=_defaults(file, top.subtable("defaults")),
        models=models,
        auth=_auth(file, top.subtable("auth")),
        budgets=_budgets(file, top.subtable("budgets")),
        limits=_limits(file, raw.get("limits", [])),
        cache=_cache(file, top.subtable("cache")),
        tracing=_tracing(file, top.subtable("tracing")),
        routes=_routes(file, raw.get("routes", []), models, base),
        guard_pii=guard.string("pii", "flag", ("off", "flag", "block")) or "flag",
        guard_judge_model=guard.string("judge_model"),
        guard_judge_action=guard.string("judge_action", "flag", ("flag", "block")) or "flag",
        guard_judge_threshold=guard.number("judge_threshold", 0.5, maximum=1.0),
    )
    if settings.guard_judge_model is not None:
        target = settings.model(settings.guard_judge_model)
        if target is None or target.kind != "chat" or target.engine == "openai":
            raise guard.fail("judge_model", f"{settings.guard_judge_model!r} is not the alias of a local chat model in this file "
                                            "(the judge answers through a grammar)")
    cache = settings.cache
    if cache.enabled and cache.embedder != "minilm":
        target = settings.model(cache.embedder)
        if target is None or target.kind != "embedding":
            raise ConfigError(file, "cache.embedder", f"{cache.embedder!r} is neither \"minilm\" nor the alias of a model of kind \"embedding\"")
    if cache.enabled and cache.judge_model is not None:
        target = settings.model(cache.judge_model)
        if target is None or target.kind != "chat":
            raise ConfigError(file, "cache.judge_model", f"{cache.judge_model!r} is not the alias of a chat model in this file")
        if target.engine == "openai":
            raise ConfigError(file, "cache.judge_model", f"{cache.judge_model!r} runs upstream; the judge answers through a grammar, so it must be a local model")
    return settings


def load_settings(path: Path) -> Settings:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), "(file)", f"cannot read: {exc.strerror}") from None
    return parse_settings(text, str(path), path.resolve().parent)


def find_config(explicit: Path | None) -> Path:
    """`--config`, else ./models.toml, else the one in the data directory."""
    if explicit is not None:
        return explicit
    local = Path("models.toml")
    if local.is_file():
        return local
    return default_data_dir() / "models.toml"
