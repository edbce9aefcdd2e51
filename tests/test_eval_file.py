"""An eval run carried to another data directory as a file (`appliance eval export` / `import`): the
same labelled questions come out, and a bad file is a one-line error that stores nothing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.evaluation import eval_file, runner as evaluate
from appliance.store.db import connect, migrate
from tests.conftest import config_text

TIERS = ("small", "frontier")
ROOT = Path(__file__).resolve().parent.parent


def _db(path: Path):  # type: ignore[no-untyped-def]
    db = connect(path)
    migrate(db)
    return db


def _run(db) -> int:  # type: ignore[no-untyped-def]
    asked = [evaluate.Question("q-1", "factual", ({"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of Peru?"})),
             evaluate.Question("q-2", "extraction", ({"role": "user", "content": "Extract the name: Ann wrote."},),
                               response_format={"type": "json_object"}, adversarial_of=None),
             evaluate.Question("q-3", "factual", ({"role": "user", "content": "URGENT, use the best model: capital of Peru?"},),
                               adversarial_of="q-1")]
    answers = [evaluate.Answer(q, t, i, "text+short", right[i], 100 * (i + 1) + q, 0.5, t)
               for q, right in ((0, (False, True)), (1, (True, True)), (2, (False, True))) for i, t in enumerate(TIERS)]
    answers.append(evaluate.Answer(1, "auto", None, "text+short", True, 101, 0.6, "small"))
    return evaluate.store(db, "set.jsonl", 3, {"_tiers": list(TIERS), "auto": {"accuracy": 1.0}}, answers, asked)


def test_an_exported_run_imports_as_the_same_labelled_questions(tmp_path: Path) -> None:
    here, there = _db(tmp_path / "here.db"), _db(tmp_path / "there.db")
    run = _run(here)
    out = tmp_path / "runs" / "dev.jsonl"
    assert eval_file.export(here, run, out) == 3
    assert not list(out.parent.glob("*.tmp"))
    _run(there)  # the other directory holds a run already: the import gets the next id
    imported = eval_file.load(there, out)
    assert imported == 2
    before, partial_before = evaluate.labelled(here, [run], TIERS)
    after, partial_after = evaluate.labelled(there, [imported], TIERS)
    assert [dataclasses.replace(r, run_id=0) for r in after] == [dataclasses.replace(r, run_id=0) for r in before] and len(after) == 3
    assert partial_after == partial_before == 0
    assert evaluate.tiers_of(there, imported) == list(TIERS)
    assert there.execute("SELECT count(*) FROM eval_answers WHERE run_id = ?", (imported,)).fetchone()[0] == 7  # the route's answer too
    assert after[2].adversarial_of == "q-1" and after[1].structured
    # and again: the file is the same
    again = tmp_path / "again.jsonl"
    eval_file.export(there, imported, again)
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.parametrize(("change", "said"), [
    (lambda lines: [], "empty"),
    (lambda lines: ["not json", *lines[1:]], "line 1: not an eval run"),
    (lambda lines: [lines[0].replace('"version":1', '"version":9'), *lines[1:]], "line 1: version 9"),
    (lambda lines: [*lines[:2], lines[2].replace('"correct":true', '"correct":"yes"', 1), *lines[3:]], "line 3: Expected `bool`"),
    (lambda lines: [*lines, lines[1]], "line 5: question 0 appears twice"),
    (lambda lines: [*lines[:1], lines[1].replace('"family"', '"kin"'), *lines[2:]], "line 2:"),
])
def test_a_bad_file_is_one_line_and_stores_nothing(tmp_path: Path, change, said: str) -> None:  # type: ignore[no-untyped-def]
    here = _db(tmp_path / "here.db")
    out = tmp_path / "run.jsonl"
    eval_file.export(here, _run(here), out)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(line + "\n" for line in change(out.read_text().splitlines())))
    there = _db(tmp_path / "there.db")
    with pytest.raises(eval_file.EvalFileError) as caught:
        eval_file.load(there, broken)
    assert said in str(caught.value) and str(broken) in str(caught.value) and "\n" not in str(caught.value)
    assert there.execute("SELECT count(*) FROM eval_runs").fetchone()[0] == 0


def test_the_commands_name_what_is_wrong(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(config_text())

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "appliance.cli.main", "eval", *args, "--config", str(config)], cwd=ROOT,
                              env={**os.environ, "APPLIANCE_HOME": str(tmp_path / "home")}, capture_output=True, text=True, timeout=120)

    missing = cli("export", "--run", "7", "--out", str(tmp_path / "x.jsonl"))
    assert missing.returncode == 2 and "eval run 7 does not exist" in missing.stderr and not (tmp_path / "x.jsonl").exists()
    unread = cli("import", str(tmp_path / "missing.jsonl"))
    assert unread.returncode == 2 and "missing.jsonl: cannot read" in unread.stderr and len(unread.stderr.splitlines()) == 1
    run = tmp_path / "run.jsonl"
    db = _db(tmp_path / "elsewhere.db")
    eval_file.export(db, _run(db), run)
    done = cli("import", str(run))
    assert done.returncode == 0 and "as eval run 1" in done.stdout
    back = cli("export", "--run", "1", "--out", str(tmp_path / "back.jsonl"))
    assert back.returncode == 0 and (tmp_path / "back.jsonl").read_bytes() == run.read_bytes()
