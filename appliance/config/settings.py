"""Typed settings parsed once from `models.toml`.

Each key is declared once, below, as a field of a frozen struct: type, default, bounds and a
one-line description. The reader, `appliance config check`, the writer (appliance/config/writer.py)
and the reference (docs/config.md, `appliance config docs`) all read these declarations
(appliance/config/schema.py). What one key cannot say alone (one source per model, a draft model
that exists) is checked in `parse_settings` after. Every error names the file and the dotted key.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
from msgspec import Meta

from appliance.config.paths import default_data_dir
from appliance.config.schema import ConfigError, Where, check_known, decode, table_keys
from appliance.config.values import KeepAlive, MemoryBudget
from appliance.evaluation import calibration_file
from policy.limits import LIMIT_LEVELS, LimitRule
from policy.router import Calibration, family_rank, split_tier

__all__ = ["ConfigError", "LocalModel", "ModelSettings", "Settings", "UpstreamModel", "find_config", "load_settings", "parse_settings"]

# "auto": MLX on Apple silicon, llama.cpp elsewhere; "onnx": an embedding model run by onnxruntime
Engine = Literal["llamacpp", "mlx", "auto", "onnx"]
Pooling = Literal["auto", "mean", "cls", "last"]  # auto: what the model file declares (engines/embedding.py)
Kind = Literal["chat", "embedding", "draft"]  # a draft model is loaded only inside the models it drafts for
Tier = Literal["small", "mid", "frontier"]
KvType = Literal["f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
SpeculationMode = Literal["auto", "off", "prompt_lookup", "draft"]
PrefixSharing = Literal["tenant", "all"]
ENGINES = (*get_args(Engine), "openai")  # openai: a model served by another server (engines/upstream)
UNQUANTIZED_KV = ("f16", "bf16")

# A model's alias, a route's alias and an adapter's name: what clients send as `model` ("alias" or
# "alias:adapter", so no ':'), and what the admin API writes into this file, so nothing TOML could read.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME = re.compile(NAME_PATTERN)
NAME_RULE = "letters, digits, '.', '_' or '-' (no ':'), starting with a letter or digit, up to 64 characters"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Shared by more than one table: declared once here.
Alias = Annotated[str, Meta(pattern=NAME_PATTERN, description="the name clients send as `model`", extra={"rule": NAME_RULE})]
Url = Annotated[str, Meta(pattern=r"^https?://", extra={"rule": "an http:// or https:// URL"})]
BaseUrl = Annotated[Url, Meta(description="the server's OpenAI API root, for example \"http://gpu1:8000/v1\"")]
ApiKeyEnv = Annotated[str, Meta(pattern=ENV_NAME.pattern, description="the environment variable holding the server's key",
                                extra={"rule": "the name of an environment variable (the key itself never goes in the file)"})]
# Upper bounds: what llama.cpp and the machine can take. llama.cpp holds n_ctx, n_batch and positions
# in 32-bit integers, so slots x context_length (at most 2**28) stays far inside them; a decode step
# of more than MAX_BATCH_TOKENS gains no speed, and its buffers grow with it.
MAX_CONTEXT = 1 << 20  # tokens per slot of a local model
MAX_UPSTREAM_CONTEXT = 1 << 24  # an upstream's context: only an estimate's bound here
MAX_BATCH_TOKENS = 1 << 16
DAY_S = 86400.0
# A cost in nano-dollars stays an int64 with this price and 2**31 tokens.
Price = Annotated[float, Meta(ge=0.0, le=1e6)]


class _Table(msgspec.Struct, frozen=True, kw_only=True):
    """A table of models.toml."""


class ServerSettings(_Table, frozen=True, kw_only=True):
    host: Annotated[str, Meta(description="the address to listen on")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="the port to listen on (0: any free port)")] = 8080
    data_dir: Annotated[Path, Meta(description="where keys, budgets, the cache, traces and downloaded models are kept",
                                   extra={"default_doc": "$APPLIANCE_HOME, else the platform's data directory"})] = \
        msgspec.field(default_factory=default_data_dir)
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30, description="the largest request body accepted")] = 4 * 1024 * 1024
    max_queue: Annotated[int, Meta(ge=0, le=100_000, description="requests waiting for a slot, per model, before new ones get 503 + Retry-After")] = 64
    shutdown_grace_s: Annotated[float, Meta(ge=0.0, le=3600.0, description="how long running requests may finish at shutdown before they are cancelled")] = 10.0
    sqlite_synchronous: Annotated[Literal["normal", "full"], Meta(
        description="\"normal\": ledger commits survive a crashed process, not always a power cut; \"full\": both")] = "normal"
    model_dirs: Annotated[tuple[Path, ...], Meta(
        description="folders besides data_dir whose files the admin API may name (adapters, quantize sources)",
        extra={"rule": "a list of folder paths"})] = ()
    metrics_auth: Annotated[Literal["none", "admin"], Meta(
        description="who may read /metrics: \"none\" (anyone who reaches the port) or \"admin\" keys once others can reach it")] = "none"
    memory_budget: Annotated[MemoryBudget | None, Meta(
        description="the memory loaded models may hold together: loading one unloads the least recently used idle ones; none: no budget")] = None
    load_timeout_s: Annotated[float, Meta(ge=0.1, le=3600.0, description=(
        "how long a request waits for its model to load, and for room in the memory budget, before a 503 with Retry-After"))] = 120.0
    # The connection's own bounds (appliance/server/http_protocol.py): a client trickling bytes holds a file descriptor.
    header_timeout_s: Annotated[float, Meta(ge=0.5, le=300.0, description=(
        "how long a request's line and headers may take to arrive, from the connection's opening or the next request's first byte; "
        "then 408 and the connection closes"))] = 10.0
    body_timeout_s: Annotated[float, Meta(ge=1.0, le=3600.0, description=(
        "how long a request's body may take to arrive after its headers; then 408 and the connection closes"))] = 60.0
    keep_alive_s: Annotated[int, Meta(ge=1, le=300, description="how long an idle connection stays open for its next request")] = 5
    max_connections: Annotated[int, Meta(ge=1, le=65536, description=(
        "connections open at once; one more is answered 503 with Retry-After and closed"))] = 512

    @property
    def api_path_roots(self) -> tuple[Path, ...]:
        return (self.data_dir, *self.model_dirs)


class Defaults(_Table, frozen=True, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_UPSTREAM_CONTEXT, description="a request's max_tokens when it gives none")] = 1024
    temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="a request's temperature when it gives none")] = 1.0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0, description="a request's top_p when it gives none")] = 1.0


class AdapterSettings(_Table, frozen=True, kw_only=True):
    name: Annotated[Alias, Meta(description="the adapter's name: requests pick it as `model: \"<alias>:<name>\"` or in `adapters`")]
    path: Annotated[Path, Meta(description="the adapter's GGUF file")]
    scale: Annotated[float, Meta(ge=-10.0, le=10.0, description="how strongly it applies")] = 1.0


class UpstreamSettings(_Table, frozen=True, kw_only=True):
    """One OpenAI-compatible server behind a model of engine "openai"."""

    name: Annotated[str, Meta(description="shown in errors, metrics and the admin API", extra={"default_doc": "its URL's host:port"})] = ""
    base_url: BaseUrl
    model: Annotated[str, Meta(description="the model's name on that server", extra={"default_doc": "the model's upstream_model"})] = ""
    api_key_env: ApiKeyEnv | None = None


class UpstreamTuning(_Table, frozen=True, kw_only=True):
    """How an upstream model treats its servers when they are slow or fail."""

    connect_timeout_s: Annotated[float, Meta(ge=0.05, le=600.0, description="the longest wait for a connection")] = 5.0
    read_timeout_s: Annotated[float, Meta(ge=0.05, le=3600.0, description="the longest silence before the first token or between two")] = 60.0
    max_retries: Annotated[int, Meta(ge=0, le=10, description="tries on another server, before any token was streamed only")] = 2
    retry_backoff_s: Annotated[float, Meta(ge=0.0, le=60.0, description="the wait before a retry (doubling each time)")] = 0.25
    breaker_failures: Annotated[int, Meta(ge=1, le=1000, description="failures in a row that open a server's circuit breaker")] = 3
    breaker_cooldown_s: Annotated[float, Meta(ge=0.1, le=DAY_S, description="how long an open breaker keeps a server out")] = 30.0
    health_interval_s: Annotated[float, Meta(ge=0.0, le=DAY_S, description="how often a server's health is probed")] = 15.0


class _Model(_Table, frozen=True, kw_only=True):
    """What every model has, local or upstream."""

    alias: Annotated[Alias, Meta(description="every model needs an alias, the name clients send as `model`")]
    kind: Annotated[Kind, Meta(description="what it serves; a draft model only drafts for others (draft_model)")] = "chat"
    price_input_per_mtok: Annotated[Price, Meta(description="dollars per million prompt tokens, charged to budgets")] = 0.0
    price_output_per_mtok: Annotated[Price, Meta(description="dollars per million completion tokens, charged to budgets")] = 0.0


def names_template_file(text: str) -> bool:
    """Whether a chat_template value names a file rather than holding the template: a template
    that renders messages has a `{`."""
    return "{" not in text


def _template_text(text: str, key: str, where: Where) -> str:
    """A template may be given inline or as a file next to the config."""
    candidate = where.base / text
    return candidate.read_text() if names_template_file(text) and candidate.is_file() else text


# Tagged only because msgspec (which Litestar runs over handler signatures) accepts a union of
# structs only when they are; the tag is not a key of the file.
class LocalModel(_Model, frozen=True, kw_only=True, tag_field="runs", tag="here"):
    """A model this process runs (engine "llamacpp", "mlx" or "auto")."""

    engine: Annotated[Engine, Meta(description="\"auto\" is MLX on Apple silicon, llama.cpp elsewhere; \"openai\": the table below",
                                   extra={"rule": f"one of {', '.join(ENGINES)}"})] = "llamacpp"
    # Exactly one source: a local path, a file inside an installed Python package, or a hub file.
    path: Annotated[Path | None, Meta(description="a GGUF file, or an MLX folder (one source: path, package_file or hf_repo)")] = None
    package_file: Annotated[str | None, Meta(description="a file inside an installed Python package, \"package/file.gguf\"",
                                                      extra={"file": "package"})] = None
    hf_repo: Annotated[str | None, Meta(description="a Hugging Face repository, with hf_file; downloaded into data_dir")] = None
    hf_file: Annotated[str | None, Meta(description="the file in hf_repo", extra={"file": "hub"})] = None
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{64}$", description="the file's digest, checked by `models pull` and `doctor`",
                                 extra={"rule": "64 hexadecimal digits"})] | None = None
    context_length: Annotated[int, Meta(ge=64, le=MAX_CONTEXT, description="tokens per slot")] = 4096
    slots: Annotated[int, Meta(ge=1, le=256, description="requests decoded together")] = 4
    threads: Annotated[int, Meta(ge=1, le=1024, description="CPU threads", extra={"default_doc": "the CPU count"})] = \
        msgspec.field(default_factory=lambda: max(1, os.cpu_count() or 1))
    batch_tokens: Annotated[int, Meta(ge=1, le=MAX_BATCH_TOKENS, description="tokens per decode step, at least slots")] = 512
    prefills_per_step: Annotated[int, Meta(ge=0, le=256, description="prompts a step may leave unfinished (prompts that finish within the step's "
                                                                  "batch_tokens always join it); 0: no limit",
                                           extra={"default_doc": "1; 0 for embedding models (no first token to hurry)"})] = 1
    chat_template: Annotated[str | None, Meta(description="a Jinja chat template, inline or a file next to this one; default: the model's own",
                                              extra={"load": _template_text, "form": "a template, or a file name",
                                                                     "file": "template"})] = None
    tier: Annotated[Tier, Meta(description="its place in a route's escalation")] = "small"
    batch_invariant: Annotated[bool, Meta(description="identical greedy output whatever shares the batch or the prefix cache; "
                                                      "prefill runs at about half speed (docs/performance.md)")] = False
    kv_cache_type: Annotated[KvType, Meta(description="the KV cache's type: K's and V's, unless kv_cache_type_k or _v say otherwise")] = "f16"
    kv_cache_type_k: Annotated[KvType, Meta(description="K's type", extra={"default_from": "kv_cache_type"})] = "f16"
    kv_cache_type_v: Annotated[KvType, Meta(description="V's type", extra={"default_from": "kv_cache_type"})] = "f16"
    # None: slots x context_length, every slot able to fill its context at once.
    kv_tokens: Annotated[int, Meta(ge=64, le=256 * MAX_CONTEXT, description="KV cells all slots share (batch_invariant = false); a request may still "
                                                            "fill context_length. Fewer than slots x context_length: when they run "
                                                            "out, the newest request waits in host RAM",
                                          extra={"default_doc": "slots x context_length"})] | None = None
    prefix_cache: Annotated[bool, Meta(description="reuse the KV of earlier prompts' prefixes across requests and slots")] = True
    prefix_cache_host_mb: Annotated[int, Meta(ge=0, le=1 << 20, description="host RAM for prefixes evicted from the KV cache; 0: none")] = 256
    prefix_sharing: Annotated[PrefixSharing, Meta(description="whose prefixes a request may reuse: \"tenant\": its own tenant's only (another "
                                                              "tenant's reuse would show in cached_tokens and the time to first token); "
                                                              "\"all\": every caller's, for a system prompt every tenant sends")] = "tenant"
    speculation: Annotated[SpeculationMode, Meta(description="speculative decoding; \"auto\" is \"draft\" when draft_model is set, else \"off\"")] = "auto"
    draft_model: Annotated[str | None, Meta(description="the alias of another [[models]] entry that drafts for this one")] = None
    speculation_max_tokens: Annotated[int, Meta(ge=1, le=64, description="the most tokens drafted at once")] = 8
    speculation_fixed_tokens: Annotated[int, Meta(ge=0, le=64, description="tokens drafted every step; 0: as many as pay, measured per slot")] = 0
    adapters: Annotated[tuple[AdapterSettings, ...], Meta(description="LoRA adapters loaded at start")] = ()
    keep_alive: Annotated[KeepAlive, Meta(description="how long a model not preloaded stays loaded after its last request")] = \
        KeepAlive.from_toml("5m")
    # None: whether a budget exists decides. Without one nothing needs making room for, so models
    # load at start as they always did; with one they load on demand and take turns.
    preload: Annotated[bool | None, Meta(
        description="load at start and never unload; false: load on the first request and unload after keep_alive",
        extra={"default_doc": "true without [server] memory_budget, false with one"})] = None
    gpu_layers: Annotated[Literal["auto"] | Annotated[int, Meta(ge=0, le=10_000)], Meta(
        description="layers offloaded to a GPU; \"auto\": as many as fit its free memory (none on a CPU build); 0: all on the CPU")] = "auto"
    # kind = "embedding": how token states become a vector, whether vectors are unit length, and
    # whether a request's `dimensions` may keep the first n (a model trained Matryoshka-style).
    pooling: Annotated[Pooling, Meta(description="embedding models: how token states become one vector; \"auto\": what the file declares")] = "auto"
    normalize: Annotated[bool, Meta(description="embedding models: vectors scaled to unit length")] = True
    matryoshka: Annotated[bool, Meta(description="embedding models: trained so that a request's `dimensions` may keep the first n")] = False
    tokenizer: Annotated[Path | None, Meta(description="engine \"onnx\": a tokenizer.json or WordPiece vocab.txt (or tokenizer_package_file)")] = None
    tokenizer_package_file: Annotated[str | None, Meta(
        description="engine \"onnx\": the tokenizer as a file inside an installed Python package", extra={"file": "package"})] = None

    @property
    def speculation_mode(self) -> str:
        if self.speculation == "auto":
            return "draft" if self.draft_model else "off"
        return self.speculation

    @property
    def keep_alive_s(self) -> float | None:
        """Seconds an idle model stays loaded; None: until the server stops."""
        return self.keep_alive.seconds

    def loads_at_start(self, server: ServerSettings) -> bool:
        """`preload` as given, else whether the server has no memory budget."""
        return self.preload if self.preload is not None else server.memory_budget is None


class UpstreamModel(_Model, frozen=True, kw_only=True, tag_field="runs", tag="upstream"):
    """A model served by other OpenAI-compatible servers (engine = "openai"), spread by least outstanding requests."""

    engine: Annotated[Literal["openai"], Meta(description="\"openai\": served by the servers below")]
    context_length: Annotated[int, Meta(ge=64, le=MAX_UPSTREAM_CONTEXT, description="the longest prompt and completion sent")] = 32768
    tier: Annotated[Tier, Meta(description="its place in a route's escalation")] = "frontier"
    base_url: BaseUrl | None = None
    upstream_model: Annotated[str, Meta(description="the model's name on the servers", extra={"default_from": "alias"})] = ""
    api_key_env: ApiKeyEnv | None = None
    upstreams: Annotated[tuple[UpstreamSettings, ...], Meta(description="several servers, instead of base_url")] = ()
    upstream: Annotated[UpstreamTuning, Meta(extra={"flatten": True})] = msgspec.field(default_factory=UpstreamTuning)

    # What code listing any model reads of a local one: an upstream model has no file, one slot
    # as far as this process is concerned, and no prefix cache or drafts.
    slots: ClassVar[int] = 1
    prefix_cache: ClassVar[bool] = False
    prefix_sharing: ClassVar[str] = "tenant"
    speculation_mode: ClassVar[str] = "off"
    draft_model: ClassVar[None] = None
    path: ClassVar[None] = None
    package_file: ClassVar[None] = None
    hf_repo: ClassVar[None] = None
    hf_file: ClassVar[None] = None
    sha256: ClassVar[None] = None


ModelSettings = LocalModel | UpstreamModel


class OpenPrincipal(_Table, frozen=True, kw_only=True):
    user: Annotated[str, Meta(description="who every request is, with mode = \"open\"")] = "local"
    tenant: Annotated[str, Meta(description="its tenant")] = "local"
    app: Annotated[str, Meta(description="its app")] = "local"
    role: Annotated[str, Meta(description="its role")] = "developer"
    admin: Annotated[bool, Meta(description="whether it may call the admin API")] = False


class AuthSettings(_Table, frozen=True, kw_only=True):
    mode: Annotated[Literal["keys", "open"], Meta(
        description="\"keys\": every request needs a key; \"open\": none, every request is open_principal (local development)")] = "keys"
    open_principal: Annotated[OpenPrincipal, Meta(description="who requests are with mode = \"open\"")] = \
        msgspec.field(default_factory=OpenPrincipal)
    key_cache_s: Annotated[float, Meta(ge=0.0, le=3600.0, description="how long a checked key is trusted before it is looked up again")] = 5.0


class BudgetSettings(_Table, frozen=True, kw_only=True):
    enabled: Annotated[bool, Meta(description="charge calls to dollar budgets (`appliance budgets set`)")] = True
    lease_s: Annotated[float, Meta(ge=1.0, le=DAY_S, description="a reservation's lease; only a crashed process's expire")] = 300.0
    clamp_max_tokens: Annotated[bool, Meta(description="lower max_tokens to what a budget covers, rather than refuse")] = True
    min_tokens: Annotated[int, Meta(ge=1, le=MAX_CONTEXT, description="... but refuse if fewer than this would remain")] = 16


class LimitSettings(_Table, frozen=True, kw_only=True):
    level: Annotated[Literal[LIMIT_LEVELS], Meta(description=f"one of {', '.join(LIMIT_LEVELS)}")]  # type: ignore[valid-type]
    name: Annotated[str, Meta(description="the key, user, tenant or app; \"*\": each one separately")] = "*"
    requests_per_minute: Annotated[int, Meta(ge=1, le=10**9, description="requests a minute; none: no limit")] | None = None
    tokens_per_minute: Annotated[int, Meta(ge=1, le=10**12, description="tokens a minute; none: no limit")] | None = None


class CacheSettings(_Table, frozen=True, kw_only=True):
    enabled: Annotated[bool, Meta(description="the semantic cache: a reworded question gets a stored answer")] = True
    embedder: Annotated[str, Meta(description="\"minilm\" (shipped), or the alias of a model of kind \"embedding\"")] = "minilm"
    # Tuned on tests/data/cache_pairs.jsonl with the near-miss guards (bench/cache_quality.py).
    similarity_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="the cosine similarity of a hit")] = 0.70
    judge_band: Annotated[float, Meta(ge=0.0, le=1.0, description="from here up to the threshold, judge_model decides",
                                      extra={"default_from": "similarity_threshold"})] = 0.70
    judge_model: Annotated[str | None, Meta(description="a local chat model asked \"same answer?\" in the band; none: the band is a miss")] = None
    judge_min_probability: Annotated[float, Meta(ge=0.0, le=1.0, description="the judge's P(yes) that makes a hit")] = 0.85
    freshness_s: Annotated[float, Meta(ge=1.0, le=3650 * DAY_S, description="how long an answer is served")] = 7 * 86400.0
    serve_unverified: Annotated[bool, Meta(description="serve answers nobody has confirmed yet")] = True
    max_temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="hotter requests are not cached")] = 0.3
    max_entries_per_tenant: Annotated[int, Meta(ge=1, le=10**8, description="entries kept per tenant")] = 10_000
    sweep_interval_s: Annotated[float, Meta(ge=0.0, le=DAY_S, description="re-ask valuable entries when idle this often; 0: no sweeps")] = 300.0
    sweep_batch: Annotated[int, Meta(ge=1, le=1000, description="entries re-asked per sweep")] = 2
    agree_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="a re-asked answer this similar to the stored one agrees")] = 0.90


class TracingSettings(_Table, frozen=True, kw_only=True):
    store: Annotated[bool, Meta(description="keep spans in the appliance's database (GET /admin/traces)")] = True
    retention_days: Annotated[float, Meta(ge=0.01, le=3650.0, description="how long stored spans are kept")] = 7.0
    max_spans: Annotated[int, Meta(ge=100, le=10**9, description="the most spans stored")] = 500_000
    enabled: Annotated[bool, Meta(description="export spans over OTLP/HTTP (protobuf) to a collector, Jaeger or Tempo")] = False
    otlp_endpoint: Annotated[Url, Meta(description="where spans are exported")] = "http://127.0.0.1:4318/v1/traces"
    service_name: Annotated[str, Meta(description="the service.name of exported spans")] = "appliance"
    sample_ratio: Annotated[float, Meta(ge=0.0, le=1.0, description="the share of calls traced")] = 1.0
    export_interval_ms: Annotated[int, Meta(ge=10, le=3_600_000, description="how often spans are exported")] = 2000


def _calibration_path(text: str, where: Where) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else where.base / path


def _calibration(text: str, key: str, where: Where) -> Calibration:
    """Read once with the config; a problem names the calibration file and its key, and which route uses it."""
    path = _calibration_path(text, where)
    try:
        return calibration_file.read(path)
    except calibration_file.CalibrationError as exc:
        raise ConfigError(str(path), exc.key, f"{exc.problem} (the calibration of {where.file}: {key})") from None


class RouteSettings(_Table, frozen=True, kw_only=True):
    """A routed alias (for example `model: "auto"`): requests to it are classified and sent to the
    smallest tier that does the job, escalating when an answer fails its validators."""

    alias: Annotated[Alias, Meta(description="the name clients send as `model`, for example \"auto\"")]
    tiers: Annotated[tuple[str, ...], Meta(min_length=1, description="the chat models it may send a request to, cheapest first; "
                                           "\"<alias>:<adapter>\" is a model with one of its LoRA adapters (a distilled tier)",
                                           extra={"rule": "a non-empty list of chat model aliases (or alias:adapter), cheapest first"})]
    default_response: Annotated[str, Meta(description="the answer when no tier gives a reliable one")] = \
        "I can't give a reliable answer to that right now. Please try again later or rephrase."
    min_confidence: Annotated[float, Meta(ge=0.0, le=1.0, description="the geometric-mean token probability an answer needs")] = 0.0
    max_repetition: Annotated[float, Meta(ge=0.0, le=1.0, description="the most repetition an answer may have")] = 0.5
    classifier_model: Annotated[str | None, Meta(description="a local chat model asked for a tier when the heuristics are unsure")] = None
    classifier_below: Annotated[float, Meta(ge=0.0, le=1.0, description="the heuristics' confidence below which the classifier is asked")] = 0.6
    cooldown_s: Annotated[float, Meta(ge=0.0, le=DAY_S, description="a model that failed to serve is skipped this long")] = 30.0
    attempt_timeout_s: Annotated[float, Meta(ge=0.1, le=3600.0, description="an attempt slower than this is abandoned for the next tier")] = 120.0
    role_floor: Annotated[tuple[tuple[str, Tier], ...], Meta(description="the lowest tier for a role: role = \"mid\"")] = ()
    role_ceiling: Annotated[tuple[tuple[str, Tier], ...], Meta(description="the highest tier for a role")] = ()
    family_tiers: Annotated[tuple[tuple[str, str], ...], Meta(
        description="a tier tried first for requests whose metadata names a family: classification = \"smollm2-135m:distilled\" "
                    "(what `appliance distill evaluate --promote` writes for the family it checked); the route's own choice "
                    "follows if its answer fails validation. It stands where its model stands in the chain: a role whose floor is "
                    "above that or whose ceiling is below it skips it")] = ()
    family_min_confidence: Annotated[float, Meta(ge=0.0, le=1.0, description=(
        "the geometric-mean token probability a family tier's answer needs to stand; below it the route's own choice "
        "answers (the tier's attempt is cheap: chosen on held-out items by bench/family_threshold.py)"))] = 0.0
    program_families: Annotated[tuple[str, ...], Meta(
        description="families (a request's metadata.family) whose plain-text requests the chosen tier answers with a short "
                    "straight-line program that the appliance evaluates (never runs): the reply is the program and an "
                    "`Answer:` line. Fewer tokens than a worked answer (word problems: bench/word_problem_programs.py); a "
                    "program that does not evaluate is no answer, and the request is then answered as asked")] = ()
    calibration: Annotated[Calibration | None, Meta(
        description="the measured tier per kind of request (`appliance eval calibrate`)",
        extra={"load": _calibration, "form": "a calibration file's path"})] = None

    def tier_index(self, name: str) -> int:
        """small, mid, frontier onto this route's tiers (frontier is always the last)."""
        if name == "frontier":
            return len(self.tiers) - 1
        return min(len(self.tiers) - 1, ("small", "mid").index(name))


