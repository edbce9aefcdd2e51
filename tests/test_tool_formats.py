"""Mistral's tool-call forms through the real server: the bundled SmolLM2 under Mistral-style chat
templates (the v3 JSON-list form and the v11 `name[ARGS]` form), a forced call written under the
form's grammar, read back as OpenAI tool calls whole and streamed, and the call's result taken
back through the template. Their parsing at every stream cut is in tests/test_tool_calls.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.conftest import MODEL_FILE, Server, config_text, start_server, stop_server

_TURNS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- elif message.role == 'assistant' %}{% if message.tool_calls %}CALLS{% else %}{{ message.content }}{% endif %}</s>"
    "{%- endif %}{%- endfor %}"
)
V3 = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
      + _TURNS.replace("CALLS", "[TOOL_CALLS][{% for c in message.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
                                "\"arguments\": {{ c.function.arguments }}}{% if not loop.last %}, {% endif %}{% endfor %}]"))
V11 = ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
       + _TURNS.replace("CALLS", "{% for c in message.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments }}{% endfor %}"))
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    text = config_text(slots=2, embeddings=False)
    for alias, template in (("mistral-v3", V3), ("mistral-v11", V11)):
        text += f"""
[[models]]
alias = "{alias}"
package_file = "{MODEL_FILE}"
context_length = 2048
slots = 1
threads = 2
chat_template = '''{template}'''
"""
    server = start_server(tmp_path_factory.mktemp("mistral"), text)
    yield server
    stop_server(server)


@pytest.mark.parametrize("model", ["mistral-v3", "mistral-v11"])
def test_a_forced_call_in_mistrals_form_comes_back_as_a_tool_call_and_its_result_goes_back(mistral: Server, model: str) -> None:
    client = mistral.client()
    answer = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
                                            max_tokens=60, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)  # type: ignore[union-attr]
    assert "[TOOL_CALLS]" not in (choice.message.content or "")
    # The template itself rendered the tools (a template taken for one that ignores tools would get
    # them in a system message, which this template drops).
    bare = client.chat.completions.create(model=model, messages=ASK, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    assert answer.usage is not None and bare.usage is not None and answer.usage.prompt_tokens > bare.usage.prompt_tokens + 30
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type,list-item]
                                                 max_tokens=60, temperature=0, stream=True))
    streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed and streamed[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments  # type: ignore[union-attr]
    followed = client.chat.completions.create(model=model, max_tokens=8, temperature=0, tools=[WEATHER],  # type: ignore[list-item]
                                              messages=[*ASK, choice.message.model_dump(exclude_none=True),  # type: ignore[list-item]
                                                        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}])
    assert followed.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert followed.usage is not None and followed.usage.prompt_tokens > answer.usage.prompt_tokens + 10  # the call and its result, rendered
