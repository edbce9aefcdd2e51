"""Renders a model's chat template (Jinja, as Hugging Face writes them) into prompt text.

A template comes from a model file a user may have downloaded, or from an admin: it renders in a
sandbox with a bound on its time and on what it makes (appliance/prompt/sandbox.py), and it is
tried on sample conversations when it is loaded, so one that goes past the bound is refused then.
Serving renders it off the event loop (`render_threads`), on threads the registry shuts down."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta

from appliance.prompt.sandbox import (
    RENDER_BASE_CHARS,
    RENDER_INPUT_FACTOR,
    RENDER_SECONDS,
    BoundedEnvironment,
    Budget,
    TemplateBoundError,
    TemplateError,
    bounded_filter,
    within,
)
from appliance.prompt.reasoning import EFFORT, SWITCH, reasoning_format
from appliance.prompt.tool_calls import strings

if TYPE_CHECKING:
    from engines.vocabulary import Vocabulary

__all__ = ["CHATML", "ChatTemplate", "TemplateBoundError", "TemplateError", "close_render_threads", "render_threads", "template_of"]

# Used when a model ships no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Renders run here, off the event loop; a few at once, so a template at its time bound holds only these.
# Made on first use and closed with the registry that serves the templates (a later app makes new ones).
_render_pool: ThreadPoolExecutor | None = None
_render_lock = threading.Lock()


def render_threads() -> ThreadPoolExecutor:
    """The threads templates render on."""
    global _render_pool
    with _render_lock:
        if _render_pool is None:
            _render_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="chat-template")
        return _render_pool


def close_render_threads() -> None:
    """Waits for the renders under way (each ends within its time bound) and ends the threads."""
    global _render_pool
    with _render_lock:
        pool, _render_pool = _render_pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)

MAX_TOJSON_INDENT = 16

# What a template is tried on when it is loaded: a lone turn, a conversation, and one with a tool.
_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up.",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}
SAMPLES: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    ([{"role": "user", "content": "Hello."}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
      {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Name a colour."}], None),
    ([{"role": "user", "content": "What does 'apple' mean?"}], [_TOOL]),
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # As Hugging Face renders templates (Jinja's own filter escapes '<' and sorts keys): tools and
    # tool-call arguments then read as the model saw them in training.
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= MAX_TOJSON_INDENT):
        raise TemplateBoundError(f"tojson's indent must be a number of spaces up to {MAX_TOJSON_INDENT}")
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def render_budget(*values: Any) -> Budget:
    """One render's bound: its time, and text in proportion to what it is given to render."""
    given = sum(len(s) for s in strings(list(values)))
    return Budget(time.monotonic() + RENDER_SECONDS, RENDER_BASE_CHARS + RENDER_INPUT_FACTOR * given)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = bounded_filter("tojson", _tojson)
        self.source = source  # shown as it was given (Ollama's /api/show)
        try:
            self._template = env.from_string(source)
            # Whether the template renders a `tools` list itself (else tools go in a system message).
            self.uses_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        except RecursionError:
            raise TemplateError("the chat template does not compile: it nests too deep") from None
        self._special = special_tokens
        self._variables: dict[str, Any] = {}  # set for every render: a request's `enable_thinking = false` or effort
        self.source = source
        self.reasoning = reasoning_format(source)
        self._try_samples()

    def with_effort(self, effort: str | None) -> ChatTemplate:
        """This template as a request's reasoning effort asks: "none" renders with reasoning off (the
        template's own switch; TemplateError where the model reasons and the template cannot stop it);
        another effort goes to a template that reads one (gpt-oss's); else the template as it is."""
        if effort is None or self.reasoning is None:
            return self
        if effort == "none":
            if not self.reasoning.switchable:
                raise TemplateError(f"this model reasons, and its chat template has no {SWITCH} switch to turn that off")
            variables: dict[str, Any] = {SWITCH: False}
        elif self.reasoning.effort:
            variables = {EFFORT: effort}
        else:
            return self
        variant = copy.copy(self)
        variant._variables = variables
        return variant

    def _try_samples(self) -> None:
        """A template past its bounds on a small conversation is refused now, not at each request.
        Other failures stay the request's to report (a template may refuse a system turn)."""
        for messages, tools in SAMPLES:
            try:
                self.render(messages, tools=tools)
            except TemplateBoundError as exc:
                raise TemplateBoundError(f"{exc}, rendering a {len(messages)}-message sample conversation; refused") from None
            except TemplateError:
                pass

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        extra = {"tools": list(tools)} if tools else {}
        budget = render_budget(messages, tools or [])
        try:
            return within(budget, self._template.generate(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                          **self._special, **self._variables, **extra))
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from None
        except RecursionError:
            raise TemplateBoundError("the chat template recursed past Python's depth bound") from None
        except MemoryError:
            raise TemplateBoundError("the chat template ran out of memory") from None
        except Exception as exc:  # a template's own error (adding text to a number, dividing by zero): the template failed
            raise TemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def template_of(configured: str | None, vocabulary: Vocabulary) -> ChatTemplate:
    """A model's template: the config's, else the one its file ships, else ChatML. Serving and
    training read it here, so an adapter learns from the prompts it will be served."""
    return ChatTemplate(configured or vocabulary.chat_template() or CHATML, vocabulary.special_tokens())
