"""The other sections of models.toml: server, defaults, auth, budgets, limits, cache, tracing,
routes, guardrails and distill."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from appliance.config.fields import DAY_S, MAX_CONTEXT, MAX_UPSTREAM_CONTEXT, Alias, Table, Tier, Url, array_at, table_at
from appliance.config.models import ModelSettings, UpstreamModel
from appliance.config.paths import default_data_dir
from appliance.config.schema import ConfigError, Where, decode
from appliance.config.values import MemoryBudget
from appliance.evaluation import calibration_file
from policy.limits import LIMIT_LEVELS, LimitRule
from policy.router import Calibration, family_rank, split_tier


class ServerSettings(Table, frozen=True, kw_only=True):
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
    request_log_days: Annotated[float, Meta(ge=0.01, le=3650.0, description=(
        "how long the request log keeps a request's row (tokens, cost, latency: the console's history); older ones are deleted"))] = 90.0
    responses_days: Annotated[float, Meta(ge=0.01, le=3650.0, description=(
        "how long a stored response (`store: true`) can be read or continued from; older ones are deleted, as OpenAI's are after 30 days"))] = 30.0
    log_format: Annotated[Literal["text", "json"], Meta(
        description="the server's log lines: \"text\" for a person, \"json\" (one object a line) for a log shipper")] = "text"
    access_log: Annotated[Literal["calls", "all", "off"], Meta(description=(
        "a line per request (id, caller, model, tokens, cache and route outcome, status, latency; never prompt text or keys): "
        "\"calls\" leaves out reads of /health, /metrics and /admin (monitors and the console poll them), \"all\" logs them too"))] = "calls"

    @property
    def api_path_roots(self) -> tuple[Path, ...]:
        return (self.data_dir, *self.model_dirs)


class Defaults(Table, frozen=True, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_UPSTREAM_CONTEXT, description="a request's max_tokens when it gives none")] = 1024
    temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="a request's temperature when it gives none")] = 1.0
    top_p: Annotated[float, Meta(ge=0.0, le=1.0, description="a request's top_p when it gives none")] = 1.0


class OpenPrincipal(Table, frozen=True, kw_only=True):
    user: Annotated[str, Meta(description="who every request is, with mode = \"open\"")] = "local"
    tenant: Annotated[str, Meta(description="its tenant")] = "local"
    app: Annotated[str, Meta(description="its app")] = "local"
    role: Annotated[str, Meta(description="its role")] = "developer"
    admin: Annotated[bool, Meta(description="whether it may call the admin API")] = False


class AuthSettings(Table, frozen=True, kw_only=True):
    mode: Annotated[Literal["keys", "open"], Meta(
        description="\"keys\": every request needs a key; \"open\": none, every request is open_principal (local development)")] = "keys"
    open_principal: Annotated[OpenPrincipal, Meta(description="who requests are with mode = \"open\"")] = \
        msgspec.field(default_factory=OpenPrincipal)
    key_cache_s: Annotated[float, Meta(ge=0.0, le=3600.0, description="how long a checked key is trusted before it is looked up again")] = 5.0


class BudgetSettings(Table, frozen=True, kw_only=True):
    enabled: Annotated[bool, Meta(description="charge calls to dollar budgets (`appliance budgets set`)")] = True
    lease_s: Annotated[float, Meta(ge=1.0, le=DAY_S, description="a reservation's lease; only a crashed process's expire")] = 300.0
    clamp_max_tokens: Annotated[bool, Meta(description="lower max_tokens to what a budget covers, rather than refuse")] = True
    min_tokens: Annotated[int, Meta(ge=1, le=MAX_CONTEXT, description="... but refuse if fewer than this would remain")] = 16


class LimitSettings(Table, frozen=True, kw_only=True):
    level: Annotated[Literal[LIMIT_LEVELS], Meta(description=f"one of {', '.join(LIMIT_LEVELS)}")]  # type: ignore[valid-type]
    name: Annotated[str, Meta(description="the key, user, tenant or app; \"*\": each one separately")] = "*"
    requests_per_minute: Annotated[int, Meta(ge=1, le=10**9, description="requests a minute; none: no limit")] | None = None
    tokens_per_minute: Annotated[int, Meta(ge=1, le=10**12, description="tokens a minute; none: no limit")] | None = None


# The embedders that ship inside packages, by the name `[cache] embedder` gives them (fleet/embedders.py
# loads each; the shipped traps carry each one's cosines).
BUNDLED_EMBEDDERS = {"minilm": "shipped, English", "e5-small": "shipped, multilingual"}


class CacheSettings(Table, frozen=True, kw_only=True):
    enabled: Annotated[bool, Meta(description="the semantic cache: a reworded question gets a stored answer")] = True
    embedder: Annotated[str, Meta(description=", ".join(f'"{k}" ({v})' for k, v in BUNDLED_EMBEDDERS.items())
                                  + ', or the alias of a model of kind "embedding"')] = "minilm"
    # Tuned on tests/data/cache_pairs.jsonl with the near-miss guards (bench/cache_quality.py).
    similarity_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="the cosine similarity of a hit")] = 0.70
    max_false_hit_rate: Annotated[float, Meta(ge=0.0, le=0.5, description=(
        "serve a similar question's answer only where, at 95% confidence, at most this share of near misses in its language "
        "is served (counted on the shipped traps and callers' reports); 0: no bound, the thresholds and judge_band decide"))] = 0.02
    judge_band: Annotated[float, Meta(ge=0.0, le=1.0, description="from here up to the threshold, judge_model decides",
                                      extra={"default_from": "similarity_threshold"})] = 0.70
    judge_model: Annotated[str | None, Meta(description=(
        "a local chat model asked \"same answer?\" in the band; under max_false_hit_rate it is asked once its answers on the "
        "known traps give it a cut of its own; none: the band is a miss"))] = None
    judge_min_probability: Annotated[float, Meta(ge=0.0, le=1.0, description=(
        "the judge's P(yes) that makes a hit with max_false_hit_rate = 0 (under a bound the judge's own cut decides)"))] = 0.85
    freshness_s: Annotated[float, Meta(ge=1.0, le=3650 * DAY_S, description="how long an answer is served")] = 7 * 86400.0
    serve_unverified: Annotated[bool, Meta(description="serve answers nobody has confirmed yet")] = True
    max_temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="hotter requests are not cached")] = 0.3
    cache_unset_temperature: Annotated[bool, Meta(description="a request that sets no temperature leaves sampling to the server and "
                                                  "may be cached; false: it is judged by [defaults] temperature")] = True
    max_entries_per_tenant: Annotated[int, Meta(ge=1, le=10**8, description="entries kept per tenant")] = 10_000
    sweep_interval_s: Annotated[float, Meta(ge=0.0, le=DAY_S, description="re-ask valuable entries when idle this often; 0: no sweeps")] = 300.0
    sweep_batch: Annotated[int, Meta(ge=1, le=1000, description="entries re-asked per sweep")] = 2
    agree_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="a re-asked answer this similar to the stored one agrees")] = 0.90


class TracingSettings(Table, frozen=True, kw_only=True):
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


class RouteSettings(Table, frozen=True, kw_only=True):
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


class GuardrailSettings(Table, frozen=True, kw_only=True):
    pii: Annotated[Literal["off", "flag", "block"], Meta(
        description="personal data in a request: \"flag\" (traced and counted) or \"block\" (refused, 400)")] = "flag"
    judge_model: Annotated[str | None, Meta(
        description="a local chat model asked whether unsure text tries to instruct the system; its tokens are charged")] = None
    judge_action: Annotated[Literal["flag", "block"], Meta(description="what a judged injection gets")] = "flag"
    judge_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description="the judge's P(yes) at which text is an injection")] = 0.5


class DistillSettings(Table, frozen=True, kw_only=True):
    """Distillation: the appliance's verified answers teach its cheapest tier (docs/architecture.md)."""

    tenants: Annotated[tuple[str, ...], Meta(
        description="the tenants whose prompts and answers are kept to train on; empty: nobody's, nothing is kept",
        extra={"rule": "a list of tenant names"})] = ()
    retention_days: Annotated[float, Meta(ge=0.01, le=3650.0, description="how long a kept answer stays for `appliance distill export`")] = 30.0
    margin: Annotated[float, Meta(ge=0.0, le=1.0, description="how far below the teacher's accuracy a distilled adapter may score (a share of it) and still be promoted")] = 0.1


