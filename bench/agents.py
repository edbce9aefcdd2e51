"""Do the coding agents work against the appliance? Claude Code (headless, `claude -p`, with
ANTHROPIC_BASE_URL at the box: the Messages API) or Codex (`codex exec` with the box as its
Responses provider) on an appliance serving Qwen2.5-Coder-1.5B is asked to read a file and say what
it holds: the answer must name the secret word in it, reached through a tool call and its result.
Prints each request's prompt and completion tokens, time to first token and total, and whether the
word came back; the server's request log says what the appliance served.

    ../shared/tools/fetch-bench-models.sh ~/.cache/appliance/models qwen-1.5b   # once
    npm install --prefix ~/.cache/appliance/agents @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0   # once
    .venv/bin/python -m bench.agents                 # Claude Code, the Read tool alone
    .venv/bin/python -m bench.agents --all-tools     # Claude Code, its whole default tool set
    .venv/bin/python -m bench.agents --agent codex   # Codex

Slow on two cores (Claude Code's prompt is about 18,800 tokens): a bench, not a test. The run
and its figures are in docs/clients.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import apsw

from bench.kit import server as launcher
from bench.kit.machine import log
from bench.kit.paths import RUNS

MODELS = Path("~/.cache/appliance/models").expanduser()
AGENTS = Path("~/.cache/appliance/agents").expanduser()
SECRET = "PERIWINKLE"
PROMPTS = {"claude": "Use the Read tool to open notes.txt, then tell me the secret word written in it.",
           "codex": "Use a shell command to print notes.txt, then tell me the secret word written in it."}

CONFIG = """[auth]
mode = "open"
[auth.open_principal]
admin = true
[budgets]
enabled = false
[cache]
enabled = false

[[models]]
alias = "coder"
path = "{model}"
context_length = 32768
slots = 1
threads = {threads}
"""


def requests_served(home: Path) -> list[dict[str, object]]:
    db = apsw.Connection(str(home / "appliance.db"), flags=apsw.SQLITE_OPEN_READONLY)
    rows = db.execute("SELECT id, status, finish_reason, prompt_tokens, completion_tokens, ttft_ms, total_ms FROM request_log "
                      "ORDER BY created_at").fetchall()
    keys = ("id", "status", "finish_reason", "prompt_tokens", "completion_tokens", "ttft_ms", "total_ms")
    return [dict(zip(keys, row)) for row in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    ap.add_argument("--agent", choices=("claude", "codex"), default="claude")
    ap.add_argument("--bin", type=Path, default=None, help="the agent's executable (default: under ~/.cache/appliance/agents)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-output-tokens", type=int, default=2048,
                    help="CLAUDE_CODE_MAX_OUTPUT_TOKENS: Claude Code asks 32,000 otherwise, past a 32,768 context once the prompt is in")
    ap.add_argument("--all-tools", action="store_true", help="offer Claude Code's whole default tool set, not only Read")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=None, help="default: bench/runs/agents/claude-code[-all-tools].json")
    args = ap.parse_args()
    args.out = args.out or RUNS / "agents" / (f"claude-code{'-all-tools' if args.all_tools else ''}.json" if args.agent == "claude"
                                              else "codex.json")
    agent = args.bin or AGENTS / "node_modules/.bin" / args.agent
    for path in (args.model, agent):
        if not path.exists():
            raise SystemExit(f"{path} is missing: see this script's docstring for the two commands that put it there")
    work = Path(tempfile.mkdtemp(prefix="agents-"))
    launcher.write_config(work, CONFIG.format(model=args.model, threads=args.threads))
    server = launcher.start(work, timeout=300)
    project, home = work / "project", work / "user-home"
    project.mkdir()
    home.mkdir()
    (project / "notes.txt").write_text(f"The secret word is {SECRET}.\n")
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": server.base, "ANTHROPIC_AUTH_TOKEN": "local",
           "ANTHROPIC_MODEL": "coder", "ANTHROPIC_SMALL_FAST_MODEL": "coder",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(args.max_output_tokens), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1"}
    prompt = PROMPTS[args.agent]
    if args.agent == "claude":
        # Only the Read tool is offered (`--tools`): the whole default set is 24 tools, which a 1.5B model
        # mixes up (it called the Agent tool with its own model name) and which makes the prompt 18,800 tokens.
        tools = ["--tools", "Read", "--allowedTools", "Read"] if not args.all_tools else ["--allowedTools", "Read"]
        command = [str(agent), "-p", prompt, *tools, "--output-format", "json"]
    else:
        # The box as a Responses provider; Codex's hosted web search is off (the box has none to offer).
        provider = f'model_providers.appliance={{name="appliance",base_url="{server.base}/v1",wire_api="responses"}}'
        command = [str(agent), "exec", "--skip-git-repo-check", "-c", "model_provider=appliance", "-c", provider,
                   "-c", "web_search=disabled", "-m", "coder", prompt]
    log(f"running: {' '.join(command)} (in {project})")
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - started
        served = requests_served(work / "home")
    finally:
        server.stop()
    if args.agent == "claude":
        try:
            result = json.loads(done.stdout)
        except ValueError:
            result = {"unparsed": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
    else:
        result = {"result": done.stdout.strip(), "num_turns": len(served)}  # `codex exec` prints its last message
    answer = str(result.get("result", ""))
    report = {"command": " ".join(command), "agent": subprocess.run([str(agent), "--version"], capture_output=True, env=env,
                                                                    text=True).stdout.strip(),
              "model": args.model.name, "threads": args.threads, "wall_s": round(wall, 1), "exit": done.returncode,
              "turns": result.get("num_turns"), "answer": answer, "secret_found": SECRET.lower() in answer.lower(),
              "is_error": result.get("is_error"), "requests": served,
              "output_tail": done.stdout[-3000:], "stderr_tail": done.stderr[-3000:]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for row in served:
        log(f"  {row['id']}: {row['status']} {row['finish_reason']}, prompt {row['prompt_tokens']}, completion {row['completion_tokens']}, "
            f"first token {row['ttft_ms'] and round(float(row['ttft_ms']) / 1000, 1)} s, total {round(float(row['total_ms']) / 1000, 1)} s")  # type: ignore[arg-type]
    log(f"{args.agent}: exit {done.returncode}, {result.get('num_turns')} turns, {wall:.0f} s; the secret word "
        f"{'came back' if report['secret_found'] else 'did NOT come back'}: {answer[:200]!r}")
    log(f"written: {args.out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
