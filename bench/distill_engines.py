"""The same distilled adapter on both engines: llama.cpp reads its GGUF, MLX its mlx-lm folder,
over the same base (the GGUF for llama.cpp; MLX converts the same file at load). Every held-out
prompt of bench/distill.py's exports and the workload's evaluation records of those families are
asked of both, greedy, through one server; prints the share of prompts whose answers are the same
text, and the share with the same verdict under the workload's checker.

    .venv/bin/python -m bench.distill_engines --workdir ~/.cache/appliance/distill-bench

Run after bench/distill.py has trained the adapter (its --workdir). MLX runs as its CPU build on
Linux (`mlx[cpu]`), on Metal on Apple silicon.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
import tomlkit

from policy.distill import agrees  # noqa: E402
from bench.distill import EVALUATION, FAMILIES, load_check
from bench.kit.server import start, write_config


def both_engines(workdir: Path, student: str, adapter: str) -> str:
    """The bench's config with the student twice: as it is (llama.cpp), and on MLX with the adapter's MLX folder."""
    doc = tomlkit.parse((workdir / "models.toml").read_text())
    model = next(m for m in doc["models"] if m["alias"] == student)
    gguf = next(a for a in model["adapters"] if a["name"] == adapter)["path"]
    mlx = tomlkit.table()
    for key in ("package_file", "path", "context_length", "price_input_per_mtok", "price_output_per_mtok"):
        if key in model:
            mlx[key] = model[key]
    mlx["alias"] = f"{student}-mlx"
    mlx["engine"] = "mlx"
    mlx["slots"] = 1
    folder = tomlkit.table()
    folder["name"] = adapter
    folder["path"] = str(Path(str(gguf)).parent / "mlx")
    mlx["adapters"] = tomlkit.aot()
    mlx["adapters"].append(folder)
    doc["models"].append(mlx)
    doc.pop("routes", None)
    doc.pop("distill", None)
    return tomlkit.dumps(doc)


def prompts(workdir: Path) -> list[dict[str, Any]]:
    out = []
    for family in FAMILIES:
        for line in (workdir / f"data-{family}" / "held-out.jsonl").read_text().splitlines():
            messages = json.loads(line)["messages"]
            out.append({"family": family, "messages": messages[:-1], "reference": messages[-1]["content"]})
    for line in EVALUATION.read_text().splitlines():
        record = json.loads(line)
        if record["family"] in FAMILIES:
            out.append({"family": record["family"], "messages": record["messages"], "record": record})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="bench/distill.py's work folder, after its train step")
    parser.add_argument("--student", default="smollm2-135m")
    parser.add_argument("--adapter", default="distilled")
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    source = args.workdir.expanduser().resolve()
    work = source / "engines"
    write_config(work, both_engines(source, args.student, args.adapter))
    check = load_check()
    asked = prompts(source)
    same_text = same_verdict = 0
    server = start(work)
    try:
        with httpx.Client(base_url=server.base, timeout=900) as client:
            for n, p in enumerate(asked, 1):
                answers = []
                for model in (f"{args.student}:{args.adapter}", f"{args.student}-mlx:{args.adapter}"):
                    body: dict[str, Any] = {"model": model, "messages": p["messages"], "max_tokens": args.max_tokens, "temperature": 0}
                    if "record" in p and p["record"].get("response_format"):
                        body["response_format"] = p["record"]["response_format"]
                    r = client.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                    answers.append(r.json()["choices"][0]["message"]["content"] or "")
                verdicts = [bool(check(p["record"], a)) if "record" in p else agrees(p["reference"], a) for a in answers]
                same_text += answers[0] == answers[1]
                same_verdict += verdicts[0] == verdicts[1]
                if answers[0] != answers[1]:
                    print(f"differ ({p['family']}): llama.cpp {answers[0][:80]!r} / MLX {answers[1][:80]!r}")
                if n % 10 == 0:
                    print(f"{n}/{len(asked)}: same text {same_text}, same verdict {same_verdict}", flush=True)
    finally:
        server.stop()
    print(f"both engines, adapter {args.student}:{args.adapter}: the same text on {same_text}/{len(asked)} prompts "
          f"({same_text / len(asked):.1%}), the same verdict on {same_verdict}/{len(asked)} ({same_verdict / len(asked):.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