def read_limits(raw: dict[str, Any], where: Where) -> tuple[LimitRule, ...]:
    rules: list[LimitRule] = []
    for i, table in enumerate(array_at(raw, "limits", where)):
        r = decode(LimitSettings, table, f"limits[{i}]", where)
        if any((rule.level, rule.name) == (r.level, r.name) for rule in rules):
            raise where.fail(f"limits[{i}].name", f"a second rule for {r.level} {r.name!r}")
        if r.requests_per_minute is None and r.tokens_per_minute is None:
            raise where.fail(f"limits[{i}].requests_per_minute", "give requests_per_minute, tokens_per_minute, or both")
        rules.append(LimitRule(r.level, r.name, r.requests_per_minute, r.tokens_per_minute))
    return tuple(rules)


def read_cache(raw: dict[str, Any], where: Where) -> CacheSettings:
    cache = decode(CacheSettings, table_at(raw, "cache", where), "cache", where)
    if cache.judge_band > cache.similarity_threshold:
        raise where.fail("cache.judge_band", f"must be at most similarity_threshold ({cache.similarity_threshold}), got {cache.judge_band}")
    return cache


def read_routes(raw: dict[str, Any], models: tuple[ModelSettings, ...], where: Where) -> tuple[RouteSettings, ...]:
    chat = {m.alias for m in models if m.kind == "chat"}
    upstream = {m.alias for m in models if isinstance(m, UpstreamModel)}
    adapters = {m.alias: {a.name for a in getattr(m, "adapters", ())} for m in models}
    routes: list[RouteSettings] = []
    for i, table in enumerate(array_at(raw, "routes", where)):
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