class GuardrailSettings(_Table, frozen=True, kw_only=True):
    pii: Annotated[Literal["off", "flag", "block"], Meta(
        description="personal data in a request: \"flag\" (traced and counted) or \"block\" (refused, 400)")] = "flag"
    judge_model: Annotated[str | None, Meta(
        description="a local chat model asked whether unsure text tries to instruct the system; its tokens are charged")] = None
    judge_action: Annotated[Literal["flag", "block"], Meta(description="what a judged injection gets")] = "flag"
    judge_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="the judge's P(yes) at which text is an injection")] = 0.5


class DistillSettings(_Table, frozen=True, kw_only=True):
    """Distillation: the appliance's verified answers teach its cheapest tier (docs/architecture.md)."""

    tenants: Annotated[tuple[str, ...], Meta(
        description="the tenants whose prompts and answers are kept to train on; empty: nobody's, nothing is kept",
        extra={"rule": "a list of tenant names"})] = ()
    retention_days: Annotated[float, Meta(ge=0.01, le=3650.0, description="how long a kept answer stays for `appliance distill export`")] = 30.0
    margin: Annotated[float, Meta(ge=0.0, le=1.0, description="how far below the teacher's accuracy a distilled adapter may score (a share of it) and still be promoted")] = 0.1


@dataclass(frozen=True)
class Section:
    """A top-level key of models.toml: a table, or an array of tables."""

    name: str
    types: tuple[type, ...]
    array: bool = False


