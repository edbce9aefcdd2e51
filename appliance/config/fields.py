"""What more than one table of models.toml declares: the value types, the naming rule, the upper
bounds, and how a table or an array of tables is read from the parsed file."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta

from appliance.config.schema import Where

# "auto": MLX on Apple silicon, llama.cpp elsewhere; "onnx": an embedding model run by onnxruntime
Engine = Literal["llamacpp", "mlx", "auto", "onnx"]
Pooling = Literal["auto", "mean", "cls", "last"]  # auto: what the model file declares (engines/embedding.py)
Kind = Literal["chat", "embedding", "draft"]  # a draft model is loaded only inside the models it drafts for
Tier = Literal["small", "mid", "frontier"]
KvType = Literal["f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]
SpeculationMode = Literal["auto", "off", "prompt_lookup", "draft"]
PrefixSharing = Literal["tenant", "all"]
ENGINES = (*get_args(Engine), "openai")  # openai: a model served by another server (engines/upstream)
UNQUANTIZED_KV = ("f16", "bf16")

# A model's alias, a route's alias and an adapter's name: what clients send as `model` ("alias" or
# "alias:adapter", so no ':'), and what the admin API writes into this file, so nothing TOML could read.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NAME = re.compile(NAME_PATTERN)
NAME_RULE = "letters, digits, '.', '_' or '-' (no ':'), starting with a letter or digit, up to 64 characters"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Shared by more than one table: declared once here.
Alias = Annotated[str, Meta(pattern=NAME_PATTERN, description="the name clients send as `model`", extra={"rule": NAME_RULE})]
Url = Annotated[str, Meta(pattern=r"^https?://", extra={"rule": "an http:// or https:// URL"})]
BaseUrl = Annotated[Url, Meta(description="the server's OpenAI API root, for example \"http://gpu1:8000/v1\"")]
ApiKeyEnv = Annotated[str, Meta(pattern=ENV_NAME.pattern, description="the environment variable holding the server's key",
                                extra={"rule": "the name of an environment variable (the key itself never goes in the file)"})]
# Upper bounds: what llama.cpp and the machine can take. llama.cpp holds n_ctx, n_batch and positions
# in 32-bit integers, so slots x context_length (at most 2**28) stays far inside them; a decode step
# of more than MAX_BATCH_TOKENS gains no speed, and its buffers grow with it.
MAX_CONTEXT = 1 << 20  # tokens per slot of a local model
MAX_UPSTREAM_CONTEXT = 1 << 24  # an upstream's context: only an estimate's bound here
MAX_BATCH_TOKENS = 1 << 16
DAY_S = 86400.0
# A cost in nano-dollars stays an int64 with this price and 2**31 tokens.
Price = Annotated[float, Meta(ge=0.0, le=1e6)]


class Table(msgspec.Struct, frozen=True, kw_only=True):
    """A table of models.toml."""


def table_at(raw: dict[str, Any], name: str, where: Where) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        raise where.fail(name, f"expected a table, got {type(value).__name__}")
    return value


def array_at(raw: dict[str, Any], name: str, where: Where) -> list[dict[str, Any]]:
    value = raw.get(name, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise where.fail(name, f"expected an array of tables: [[{name}]]")
    return value
