"""The greedy fast path (numpy's argmax over the logits) picks what llama.cpp's greedy chain picks,
row by row, on the bundled model's real logits."""

from __future__ import annotations

import llama_cpp as L

from engines.llamacpp.runtime import Context, ContextParams, Model, Sampler
from appliance.fleet.files import package_file
from tests.conftest import MODEL_FILE


def test_argmax_matches_the_chain_on_every_row() -> None:
    model = Model(package_file(MODEL_FILE))
    ctx = Context(model, ContextParams(n_seq=1, n_ctx_per_seq=256, n_batch=256, threads=2, kv_unified=False, flash_attn=True))
    sampler = Sampler(model, temperature=0.0, top_p=1.0, seed=None, grammar=None)
    try:
        assert sampler.greedy
        tokens = model.tokenize("The three primary colours are red, yellow and blue. In Portuguese: vermelho, amarelo e", add_special=True, parse_special=False)
        ctx.decode([(t, i, 0, True) for i, t in enumerate(tokens)])
        for row in range(len(tokens)):
            assert sampler.sample(ctx, row) == L.llama_sampler_sample(sampler.ptr, ctx.ptr, row)
        assert not Sampler(model, temperature=0.7, top_p=1.0, seed=1, grammar=None).greedy
    finally:
        sampler.close()
        ctx.close()
        model.close()
