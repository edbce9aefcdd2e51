"""Renders a model's chat template (Jinja, as Hugging Face writes them) into prompt text."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model ships no template of its own.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        # A sandbox: a template comes from a model file, which a user may have downloaded.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from None
        self._special = special_tokens
        self.source = source

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed: {exc}") from None
