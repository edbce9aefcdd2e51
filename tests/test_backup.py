"""`appliance backup` while a real server serves and charges, and `appliance restore` once it has
stopped: what was in the database at the backup comes back, what came after goes, and the server
starts on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, start_server, stop_server
from tests.test_gate_api import ask, client, db, gate_config, new_key, wait_settled


def appliance(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APPLIANCE_HOME": str(workdir / "home")}
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *args, "--config", str(workdir / "models.toml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_backup_made_while_serving_restores_what_it_held(tmp_path: Path) -> None:
    work = tmp_path / "box"
    server = start_server(work, gate_config())
    try:
        before = new_key(server, "acme")
        answered = ask(client(server, before))
        wait_settled(server)
        made = appliance(work, "backup", str(tmp_path / "copy.db"))
        assert made.returncode == 0, made.stderr
        assert "migrations" in made.stdout and "models.toml" in made.stdout
        after = new_key(server, "globex")
        refused = appliance(work, "restore", str(tmp_path / "copy.db"), "--url", server.base_url)
        assert refused.returncode == 1 and "stop it before restoring" in refused.stderr
        again = appliance(work, "backup", str(tmp_path / "copy.db"))
        assert again.returncode == 1 and "already exists" in again.stderr
    finally:
        stop_server(server)
    restored = appliance(work, "restore", str(tmp_path / "copy.db"), "--url", server.base_url)
    assert restored.returncode == 0, restored.stderr
    assert len(list((work / "home").glob("appliance.db.before-restore-*"))) == 1
    server = start_server(work, gate_config())
    try:
        assert ask(client(server, before)).choices  # the key from before the backup works
        with pytest.raises(openai.AuthenticationError):
            ask(client(server, after))  # the one made after it is gone
        settled = db(server).execute("SELECT count(*) FROM settlements WHERE request_id = ?", (answered.id,)).fetchone()[0]
        assert settled == 1  # the spend it held is there
    finally:
        stop_server(server)


def test_restore_refuses_a_file_that_is_not_a_sound_appliance_database(tmp_path: Path) -> None:
    work = tmp_path / "box"
    work.mkdir()
    (work / "models.toml").write_text(gate_config())
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    refused = appliance(work, "restore", str(junk), "--url", "http://127.0.0.1:9")
    assert refused.returncode == 1 and str(junk) in refused.stderr
    assert not (work / "home" / "appliance.db").exists()  # nothing was replaced


def test_the_cli_takes_its_key_url_and_config_from_the_environment_or_a_key_file(tmp_path: Path) -> None:
    work = tmp_path / "box"
    server = start_server(work, gate_config())
    try:
        admin = new_key(server, "ops", admin=True)
        keyfile = tmp_path / "admin.key"
        keyfile.write_text(admin + "\n")
        base = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
        env = {**base, "APPLIANCE_HOME": str(work / "home"), "APPLIANCE_CONFIG": str(work / "models.toml"),
               "APPLIANCE_URL": server.base_url}

        def ps(**extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "appliance.cli.main", "ps", "--json"], cwd=ROOT, env={**env, **extra},
                                  capture_output=True, text=True, timeout=60)

        assert ps().returncode != 0  # keys mode, no key: refused
        for way in ({"APPLIANCE_KEY": admin}, {"APPLIANCE_KEY_FILE": str(keyfile)}):
            listed = ps(**way)
            assert listed.returncode == 0, listed.stderr
            assert "HTTP Request" not in listed.stderr  # httpx's line per request stays quiet
        missing = ps(APPLIANCE_KEY_FILE=str(tmp_path / "nope.key"))
        assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nope.key'}: key file: cannot be read (No such file or directory)"
        version = subprocess.run([sys.executable, "-m", "appliance.cli.main", "--version"], cwd=ROOT, capture_output=True, text=True)
        assert version.stdout.startswith("appliance ")
    finally:
        stop_server(server)
