"""The [[models]] tables: a model run here (llama.cpp, MLX, onnxruntime) or by an upstream server,
its adapters, and the checks that need more than one key of a table."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from appliance.config.fields import (
    DAY_S,
    ENGINES,
    MAX_BATCH_TOKENS,
    MAX_CONTEXT,
    MAX_UPSTREAM_CONTEXT,
    UNQUANTIZED_KV,
    Alias,
    ApiKeyEnv,
    BaseUrl,
    Engine,
    Kind,
    KvType,
    Pooling,
    PrefixSharing,
    Price,
    SpeculationMode,
    Table,
    Tier,
    array_at,
)
from appliance.config.schema import Where, decode, table_keys
from appliance.config.values import KeepAlive

if TYPE_CHECKING:
    from appliance.config.sections import ServerSettings


class AdapterSettings(Table, frozen=True, kw_only=True):
    name: Annotated[Alias, Meta(description="the adapter's name: requests pick it as `model: \"<alias>:<name>\"` or in `adapters`")]
    path: Annotated[Path, Meta(description="the adapter's GGUF file")]
    scale: Annotated[float, Meta(ge=-10.0, le=10.0, description="how strongly it applies")] = 1.0


class UpstreamSettings(Table, frozen=True, kw_only=True):
    """One OpenAI-compatible server behind a model of engine "openai"."""

    name: Annotated[str, Meta(description="shown in errors, metrics and the admin API", extra={"default_doc": "its URL's host:port"})] = ""
    base_url: BaseUrl
    model: Annotated[str, Meta(description="the model's name on that server", extra={"default_doc": "the model's upstream_model"})] = ""
    api_key_env: ApiKeyEnv | None = None


class UpstreamTuning(Table, frozen=True, kw_only=True):
    """How an upstream model treats its servers when they are slow or fail."""

    connect_timeout_s: Annotated[float, Meta(ge=0.05, le=600.0, description="the longest wait for a connection")] = 5.0
    read_timeout_s: Annotated[float, Meta(ge=0.05, le=3600.0, description="the longest silence before the first token or between two")] = 60.0
    max_retries: Annotated[int, Meta(ge=0, le=10, description="tries on another server, before any token was streamed only")] = 2
    retry_backoff_s: Annotated[float, Meta(ge=0.0, le=60.0, description="the wait before a retry (doubling each time)")] = 0.25
    breaker_failures: Annotated[int, Meta(ge=1, le=1000, description="failures in a row that open a server's circuit breaker")] = 3
    breaker_cooldown_s: Annotated[float, Meta(ge=0.1, le=DAY_S, description="how long an open breaker keeps a server out")] = 30.0
    health_interval_s: Annotated[float, Meta(ge=0.0, le=DAY_S, description="how often a server's health is probed")] = 15.0


class _Model(Table, frozen=True, kw_only=True):
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


def model_type(table: dict[str, Any]) -> type:
    """The struct that declares a [[models]] table: an upstream model when its engine is "openai"."""
    return UpstreamModel if table.get("engine") == "openai" else LocalModel


_MODEL_KEYS = table_keys(LocalModel)  # the keys of a local model's table
_UPSTREAM_MODEL_KEYS = table_keys(UpstreamModel)
_EMBEDDING_KEYS = ("pooling", "normalize", "matryoshka", "tokenizer", "tokenizer_package_file")


def _local_model(table: dict[str, Any], key: str, where: Where) -> LocalModel:
    # An embedding request has no first token to hurry: its inputs share steps.
    defaults: dict[str, Any] = {}
    if table.get("kind") == "embedding":
        defaults["prefills_per_step"] = 0
    if table.get("engine") == "onnx":
        # An onnx model (BERT-like) has 512 learned positions; its passes are padded, inputs x longest.
        # One thread runs them, one call at a time: one slot, which every listing then shows.
        defaults.update(context_length=512, batch_tokens=8192, slots=1)
    m = decode(LocalModel, table, key, where, defaults or None)
    if m.engine == "onnx" and m.kind != "embedding":
        raise where.fail(f"{key}.engine", "the onnx engine serves embedding models only: add kind = \"embedding\"")
    if m.engine == "onnx" and m.slots != 1:
        raise where.fail(f"{key}.slots", "the onnx engine runs one call at a time (a call's inputs share its passes): leave slots out")
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


def read_models(raw: dict[str, Any], where: Where) -> tuple[ModelSettings, ...]:
    tables = array_at(raw, "models", where)
    if not tables:
        raise where.fail("models", "no models declared: add at least one [[models]] table")
    models = tuple((_upstream_model if model_type(t) is UpstreamModel else _local_model)(t, f"models[{i}]", where)
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
