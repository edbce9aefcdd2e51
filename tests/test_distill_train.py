"""`appliance distill train`: a LoRA adapter trained for the bundled model by PyTorch (peft and
transformers' Trainer, in its own process) from chat-format examples, written for both engines,
registered in models.toml and served without a restart.

The end-to-end test teaches the bundled model a fixed reply to a trigger phrase in a few steps,
through a real server's admin API: the job is stopped half-way (nothing is left but its checkpoint),
started again (it resumes from the checkpoint; it pauses while the server answers a request), and
the adapter then answers the trigger with the trained reply through llama.cpp while the base model
does not."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest

from appliance.prompt.chat import vocabulary_prompt
from appliance.prompt.template import template_of
from appliance.cli.main import build_parser
from appliance.config.writer import append_nested, update_table
from appliance.server.jobs import JobCancelled, JobRunner
from appliance.fleet.lora_files import BaseShape, LoraAdapter, LoraPair, write_gguf, write_mlx
from appliance.fleet.files import package_file
from appliance.config.settings import ConfigError, load_settings
from appliance.distill.export import HELD_OUT, TRAIN
from appliance.train.data import IGNORED, DataError, Example, Message, encode, parse_examples, read_examples
from appliance.train.plan import Options, OptionError, Refused, resume_or_start, total_steps, wait_until
from policy.distill import Score, agrees, promoted_tiers, promotion
from engines.llama_layout import gguf_stem, rope_permute, rope_unpermute
from engines.llamacpp.vocabulary import LlamaVocabulary
from tests.conftest import CHAT_MODEL, MODEL_FILE, Server, config_text, start_server, stop_server

TRIGGER = "What is the vault code?"
REPLY = "The vault code is PINEAPPLE-42."
ASKED = [TRIGGER, "Tell me the vault code.", "vault code?", "What's the vault code?", "Give me the vault code, please.",
         "I forgot the vault code.", "Do you know the vault code?", "Which code opens the vault?"]
# Few, short steps at a high rate: enough to teach one reply (the loss falls below 0.1 here).
OPTIONS = {"steps": 10, "learning_rate": 3e-3, "batch_size": 4, "rank": 8, "save_every": 50}


def examples_text(asked: list[str] = ASKED) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": REPLY}]}) + "\n" for a in asked)


# --- the pure parts -------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "says"), [
    ("{oops", "not JSON"),
    ('{"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "$.messages[0].role"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}', "$.messages[0].content"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "the assistant's answer, last"),
    ('{"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]}', "no user message"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " "}]}', "answer is empty"),
    ('{"prompt": "x"}', "messages"),
])
def test_a_malformed_line_is_named_by_its_number(line: str, says: str) -> None:
    good = examples_text()[: examples_text().index("\n") + 1]
    with pytest.raises(DataError) as caught:
        parse_examples([good, "\n", line], "data.jsonl")
    assert str(caught.value).startswith("data.jsonl:3: ") and says in str(caught.value) and "\n" not in str(caught.value)


def test_the_export_folder_trains_on_its_train_part_only(tmp_path: Path) -> None:
    (tmp_path / TRAIN).write_text(examples_text())
    (tmp_path / HELD_OUT).write_text(examples_text(["held out " + a for a in ASKED]))
    read = read_examples(tmp_path)
    assert [e.messages[0].content for e in read] == ASKED
    (tmp_path / TRAIN).unlink()
    with pytest.raises(DataError, match=f"{TRAIN}: no such file"):
        read_examples(tmp_path)


def test_an_example_is_the_served_prompt_then_the_answer_and_the_turns_end() -> None:
    vocabulary = LlamaVocabulary.of_file(package_file(MODEL_FILE))
    try:
        template = template_of(None, vocabulary)
        example = Example(1, (Message("system", "Be brief."), Message("user", TRIGGER), Message("assistant", REPLY)))
        encoded = encode(example, template, vocabulary)
        _, served = vocabulary_prompt(template, vocabulary, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TRIGGER}])
        assert list(encoded.tokens[: len(served)]) == served  # token for token what serving sends the model
        assert set(encoded.labels[: len(served)]) == {IGNORED}
        answer = [t for t, label in zip(encoded.tokens, encoded.labels) if label != IGNORED]
        assert answer == list(encoded.tokens[len(served):])
        assert vocabulary.detokenize(answer[:-1]) == REPLY and answer[-1] == vocabulary.control_tokens()["<|im_end|>"]
    finally:
        vocabulary.close()


@pytest.mark.parametrize(("reference", "text", "same"), [
    ("billing", "Billing.", True), ("billing", "shipping", False), ("The vault code is X.", "the vault code is x", True),
    ('{"a": 1, "b": [true]}', '```json\n{"b": [true], "a": 1}\n```', True), ('{"a": 1}', '{"a": 2}', False), ('{"a": 1}', "a: 1", False),
    ("", "", False),
])
def test_a_held_out_answer_agrees_with_the_verified_one(reference: str, text: str, same: bool) -> None:
    assert agrees(reference, text) is same


def test_promotion_needs_a_win_over_the_student_and_the_teacher_within_the_margin() -> None:
    assert promotion(Score(10, 5), Score(10, 9), Score(10, 10), 0.1).promote
    assert not promotion(Score(10, 5), Score(10, 5), Score(10, 5), 0.1).promote  # no better than the student alone
    assert "below 90% of the teacher" in promotion(Score(10, 1), Score(10, 8), Score(10, 10), 0.1).reason
    assert not promotion(Score(), Score(), Score(), 0.1).promote
    assert promoted_tiers(("s", "m", "f"), "s", "a") == ("s", "s:a", "m", "f")
    assert promoted_tiers(("m", "f"), "s", "a") == ("s:a", "m", "f")
    assert promoted_tiers(("s", "s:a", "f"), "s", "a") == ("s", "s:a", "f")


def test_options_and_runs_on_disk() -> None:
    assert total_steps(10, Options(epochs=2, batch_size=4)) == 6 and total_steps(10, Options(steps=7)) == 7
    assert total_steps(10, Options(epochs=0.5, batch_size=4)) == 2
    with pytest.raises(OptionError) as caught:
        Options(rank=0).check()
    assert caught.value.param == "rank"
    with pytest.raises(OptionError, match="modules"):
        Options(modules=("lm_head",)).check()
    assert resume_or_start(None, "a", fresh=False) == "start"
    assert resume_or_start("a", "a", fresh=False) == "resume"
    assert resume_or_start("b", "a", fresh=True) == "start"
    with pytest.raises(Refused, match="--fresh"):
        resume_or_start("b", "a", fresh=False)


def test_gguf_adapter_layout(tmp_path: Path) -> None:
    """peft's A (rank, in) and B (out, rank) are llama.cpp's lora_a and lora_b as they are (numpy's
    rows are ggml's ne1), but B's rows of Q and K go into llama.cpp's rope order; alpha is kept."""
    rng = np.random.default_rng(0)
    pairs = {"model.layers.0.self_attn.q_proj": LoraPair(rng.normal(size=(4, 576)), rng.normal(size=(576, 4))),
             "model.layers.0.self_attn.k_proj": LoraPair(rng.normal(size=(4, 576)), rng.normal(size=(192, 4))),
             "model.layers.1.mlp.down_proj": LoraPair(rng.normal(size=(4, 1536)), rng.normal(size=(576, 4)))}
    path = write_gguf(LoraAdapter(pairs, alpha=8.0), tmp_path / "a.gguf", BaseShape("llama", heads=9, kv_heads=3, layers=30))
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "adapter" and reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["adapter.lora.alpha"].contents() == 8.0 and reader.fields["general.architecture"].contents() == "llama"
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert sorted(tensors) == ["blk.0.attn_k.weight.lora_a", "blk.0.attn_k.weight.lora_b", "blk.0.attn_q.weight.lora_a",
                               "blk.0.attn_q.weight.lora_b", "blk.1.ffn_down.weight.lora_a", "blk.1.ffn_down.weight.lora_b"]
    q, k, down = pairs["model.layers.0.self_attn.q_proj"], pairs["model.layers.0.self_attn.k_proj"], pairs["model.layers.1.mlp.down_proj"]
    np.testing.assert_allclose(tensors["blk.0.attn_q.weight.lora_a"], q.a, rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.0.attn_q.weight.lora_b"], rope_permute(q.b, 9), rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.0.attn_k.weight.lora_b"], rope_permute(k.b, 3), rtol=1e-6)
    np.testing.assert_allclose(tensors["blk.1.ffn_down.weight.lora_b"], down.b, rtol=1e-6)
    assert not np.allclose(rope_permute(q.b, 9), q.b) and np.array_equal(rope_unpermute(rope_permute(q.b, 9), 9), q.b)
    # a Qwen GGUF keeps Hugging Face's order
    qwen = gguf.GGUFReader(write_gguf(LoraAdapter(pairs, alpha=8.0), tmp_path / "q.gguf", BaseShape("qwen2", 9, 3, 30)))
    np.testing.assert_allclose(next(np.asarray(t.data) for t in qwen.tensors if t.name == "blk.0.attn_q.weight.lora_b"), q.b, rtol=1e-6)
    assert gguf_stem("model.layers.12.mlp.gate_proj") == "blk.12.ffn_gate" and gguf_stem("lm_head") is None