SECTIONS = (
    Section("server", (ServerSettings,)), Section("defaults", (Defaults,)), Section("models", (LocalModel, UpstreamModel), array=True),
    Section("auth", (AuthSettings,)), Section("budgets", (BudgetSettings,)), Section("limits", (LimitSettings,), array=True),
    Section("cache", (CacheSettings,)), Section("tracing", (TracingSettings,)), Section("routes", (RouteSettings,), array=True),
    Section("guardrails", (GuardrailSettings,)), Section("distill", (DistillSettings,)),
)


def table_type(section: str, table: dict[str, Any]) -> type:
    """The struct that declares one table of a section: a [[models]] table is an upstream model
    when its engine is "openai", a local one otherwise."""
    types = next(s.types for s in SECTIONS if s.name == section)
    return UpstreamModel if section == "models" and table.get("engine") == "openai" else types[0]


_MODEL_KEYS = table_keys(LocalModel)  # the keys of a local model's table
_UPSTREAM_MODEL_KEYS = table_keys(UpstreamModel)
_EMBEDDING_KEYS = ("pooling", "normalize", "matryoshka", "tokenizer", "tokenizer_package_file")


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
    guardrails: GuardrailSettings = field(default_factory=GuardrailSettings)
    distill: DistillSettings = field(default_factory=DistillSettings)

    @property
    def guard_pii(self) -> str:
        return self.guardrails.pii

    @property
    def guard_judge_model(self) -> str | None:
        return self.guardrails.judge_model

    @property
    def guard_judge_action(self) -> str:
        return self.guardrails.judge_action

    @property
    def guard_judge_threshold(self) -> float:
        return self.guardrails.judge_threshold

    def route(self, alias: str) -> RouteSettings | None:
        return next((r for r in self.routes if r.alias == alias), None)

    def model(self, alias: str) -> ModelSettings | None:
        return next((m for m in self.models if m.alias == alias), None)


