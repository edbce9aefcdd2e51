"""engines/sampling.py draw: llama.cpp's top-p, temperature and dist chain's distribution, computed
in numpy. The nucleus against a full sort; draws from the bundled model's real logits against the
exact distribution, and llama.cpp's own chain against the same, so both are the one distribution."""

from __future__ import annotations

import llama_cpp as L
import numpy as np
import pytest

from appliance.fleet.files import package_file
from engines.llamacpp.runtime import Context, ContextParams, Model, Sampler
from engines.sampling import _inverse_cdf, draw, nucleus
from tests.conftest import MODEL_FILE


def _reference_nucleus(x: np.ndarray, top_p: float) -> np.ndarray:
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    return order[: int(np.searchsorted(np.cumsum(p[order]), np.float32(top_p))) + 1]


@pytest.mark.parametrize("scale", [0.01, 0.3, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_the_nucleus_is_the_one_a_full_sort_finds(scale: float, top_p: float) -> None:
    rng = np.random.default_rng(int(scale * 100) + int(top_p * 1000))
    for n in (7, 1000, 49152):
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        assert list(nucleus(x, top_p)) == list(_reference_nucleus(x, top_p))


def test_the_inverse_cdf_finds_each_weights_share() -> None:
    w = np.arange(1, 1301, dtype=np.float32)  # three blocks and a tail
    cum = np.cumsum(w.astype(np.float64))
    for u in (0.0, 1e-9, 0.25, 0.5, 0.999999, 1.0 - 1e-12):
        assert _inverse_cdf(w, u) == min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(w) - 1)


@pytest.fixture(scope="module")
def real_logits():  # type: ignore[no-untyped-def]
    model = Model(package_file(MODEL_FILE))
    ctx = Context(model, ContextParams(n_seq=1, n_ctx_per_seq=256, n_batch=256, threads=2, kv_unified=False, flash_attn=True))
    tokens = model.tokenize("<|im_start|>user\nWrite a story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\nOnce upon a time,",
                            add_special=False, parse_special=True)
    ctx.decode([(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
    yield model, ctx, ctx.logits(len(tokens) - 1).copy(), len(tokens) - 1
    ctx.close()
    model.close()


def _tv(counts: np.ndarray, exact: np.ndarray) -> float:
    return float(np.abs(counts / counts.sum() - exact).sum() / 2)


def test_draws_follow_the_chains_distribution(real_logits) -> None:  # type: ignore[no-untyped-def]
    model, ctx, logits, row = real_logits
    temperature, top_p = 0.8, 0.98
    keep = nucleus(logits, top_p)
    assert 2 < len(keep) < 2000  # a real spread of tokens, not a near-greedy row
    z = logits[keep] / np.float32(temperature)
    exact = np.zeros(len(logits))
    exact[keep] = np.exp(z - z.max()) / np.exp(z - z.max()).sum()

    rng = np.random.default_rng(5)
    ours = np.bincount([draw(logits, temperature=temperature, top_p=top_p, rng=rng) for _ in range(20000)], minlength=len(logits))
    assert set(np.flatnonzero(ours)) <= set(keep.tolist())
    assert _tv(ours, exact) < 0.03

    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(top_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(11))
    try:
        theirs = np.bincount([L.llama_sampler_sample(chain, ctx.ptr, row) for _ in range(6000)], minlength=len(logits))
    finally:
        L.llama_sampler_free(chain)
    assert set(np.flatnonzero(theirs)) <= set(keep.tolist())
    assert _tv(theirs, exact) < 0.05  # llama.cpp's chain draws the same distribution


def test_a_seed_gives_the_same_draws_and_top_k_keeps_the_chain(real_logits) -> None:  # type: ignore[no-untyped-def]
    model, ctx, _logits, row = real_logits

    def draws(seed: int, **kw: float) -> list[int]:
        s = Sampler(model, seed=seed, grammar=None, **{"temperature": 1.0, "top_p": 0.95, **kw})  # type: ignore[arg-type]
        try:
            return [s.sample(ctx, row) for _ in range(40)]
        finally:
            s.close()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(7, top_k=40) == draws(7, top_k=40)  # llama.cpp's chain, seeded as before
