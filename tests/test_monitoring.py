"""docs/monitoring/: the Grafana dashboard and the alert rules name only metrics a real server
exports, and the Prometheus config scrapes it. One server (keys mode, [server] metrics_auth =
"admin", the semantic cache on, prices, a rate limit, a budget and an upstream model that is down)
is driven until every series the files read exists: a miss and a hit, a rate-limit refusal, a
budget refusal, a refused key. Where promtool and prometheus are installed (Debian: `apt-get install
prometheus`), promtool checks the config and the rules, and a real Prometheus scrapes the server
with the config's bearer key file and evaluates every panel's query and every rule."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import CHAT_MODEL, ROOT, Server, config_text, free_port, start_server, stop_server

MONITORING = ROOT / "docs" / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana-dashboard.json").read_text())
PROMETHEUS_ONLY = {"up"}  # series Prometheus makes for each target itself
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$model": ".*"}  # what the checks put in their place


def binary(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.is_file()), None)


PROMTOOL, PROMETHEUS = binary("promtool"), binary("prometheus")

# -- reading metric names out of PromQL ------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
             "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (followed by
    "("), keywords, label names (inside {} or a grouping's ()), ranges, strings or Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, histogram bounds
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # grouping labels
    text = re.sub(r"\$\w+", "", text)
    found = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name, after = match.group(), text[match.end():].lstrip()
        if after.startswith("(") or name.lower() in _KEYWORDS or re.fullmatch(r"\d*e\d*", name):
            continue
        if match.start() and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the tail of a number such as 1e9
        found.add(name)
    return found


def test_metric_names_are_read_from_promql() -> None:
    quantile = 'histogram_quantile(0.95, sum by (le, model) (rate(appliance_x_bucket{model=~"$model"}[$__rate_interval])))'
    assert metric_names(quantile) == {"appliance_x_bucket"}
    assert metric_names("sum(rate(a_total[5m])) * 3600 / 1e9 or (count by (model) (b) * 0)") == {"a_total", "b"}
    assert metric_names('resets(c{route="/metrics"}[15m]) > 0 and on (model) d == bool 1') == {"c", "d"}


def dashboard_panels() -> list[dict]:
    panels = []
    for panel in DASHBOARD["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return panels


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]


def variable_metrics() -> set[str]:
    """The metrics the dashboard's variables read (Grafana's label_values(metric, label))."""
    return {m for v in DASHBOARD["templating"]["list"] if v["type"] == "query"
            for m in re.findall(r"label_values\((\w+)\s*,", v["definition"])}


def alert_rules() -> list[dict]:
    yaml = pytest.importorskip("yaml")
    document = yaml.safe_load((MONITORING / "appliance-alerts.yml").read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def filled(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


# -- a server with every series -------------------------------------------------------------------


@dataclass
class Box:
    server: Server
    admin: str
    member: str
    metrics: str  # a scrape's text, with the admin key, after every kind of call


def cli(server: Server, *args: str) -> str:
    config = str(server.home.parent / "models.toml")
    done = subprocess.run([sys.executable, "-m", "appliance.cli.main", *args, "--config", config],
                          cwd=ROOT, env={**os.environ, "APPLIANCE_HOME": str(server.home)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def new_key(server: Server, user: str, *, admin: bool = False) -> str:
    out = cli(server, "keys", "create", "--tenant", "acme", "--app", "web", "--user", user, "--role", "member",
              *(["--admin"] if admin else []))
    return out.strip().splitlines()[-1]  # the secret, alone on the last line


def chat(server: Server, key: str, question: str = "Name a colour.") -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
                            "temperature": 0})


def scrape(server: Server, key: str | None) -> httpx.Response:
    return httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    down = free_port()  # nothing listens there: the upstream's health and breaker series
    extra = f"""
[[limits]]
level = "user"
name = "limited"
requests_per_minute = 1