def _table(raw: dict[str, Any], name: str, where: Where) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise where.fail(name, f"expected a table, got {type(value).__name__}")
    return value


def _array(raw: dict[str, Any], name: str, where: Where) -> list[dict[str, Any]]:
    value = raw.get(name, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise where.fail(name, f"expected an array of tables: [[{name}]]")
    return value


def _local_model(table: dict[str, Any], key: str, where: Where) -> LocalModel:
    # An embedding request has no first token to hurry: its inputs share steps.
    defaults: dict[str, Any] = {}
    if table.get("kind") == "embedding":
        defaults["prefills_per_step"] = 0
    if table.get("engine") == "onnx":
        # An onnx model (BERT-like) has 512 learned positions; its passes are padded, inputs x longest.
        defaults.update(context_length=512, batch_tokens=8192)
    m = decode(LocalModel, table, key, where, defaults or None)
    if m.engine == "onnx" and m.kind != "embedding":
        raise where.fail(f"{key}.engine", "the onnx engine serves embedding models only: add kind = \"embedding\"")
    if m.kind != "embedding" and (stray := [k for k in _EMBEDDING_KEYS if k in table]):
        raise where.fail(f"{key}.{stray[0]}", "applies to models of kind \"embedding\" only")
    tokenizer_keys = [k for k in ("tokenizer", "tokenizer_package_file") if k in table]
    if m.engine == "onnx" and len(tokenizer_keys) != 1:
        raise where.fail(f"{key}.tokenizer", "an onnx model needs exactly one of `tokenizer` (a tokenizer.json or vocab.txt) or `tokenizer_package_file`")
    if m.engine != "onnx" and tokenizer_keys:
        raise where.fail(f"{key}.{tokenizer_keys[0]}", "applies to engine = \"onnx\" only (a GGUF file carries its tokenizer)")
    if sum(k in table for k in ("path", "package_file", "hf_repo")) != 1:
        raise where.fail(f"{key}.path", "give exactly one source: `path`, `package_file`, or `hf_repo` with `hf_file`")
    if ("hf_repo" in table) != ("hf_file" in table):
        raise where.fail(f"{key}.hf_file", "`hf_repo` and `hf_file` go together")
    if m.batch_tokens < m.slots:
        raise where.fail(f"{key}.batch_tokens", f"expected an integer at least {m.slots}, got {m.batch_tokens}")
    # llama.cpp reads a quantized V only inside flash attention, and the invariant layout runs flash
    # attention only with a quantized cache (docs/architecture.md#batch-invariance).
    if m.kv_tokens is not None:
        if m.batch_invariant:
            raise where.fail(f"{key}.kv_tokens", "needs batch_invariant = false: an invariant model keeps one KV stream per slot")
        if not m.context_length <= m.kv_tokens <= m.slots * m.context_length:
            raise where.fail(f"{key}.kv_tokens", f"expected an integer from context_length ({m.context_length}) to slots x "
                                                 f"context_length ({m.slots * m.context_length}), got {m.kv_tokens}")
    k, v = m.kv_cache_type_k, m.kv_cache_type_v
    if m.batch_invariant and (k in UNQUANTIZED_KV) != (v in UNQUANTIZED_KV):
        raise where.fail(f"{key}.kv_cache_type_v", f"with batch_invariant = true, K and V must both be quantized or both unquantized (got {k} and {v})")
    names = [a.name for a in m.adapters]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise where.fail(f"{key}.adapters[{i}].name", f"a second adapter named {name!r}")
    # kv_cache_type is read as K's type by the engines (V's is kv_cache_type_v).
    return msgspec.structs.replace(m, sha256=m.sha256.lower() if m.sha256 else None, kv_cache_type=k)


def _upstream_model(table: dict[str, Any], key: str, where: Where) -> UpstreamModel:
    """A model served by other servers: where they are and how to treat them when they fail."""
    if "api_key" in table:
        raise where.fail(f"{key}.api_key", "never put a key in the file: name the environment variable that holds it in api_key_env")
    local_only = sorted(set(table) & (_MODEL_KEYS - _UPSTREAM_MODEL_KEYS))
    if local_only:
        raise where.fail(f"{key}.{local_only[0]}", "applies to local engines only; this model has engine = \"openai\"")
    m = decode(UpstreamModel, table, key, where)
    if m.kind != "chat":
        raise where.fail(f"{key}.kind", "an upstream model serves chat completions only")
    if "upstreams" in table and m.base_url is not None:
        raise where.fail(f"{key}.upstreams", "give base_url for one server or [[models.upstreams]] for several, not both")
    if "upstreams" in table and not m.upstreams:
        raise where.fail(f"{key}.upstreams", "expected an array of tables: [[models.upstreams]] with base_url (and model, api_key_env, name)")
    if m.base_url is None and not m.upstreams:
        raise where.fail(f"{key}.base_url", "missing: an upstream model needs base_url (or [[models.upstreams]] tables)")
    if m.upstreams and m.api_key_env is not None:
        raise where.fail(f"{key}.api_key_env", "with [[models.upstreams]], give api_key_env in each upstream's table")
    listed = m.upstreams or (UpstreamSettings(base_url=m.base_url or "", api_key_env=m.api_key_env),)
    named: list[UpstreamSettings] = []
    for i, u in enumerate(listed):
        url = u.base_url.rstrip("/")
        name = u.name or url.split("://", 1)[1].split("/", 1)[0]
        if name in [n.name for n in named]:
            name = f"{name}#{i}"
        named.append(msgspec.structs.replace(u, name=name, base_url=url, model=u.model or m.upstream_model))
    return msgspec.structs.replace(m, upstreams=tuple(named))


def _models(raw: dict[str, Any], where: Where) -> tuple[ModelSettings, ...]:
    tables = _array(raw, "models", where)
    if not tables:
        raise where.fail("models", "no models declared: add at least one [[models]] table")
    models = tuple((_upstream_model if table_type("models", t) is UpstreamModel else _local_model)(t, f"models[{i}]", where)
                   for i, t in enumerate(tables))
    seen: set[str] = set()
    for i, m in enumerate(models):
        if m.alias in seen:
            raise where.fail(f"models[{i}].alias", f"duplicate alias {m.alias!r}")
        seen.add(m.alias)
    by_alias = {m.alias: m for m in models}
    for i, m in enumerate(models):
        if not isinstance(m, LocalModel):
            continue
        if m.draft_model is not None:
            draft = by_alias.get(m.draft_model)
            if not isinstance(draft, LocalModel) or draft.kind == "embedding" or draft.alias == m.alias:
                raise where.fail(f"models[{i}].draft_model", f"{m.draft_model!r} is not the alias of another chat or draft model in this file")
        if m.speculation == "draft" and m.draft_model is None:
            raise where.fail(f"models[{i}].speculation", "\"draft\" needs draft_model, the alias of the model that drafts")
        if m.speculation_fixed_tokens > m.speculation_max_tokens:
            raise where.fail(f"models[{i}].speculation_fixed_tokens", f"more than speculation_max_tokens ({m.speculation_max_tokens})")
    if not any(m.kind != "draft" for m in models):
        raise where.fail("models", "every model is a draft model: declare at least one chat or embedding model")
    return models


def _limits(raw: dict[str, Any], where: Where) -> tuple[LimitRule, ...]:
    rules: list[LimitRule] = []
    for i, table in enumerate(_array(raw, "limits", where)):
        r = decode(LimitSettings, table, f"limits[{i}]", where)
        if any((rule.level, rule.name) == (r.level, r.name) for rule in rules):
            raise where.fail(f"limits[{i}].name", f"a second rule for {r.level} {r.name!r}")
        if r.requests_per_minute is None and r.tokens_per_minute is None:
            raise where.fail(f"limits[{i}].requests_per_minute", "give requests_per_minute, tokens_per_minute, or both")
        rules.append(LimitRule(r.level, r.name, r.requests_per_minute, r.tokens_per_minute))
    return tuple(rules)


def _cache(raw: dict[str, Any], where: Where) -> CacheSettings:
    cache = decode(CacheSettings, _table(raw, "cache", where), "cache", where)
    if cache.judge_band > cache.similarity_threshold:
        raise where.fail("cache.judge_band", f"must be at most similarity_threshold ({cache.similarity_threshold}), got {cache.judge_band}")
    return cache


def _routes(raw: dict[str, Any], models: tuple[ModelSettings, ...], where: Where) -> tuple[RouteSettings, ...]:
    chat = {m.alias for m in models if m.kind == "chat"}
    upstream = {m.alias for m in models if isinstance(m, UpstreamModel)}
    adapters = {m.alias: {a.name for a in getattr(m, "adapters", ())} for m in models}
    routes: list[RouteSettings] = []
    for i, table in enumerate(_array(raw, "routes", where)):
        key = f"routes[{i}]"
        r = decode(RouteSettings, table, key, where)
        if r.alias in {m.alias for m in models}:
            raise where.fail(f"{key}.alias", f"{r.alias!r} is already a model's alias")
        named = [(f"{key}.tiers", tier) for tier in r.tiers] + [(f"{key}.family_tiers.{family}", tier) for family, tier in r.family_tiers]
        for at, tier in named:
            alias, adapter = split_tier(tier)
            if alias not in chat:
                raise where.fail(at, f"{alias!r} is not the alias of a chat model in this file")
            if adapter is not None and adapter not in adapters.get(alias, ()):
                raise where.fail(at, f"{tier!r}: the model {alias!r} has no adapter {adapter!r} in this file")
        for family, tier in r.family_tiers:
            if family_rank(r.tiers, tier) is None:  # a role's floor and ceiling bound it by its model's place in the chain
                raise where.fail(f"{key}.family_tiers.{family}", f"{tier!r}: its model is not one of this route's tiers {list(r.tiers)}: "
                                                                 "name a tier of the route or an adapter of one")
        if len(set(r.tiers)) != len(r.tiers):
            raise where.fail(f"{key}.tiers", "a tier is named twice")
        if r.classifier_model is not None and r.classifier_model not in chat:
            raise where.fail(f"{key}.classifier_model", f"{r.classifier_model!r} is not the alias of a chat model in this file")
        if r.classifier_model in upstream:
            raise where.fail(f"{key}.classifier_model",
                             f"{r.classifier_model!r} runs upstream; the classifier's answer is forced by a grammar, so it must be a local model")
        if r.calibration is not None and r.calibration.tiers != r.tiers:
            raise where.fail(f"{key}.calibration", f"{_calibration_path(table['calibration'], where)} was measured with tiers {list(r.calibration.tiers)}, "
                                                   f"this route has {list(r.tiers)}: remove this key, then run `appliance eval router` "
                                                   "and `appliance eval calibrate` again")
        if r.alias in [done.alias for done in routes]:
            raise where.fail(f"{key}.alias", f"duplicate route {r.alias!r}")
        routes.append(r)
    return tuple(routes)


def parse_settings(text: str, file: str = "models.toml", base: Path | None = None) -> Settings:
    """Parse config text; raises ConfigError naming `file` and the key at fault."""
    where = Where(file, base or Path(file).resolve().parent)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(file, "(syntax)", str(exc)) from None
    check_known(raw, frozenset(s.name for s in SECTIONS), "", where)
    models = _models(raw, where)

    def table(cls: type, name: str) -> Any:
        return decode(cls, _table(raw, name, where), name, where)

    settings = Settings(
        file=Path(file), server=table(ServerSettings, "server"), defaults=table(Defaults, "defaults"), models=models,
        auth=table(AuthSettings, "auth"), budgets=table(BudgetSettings, "budgets"), limits=_limits(raw, where),
        cache=_cache(raw, where), tracing=table(TracingSettings, "tracing"), routes=_routes(raw, models, where),
        guardrails=table(GuardrailSettings, "guardrails"), distill=table(DistillSettings, "distill"),
    )
    # The judges answer through a grammar, which only a local model takes.
    judge = settings.guardrails.judge_model
    if judge is not None and (not isinstance(target := settings.model(judge), LocalModel) or target.kind != "chat"):
        raise where.fail("guardrails.judge_model", f"{judge!r} is not the alias of a local chat model in this file (the judge answers through a grammar)")
    cache = settings.cache
    if cache.enabled and cache.embedder != "minilm":
        target = settings.model(cache.embedder)
        if target is None or target.kind != "embedding":
            raise where.fail("cache.embedder", f"{cache.embedder!r} is neither \"minilm\" nor the alias of a model of kind \"embedding\"")
    if cache.enabled and cache.judge_model is not None:
        target = settings.model(cache.judge_model)
        if target is None or target.kind != "chat":
            raise where.fail("cache.judge_model", f"{cache.judge_model!r} is not the alias of a chat model in this file")
        if isinstance(target, UpstreamModel):
            raise where.fail("cache.judge_model", f"{cache.judge_model!r} runs upstream; the judge answers through a grammar, so it must be a local model")
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
