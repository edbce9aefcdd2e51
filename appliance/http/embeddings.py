"""POST /v1/embeddings: OpenAI's wire over the embedding pipeline (appliance/pipeline/embed.py)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post

from appliance.http.prologue import Endpoint, begin, reply
from appliance.pipeline.context import Answer, CallContext
from appliance.pipeline.embed import embed
from appliance.server.services import Services
from appliance.wire import openai as render
from appliance.wire.schemas import EmbeddingRequest

EMBEDDINGS = Endpoint("embeddings", "emb-", EmbeddingRequest, "embeddings")


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request[Any, Any, Any], services: Services) -> Response[Any]:
    ctx, body = await begin(request, services, EMBEDDINGS)
    return await reply(ctx, _embeddings(ctx, body))


async def _embeddings(ctx: CallContext, body: EmbeddingRequest) -> Answer:
    done = await embed(ctx, body.model, body.input, body.dimensions)
    return Answer(render.embedding_list(done.vectors, done.model, done.prompt_tokens, body.encoding_format), {})


ROUTES = [embeddings]