[[models]]
alias = "remote"
engine = "openai"
base_url = "http://127.0.0.1:{down}/v1"
health_interval_s = 1.0
"""
    config = config_text(auth="keys", cache="enabled = true", price_in=1.0, price_out=2.0, embeddings=False, extra=extra)
    config = config.replace("[server]\n", '[server]\nmetrics_auth = "admin"\n', 1)
    server = start_server(tmp_path_factory.mktemp("monitored"), config)
    try:
        admin, member, limited, broke = (new_key(server, "prometheus", admin=True), new_key(server, "ann"),
                                         new_key(server, "limited"), new_key(server, "broke"))
        cli(server, "budgets", "set", "user", "broke", "--usd", "0.000001", "--period", "day")
        assert chat(server, member).headers["x-cache"] == "miss"
        deadline = time.monotonic() + 30
        while chat(server, member).headers.get("x-cache") != "hit":  # the answer is stored off the request path
            assert time.monotonic() < deadline, "the repeated question never hit the cache"
            time.sleep(0.5)
        assert chat(server, limited).status_code == 200
        refused = chat(server, limited)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
        over = chat(server, broke, "Name a fruit.")  # not the cached question: a hit costs nothing
        assert over.status_code == 429 and over.json()["error"]["code"] == "budget_exceeded", over.text
        assert chat(server, "apl-not-a-key").status_code == 401
        deadline = time.monotonic() + 60
        # The cache scores its known near misses after start; the bound's gauges follow.
        while "appliance_cache_false_hit_estimate{" not in (text := scrape(server, admin).text):
            assert time.monotonic() < deadline, "the cache's error bound never showed in /metrics"
            time.sleep(0.5)
        yield Box(server, admin, member, text)
    finally:
        stop_server(server)


def exported(metrics: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and not line.startswith("#")}


def test_metrics_need_an_admin_key_with_metrics_auth_admin(box: Box) -> None:
    assert scrape(box.server, None).status_code == 401
    member = scrape(box.server, box.member)
    assert member.status_code == 403 and member.json()["error"]["code"] == "admin_required"
    assert scrape(box.server, box.admin).status_code == 200


def test_every_metric_the_dashboard_reads_is_exported(box: Box) -> None:
    names = set().union(*map(metric_names, dashboard_exprs())) | variable_metrics()
    assert len(names) >= 20, names  # the reader found the dashboard's metrics
    assert sorted(names - exported(box.metrics)) == []


def test_every_metric_the_alerts_read_is_exported(box: Box) -> None:
    names = set().union(*(metric_names(rule["expr"]) for rule in alert_rules())) - PROMETHEUS_ONLY
    assert len(names) >= 7, names
    assert sorted(names - exported(box.metrics)) == []


def test_the_dashboard_has_the_panels_the_guide_names() -> None:
    panels = dashboard_panels()
    assert len({p["id"] for p in panels}) == len(panels)
    titles = {p["title"] for p in panels}
    for title in ("Responses by HTTP status class", "Time to first token", "Tokens per second", "Queue depth and slots",
                  "Cache hit rate", "Cache false hits: estimate and 95% upper vs bound, by language", "Spend",
                  "Refused: rate limits, budgets, keys", "Local models loaded"):
        assert title in titles
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    spend = next(p for p in panels if p["title"] == "Spend")
    # The counter is in dollars, as the panel shows them.
    assert "appliance_spend_usd_total" in spend["targets"][0]["expr"] and spend["fieldConfig"]["defaults"]["unit"] == "currencyUSD"


def test_the_prometheus_config_scrapes_metrics_with_a_bearer_key_file() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert config["rule_files"] == ["appliance-alerts.yml"]
    assert len(alert_rules()) >= 8


def test_the_operating_guide_shows_the_shipped_config() -> None:
    guide = (ROOT / "docs" / "operating.md").read_text()
    assert (MONITORING / "prometheus.yml").read_text().strip() in guide


# -- promtool and a real Prometheus -----------------------------------------------------------------


def rendered_config(folder: Path, *, key: str, target: str | None = None) -> Path:
    """The shipped prometheus.yml with the test's key file (and target), beside the shipped rules."""
    text = (MONITORING / "prometheus.yml").read_text()
    key_file = folder / "appliance.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o400)
    text = text.replace("/etc/prometheus/appliance.key", str(key_file))
    if target is not None:
        for old, new in (("scheme: https", "scheme: http"), ('"llm.example.com:443"', f'"{target}"'),
                         ("scrape_interval: 15s", "scrape_interval: 1s"),
                         ("evaluation_interval: 15s", "evaluation_interval: 1s")):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
    shutil.copy(MONITORING / "appliance-alerts.yml", folder / "appliance-alerts.yml")
    path = folder / "prometheus.yml"
    path.write_text(text)
    return path


def test_promtool_checks_the_config_and_the_rules(tmp_path: Path) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([PROMTOOL, "check", "config", str(rendered_config(tmp_path, key="apl-x"))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout + done.stderr


def query(prometheus: str, expr: str) -> dict:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]


def test_a_real_prometheus_scrapes_with_the_key_file_and_evaluates_every_query(box: Box, tmp_path: Path) -> None:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    port = free_port()
    config = rendered_config(tmp_path, key=box.admin, target=box.server.base_url.removeprefix("http://"))
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)
    prometheus = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # up, and scraped often enough that a 30 s rate has two points
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if query(prometheus, 'count_over_time(up{job="appliance"}[1m]) >= 3 and up{job="appliance"} == 1')["result"]:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for expr in dashboard_exprs():
            assert query(prometheus, filled(expr))["result"], f"no series for {expr}"
        models = httpx.get(f"{prometheus}/api/v1/label/model/values", params={"match[]": "appliance_slots_total"},
                           timeout=30).json()
        assert CHAT_MODEL in models["data"]
        deadline = time.monotonic() + 30
        while True:  # every rule evaluated once, without an error
            rules = [r for g in httpx.get(f"{prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"] for r in g["rules"]]
            if len(rules) == len(alert_rules()) and all(r["health"] == "ok" for r in rules):
                break
            assert time.monotonic() < deadline, [(r["name"], r["health"], r.get("lastError")) for r in rules]
            time.sleep(0.5)
        # The upstream no server answers for: its rule reads the real series (pending for its 5 minutes).
        alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=30).json()["data"]["alerts"]
        named = {(a["labels"]["alertname"], a["labels"].get("model")) for a in alerts}
        assert ("ApplianceUpstreamDown", "remote") in named, alerts
    finally:
        process.terminate()
        process.wait(timeout=30)
