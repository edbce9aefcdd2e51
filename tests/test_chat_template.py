"""Chat templates render in a sandbox, as Hugging Face's Jinja conventions expect."""

from __future__ import annotations

import pytest

from appliance.prompt.template import CHATML, ChatTemplate, TemplateError


def test_chatml_renders_with_generation_prompt():
    t = ChatTemplate(CHATML, {})
    text = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_becomes_template_error():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok", {})
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first must be user"):
        t.render([{"role": "assistant", "content": "x"}])


def test_sandbox_blocks_attribute_escapes():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(TemplateError):
        t.render([])


def test_broken_template_is_reported_at_load():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})


def test_special_tokens_are_available():
    t = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}", {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == "<s>x</s>"


def test_render_threads_end_when_closed():
    # The registry closes them at shutdown; a later app (tests make many in one process) gets new ones.
    import threading

    from appliance.prompt.template import close_render_threads, render_threads

    template = ChatTemplate(CHATML, {})
    assert "Hello." in render_threads().submit(template.render, [{"role": "user", "content": "Hello."}]).result()
    assert any(t.name.startswith("chat-template") for t in threading.enumerate())
    close_render_threads()
    assert not any(t.name.startswith("chat-template") for t in threading.enumerate())
    assert render_threads().submit(lambda: 1).result() == 1
    close_render_threads()