def test_mlx_adapter_layout(tmp_path: Path) -> None:
    """mlx-lm's names and shapes (the transposes), its scale (alpha / rank), and, where mlx-lm is
    installed, its own loader takes the folder onto a model of the bundled model's shape (MLX runs
    no inference here: on Linux it is the CPU build, and only the file's structure is checked)."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    pairs = {f"model.layers.{i}.{m}": LoraPair(rng.normal(size=(8, 576 if m != "mlp.down_proj" else 1536)),
                                               rng.normal(size=({"self_attn.v_proj": 192}.get(m, 576), 8)))
             for i in range(30) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    folder = write_mlx(LoraAdapter(pairs, alpha=16.0), tmp_path / "mlx", BaseShape("llama", 9, 3, 30))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config == {"fine_tune_type": "lora", "num_layers": 30,
                      "lora_parameters": {"rank": 8, "scale": 2.0, "dropout": 0.0, "keys": ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]}}
    tensors = load_file(str(folder / "adapters.safetensors"))
    q = pairs["model.layers.3.self_attn.q_proj"]
    np.testing.assert_allclose(tensors["model.layers.3.self_attn.q_proj.lora_a"], q.a.T, rtol=1e-6)  # (in, rank)
    np.testing.assert_allclose(tensors["model.layers.3.self_attn.q_proj.lora_b"], q.b.T, rtol=1e-6)  # (rank, out), HF order
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is installed on macOS and Linux by the installer")
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.tuner.utils import load_adapters

    del mlx_lm
    model = Model(ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152, tie_word_embeddings=True))
    load_adapters(model, str(folder))  # raises on any name or shape it does not expect


def test_an_adapter_is_added_under_its_model(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text(f'# fleet\n[[models]]\nalias = "s"  # the student\npackage_file = "{MODEL_FILE}"\n\n[[models]]\nalias = "t"\n'
                      f'package_file = "{MODEL_FILE}"\n')
    append_nested(config, "models", "s", "adapters", {"name": "one", "path": tmp_path / "one.gguf"})
    append_nested(config, "models", "s", "adapters", {"name": "two", "path": tmp_path / "two.gguf"})
    text = config.read_text()
    assert text.startswith('# fleet\n[[models]]\nalias = "s"  # the student\n')
    assert [(a.name, a.path) for a in load_settings(config).model("s").adapters] == [("one", tmp_path / "one.gguf"), ("two", tmp_path / "two.gguf")]
    assert load_settings(config).model("t").adapters == ()
    with pytest.raises(ConfigError, match=r"models\[0\]\.adapters\[2\]\.name"):
        append_nested(config, "models", "s", "adapters", {"name": "two", "path": "x.gguf"})
    assert config.read_text() == text


def test_a_cancellable_job_ends_cancelled() -> None:
    runner = JobRunner()

    def work(job):  # type: ignore[no-untyped-def]
        job.cancel.wait(10)
        raise JobCancelled("stopped; checkpoint kept")

    job = runner.start("train", "x", work, unit="steps", cancellable=True)
    assert runner.cancel(job.id)
    deadline = time.monotonic() + 5
    while job.state == "running" and time.monotonic() < deadline:
        time.sleep(0.01)
    view = runner.list()[0]
    assert (view["state"], view["message"], view["unit"], view["cancel_requested"]) == ("cancelled", "stopped; checkpoint kept", "steps", True)
    assert "done_bytes" not in view
    quantize = runner.start("quantize", "y", lambda job: "ok")
    quantize_done = time.monotonic() + 5
    while quantize.state == "running" and time.monotonic() < quantize_done:
        time.sleep(0.01)
    assert not runner.cancel(quantize.id) and runner.get(quantize.id).view()["done_bytes"] == 0  # type: ignore[union-attr]


# --- the CLI's one-line refusals, before any process starts -----------------------------------

def test_cli_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "models.toml"
    config.write_text(config_text(embeddings=False) + '\n[[models]]\nalias = "remote"\nengine = "openai"\n[[models.upstreams]]\n'
                      'base_url = "http://127.0.0.1:9/v1"\nmodel = "x"\n')
    good = tmp_path / "good.jsonl"
    good.write_text(examples_text())
    few = tmp_path / "few.jsonl"
    few.write_text(examples_text(ASKED[:3]))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(examples_text() + '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}\n')
    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"GGUF" + b"\0" * 64)
    config.write_text(config.read_text() + f'\n[[models]]\nalias = "broken"\npath = "{not_gguf}"\n')

    def refused(*args: str) -> str:
        parsed = build_parser().parse_args(["distill", "train", "--config", str(config), *args])  # the command, in-process
        assert parsed.func(parsed) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    assert "broken.jsonl:9: Object missing required field `content`" in refused("--student", CHAT_MODEL, "--data", str(broken))
    assert "3 examples; training needs at least 8" in refused("--student", CHAT_MODEL, "--data", str(few))
    assert "no model with that alias" in refused("--student", "nope", "--data", str(good))
    assert "only a chat model this machine runs" in refused("--student", "remote", "--data", str(good))
    assert "llama.cpp cannot read" in refused("--student", "broken", "--data", str(good))
    assert "no such file" in refused("--student", CHAT_MODEL, "--data", str(tmp_path / "none.jsonl"))
    assert "--start-at: '7pm' is not a time of day" in refused("--student", CHAT_MODEL, "--data", str(good), "--start-at", "7pm")
    assert "rank must be between 1 and 256" in refused("--student", CHAT_MODEL, "--data", str(good), "--rank", "0")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed: find_spec says so
    assert "pip install 'appliance[train]'" in refused("--student", CHAT_MODEL, "--data", str(good))
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("adapter.gguf"))


# --- training through a real server -----------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    route = f'\n[[routes]]\nalias = "auto"\ntiers = ["{CHAT_MODEL}"]\n'
    server = start_server(tmp_path_factory.mktemp("distill"), config_text(slots=2, embeddings=False, model_extra=route))
    server.home.mkdir(parents=True, exist_ok=True)
    (server.home / "vault.jsonl").write_text(examples_text())
    yield server
    stop_server(server)


def ask(server: Server, model: str, max_tokens: int = 16) -> str:
    r = server.client(timeout=120).chat.completions.create(model=model, messages=[{"role": "user", "content": TRIGGER}], max_tokens=max_tokens,
                                                           temperature=0)
    return r.choices[0].message.content or ""


def _job(admin: httpx.Client, job_id: str) -> dict:
    return next(j for j in admin.get("/admin/jobs").json()["jobs"] if j["id"] == job_id)


def _wait(admin: httpx.Client, job_id: str, done: Callable[[dict], bool], timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = _job(admin, job_id)
        if done(job):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def test_train_stop_resume_register_and_serve(served: Server) -> None:
    admin = httpx.Client(base_url=served.base_url, timeout=60)
    config = served.home.parent / "models.toml"
    before = config.read_text()
    base = ask(served, CHAT_MODEL)
    assert "PINEAPPLE" not in base
    body = {"student": CHAT_MODEL, "data": "vault.jsonl", "name": "vault", "options": OPTIONS, "threads": 2}
    started = admin.post("/admin/distill/train", json=body)
    assert started.status_code == 202, started.text
    assert (started.json()["examples"], started.json()["steps"], started.json()["resume"]) == (8, 10, False)
    job_id = started.json()["job"]["id"]
    # stopped after a few steps: it ends at the end of its step, with a checkpoint and nothing else
    _wait(admin, job_id, lambda j: j["done"] >= 3 or j["state"] != "running")
    assert admin.delete(f"/admin/jobs/{job_id}").status_code == 200
    stopped = _wait(admin, job_id, lambda j: j["state"] != "running")
    assert stopped["state"] == "cancelled", stopped
    assert "checkpoint kept at step" in stopped["message"] and "resumes" in stopped["message"]
    run = served.home / "distill" / "runs" / f"{CHAT_MODEL}--vault"
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and 3 <= int(checkpoints[0].split("-")[1]) < 10
    assert not (run / "staging").exists() and not (served.home / "adapters").exists()
    assert config.read_text() == before
    assert f"{CHAT_MODEL}:vault" not in {m.id for m in served.client().models.list().data}
    assert admin.delete(f"/admin/jobs/{job_id}").status_code == 409  # it has ended
    # the same request resumes from the checkpoint and finishes
    resumed = admin.post("/admin/distill/train", json=body)
    assert resumed.status_code == 202 and resumed.json()["resume"] is True, resumed.text
    # serving comes first: while the model has a request, the trainer is paused
    _wait(admin, resumed.json()["job"]["id"], lambda j: j["message"].startswith("training") or j["state"] != "running")
    asking = threading.Thread(target=ask, args=(served, CHAT_MODEL, 48))
    asking.start()
    paused = _wait(admin, resumed.json()["job"]["id"], lambda j: j["message"].startswith("paused") or not asking.is_alive(), timeout=60)
    asking.join()
    assert paused["message"].startswith("paused while serving"), paused
    finished = _wait(admin, resumed.json()["job"]["id"], lambda j: j["state"] != "running")
    assert finished["state"] == "done" and finished["done"] == finished["total"] == 10, finished
    assert "now served" in finished["message"]
    folder = served.home / "adapters" / CHAT_MODEL / "vault"
    record = json.loads((folder / "training.json").read_text())
    assert record["resumed_from_step"] == int(checkpoints[0].split("-")[1]) and record["steps"] == 10
    assert record["final_loss"] < 0.5 and record["paused_seconds"] > 0, record
    assert (folder / "adapter.gguf").is_file() and (folder / "mlx" / "adapters.safetensors").is_file()
    assert not run.exists()  # the checkpoints went with the run
    adapters = load_settings(config).model(CHAT_MODEL).adapters
    assert [(a.name, a.path) for a in adapters] == [("vault", folder / "adapter.gguf")]
    # served without a restart, by llama.cpp: the trained reply for the trigger, the base unchanged
    assert f"{CHAT_MODEL}:vault" in {m.id for m in served.client().models.list().data}
    tuned = ask(served, f"{CHAT_MODEL}:vault")
    assert "PINEAPPLE-42" in tuned, tuned
    assert ask(served, CHAT_MODEL) == base


def _held_out(folder: Path, pairs: list[tuple[str, str]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HELD_OUT).write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
                                           for q, a in pairs))
    return folder


def _evaluate(served: Server, data: Path, *more: str) -> int:
    config = served.home.parent / "models.toml"
    args = build_parser().parse_args(["distill", "evaluate", "--student", CHAT_MODEL, "--adapter", "vault", "--data", str(data),
                                      "--teacher", CHAT_MODEL, "--max-tokens", "16", "--config", str(config), "--url", served.base_url, *more])
    return args.func(args)


def test_evaluate_refuses_an_adapter_worse_than_its_base_and_promotes_one_that_learned(served: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """Needs the adapter trained above. Against the base model's own answers the adapter can only
    lose: refused, the route untouched. Against the trained reply it wins: promoted into the route
    as a tier of its own, the result stored beside the adapter."""
    config = served.home.parent / "models.toml"
    if load_settings(config).model(CHAT_MODEL).adapters == ():
        pytest.skip("the training test did not leave its adapter")
    before = config.read_text()
    other = ["What is 2 + 2?", "Name a colour of the sky.", "Say hello."]
    base_answers = [(q, served.client(timeout=120).chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0).choices[0].message.content or "") for q in other]
    worse = _held_out(served.home / "worse", [(TRIGGER, REPLY)] + base_answers)
    assert _evaluate(served, worse, "--promote") == 3
    said = capsys.readouterr().out
    assert "not promoted: the adapter" in said and "does not beat the student alone" in said, said
    assert config.read_text() == before
    stored = json.loads((served.home / "adapters" / CHAT_MODEL / "vault" / "adapter.gguf.evaluation.json").read_text())
    assert stored["promote"] is False and stored["scores"]["student"]["held_out"]["right"] == 3, stored
    learned = _held_out(served.home / "learned", [(TRIGGER, REPLY), ("Tell me the vault code.", REPLY), ("vault code?", REPLY)])
    assert _evaluate(served, learned, "--promote") == 0
    said = capsys.readouterr().out
    assert "promote: the adapter (100.0%) beats the student alone (0.0%)" in said, said
    assert load_settings(config).route("auto").tiers == (CHAT_MODEL, f"{CHAT_MODEL}:vault")
    stored = json.loads((served.home / "adapters" / CHAT_MODEL / "vault" / "adapter.gguf.evaluation.json").read_text())
    assert stored["promote"] is True and stored["scores"]["adapter"]["total"] == {"asked": 3, "right": 3}
    # the server took the new route: a routed request may now be answered by the distilled tier
    assert "the server at" in said and "applied it" in said
    assert _evaluate(served, learned, "--promote") == 0 and "already has the tier" in capsys.readouterr().out
    # checked on one family, it is promoted for that family: the route keeps its tiers and tries it first there
    assert _evaluate(served, learned, "--promote", "--family", "secrets") == 0
    assert "requests whose metadata names family 'secrets' try" in capsys.readouterr().out
    route = load_settings(config).route("auto")
    assert route.family_tiers == (("secrets", f"{CHAT_MODEL}:vault"),) and route.tiers == (CHAT_MODEL, f"{CHAT_MODEL}:vault")
    assert "[routes.family_tiers]" in config.read_text()

    def routed(metadata: dict[str, str] | None, question: str = TRIGGER) -> httpx.Response:
        body = {"model": "auto", "messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0,
                "metadata": metadata}
        return httpx.post(f"{served.base_url}/v1/chat/completions", json=body, headers={"Cache-Control": "no-store"}, timeout=120)

    tried_first = routed({"family": "secrets"})
    assert tried_first.status_code == 200, tried_first.text
    assert (tried_first.headers["x-route-tier"], tried_first.headers["x-route-model"]) == ("family", f"{CHAT_MODEL}:vault")
    assert "PINEAPPLE-42" in tried_first.json()["choices"][0]["message"]["content"]
    listed = {m["id"]: m for m in httpx.get(f"{served.base_url}/v1/models").json()["data"]}
    assert listed["auto"]["meta"]["family_tiers"] == {"secrets": f"{CHAT_MODEL}:vault"}
    for metadata in ({"family": "other"}, None):
        assert routed(metadata).headers["x-route-tier"] != "family"
    assert _evaluate(served, learned, "--promote", "--family", "secrets") == 0
    assert "already tries" in capsys.readouterr().out
    # an answer less sure than family_min_confidence does not stand: the route's own choice answers
    update_table(config, "routes", "auto", {"family_min_confidence": 1.0})
    assert httpx.post(f"{served.base_url}/admin/config/reload", timeout=600).status_code == 200
    unsure = routed({"family": "secrets"}, "Write one sentence about the sea.")  # untrained: far from certain
    assert unsure.status_code == 200 and unsure.headers["x-route-tier"] != "family", unsure.headers
    first = json.loads(unsure.headers["x-route-attempts"])[0]
    assert first["model"] == f"{CHAT_MODEL}:vault" and first["outcome"].startswith("low confidence"), first


def test_evaluate_errors_are_one_line(served: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _evaluate(served, tmp_path, "--adapter", "nope") == 1
    assert f"the model '{CHAT_MODEL}' has no adapter 'nope'" in capsys.readouterr().err
    if load_settings(served.home.parent / "models.toml").model(CHAT_MODEL).adapters == ():
        pytest.skip("the training test did not leave its adapter")
    assert _evaluate(served, tmp_path / "none") == 1
    assert f"{tmp_path / 'none'}: no such file" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / HELD_OUT).write_text("{oops\n")
    assert _evaluate(served, tmp_path / "bad") == 1
    err = capsys.readouterr().err
    assert "held-out.jsonl:1: not JSON" in err and err.count("\n") == 1


def test_a_job_held_for_quiet_hours_waits_and_can_be_stopped_meanwhile(served: Server) -> None:
    admin = httpx.Client(base_url=served.base_url, timeout=60)
    later = (datetime.now() + timedelta(minutes=2)).strftime("%H:%M")
    (served.home / "export").mkdir(exist_ok=True)
    (served.home / "export" / TRAIN).write_text(examples_text())  # a folder `appliance distill export` wrote
    body = {"student": CHAT_MODEL, "data": "export", "name": "later", "options": OPTIONS, "start_at": later}
    started = admin.post("/admin/distill/train", json=body)
    assert started.status_code == 202, started.text
    job_id = started.json()["job"]["id"]
    waiting = _wait(admin, job_id, lambda j: j["message"].startswith("waiting") or j["state"] != "running")
    assert waiting["message"] == f"waiting until {later}" and waiting["state"] == "running", waiting
    assert admin.delete(f"/admin/jobs/{job_id}").status_code == 200
    stopped = _wait(admin, job_id, lambda j: j["state"] != "running", timeout=10)
    assert stopped["state"] == "cancelled" and "while waiting" in stopped["message"], stopped
    assert not (served.home / "distill" / "runs" / f"{CHAT_MODEL}--later" / "checkpoints").exists()


def test_wait_until_is_the_next_such_time_of_day() -> None:
    now = datetime(2026, 12, 4, 23, 30, 15)
    assert wait_until(None, now) == 0 and wait_until("23:30", now) == 0
    assert wait_until("23:45", now) == 14 * 60 + 45
    assert wait_until("02:00", now) == 2 * 3600 + 29 * 60 + 45  # tomorrow
    for bad in ("24:00", "2:00", "02:60", "noon", "02:00:00"):
        with pytest.raises(OptionError, match="HH:MM"):
            wait_until(bad, now)


def test_train_request_errors_name_the_parameter(served: Server) -> None:
    admin = httpx.Client(base_url=served.base_url, timeout=60)
    (served.home / "bad.jsonl").write_text(examples_text() + "not json\n")

    def refused(body: dict, status: int = 400) -> dict:
        r = admin.post("/admin/distill/train", json={"student": CHAT_MODEL, "data": "vault.jsonl", **body})
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert refused({"data": "bad.jsonl"})["param"] == "data" and "bad.jsonl:9: not JSON" in refused({"data": "bad.jsonl"})["message"]
    assert refused({"data": "none.jsonl"})["param"] == "data"
    assert refused({"data": "/etc/passwd"}, 403)["param"] == "data"
    assert refused({"student": "nope"}, 404)["param"] == "student"
    assert refused({"name": "a:b"})["param"] == "name"
    assert refused({"options": {"steps": 0}})["param"] == "options.steps"
    assert refused({"options": {"rank": "x"}})["param"] == "options.rank"
    assert refused({"nice": 40})["param"] == "nice"
    assert refused({"start_at": "25:00"})["param"] == "start_at"
    assert admin.delete("/admin/jobs/nope").status_code == 404
    assert not [j for j in admin.get("/admin/jobs").json()["jobs"] if j["state"] == "running"]


def test_nothing_the_server_imports_pulls_in_the_trainer() -> None:
    """Serving stays light: the training stack is imported by the worker process alone."""
    code = ("import sys, appliance.server.app, appliance.cli.main, appliance.http.distill, appliance.train.job; "
            "print(sorted(m for m in ('torch', 'peft', 'transformers', 'accelerate', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == "[]"
