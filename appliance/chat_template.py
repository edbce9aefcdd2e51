"""Renders a model's chat template (Jinja, as Hugging Face writes them) into prompt text."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import json

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from engines.vocabulary import Vocabulary

# Used when a model ships no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # As Hugging Face renders templates (Jinja's own filter escapes '<' and sorts keys): tools and
    # tool-call arguments then read as the model saw them in training.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        # A sandbox: a template comes from a model file, which a user may have downloaded.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
            # Whether the template renders a `tools` list itself (else tools go in a system message).
            self.uses_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        self._special = special_tokens
        self.source = source

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special, **extra)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from None


def template_of(configured: str | None, vocabulary: Vocabulary) -> ChatTemplate:
    """A model's template: the config's, else the one its file ships, else ChatML. Serving and
    training read it here, so an adapter learns from the prompts it will be served."""
    return ChatTemplate(configured or vocabulary.chat_template() or CHATML, vocabulary.special_tokens())
