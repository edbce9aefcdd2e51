"""Training examples: chat-format JSONL (one `{"messages": [{"role", "content"}, ...]}` per line,
as `appliance distill export` writes them), read and checked with the line of every fault, then
turned into the tokens the model is served and the tokens it should answer.

The last message of an example is the answer taught; the messages before it are its prompt, built
exactly as serving builds it (appliance/prompt/chat.py: the model's template and vocabulary). The
answer is its text as plain text followed by the control token the template closes a turn with,
so the model learns to stop where serving stops it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from appliance.distill.export import TRAIN
from appliance.prompt.chat import pieces, render_marked, vocabulary_prompt
from appliance.prompt.template import ChatTemplate, TemplateError
from engines.vocabulary import Vocabulary

MIN_EXAMPLES = 8
IGNORED = -100  # a label that is not trained on (PyTorch's cross-entropy ignore_index)


class DataError(ValueError):
    """One line: the file (and line) and what is wrong."""


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    role: Literal["system", "user", "assistant"]
    content: str


class _Line(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    messages: list[Message]


@dataclass(frozen=True)
class Example:
    line: int
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Encoded:
    line: int
    tokens: tuple[int, ...]
    labels: tuple[int, ...]  # IGNORED for the prompt, the token itself for the answer


def parse_examples(lines: Iterable[str], source: str) -> list[Example]:
    """Every non-blank line as an example; a fault raises DataError naming `source:line`."""
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = tuple(msgspec.json.decode(line, type=_Line).messages)
        except msgspec.ValidationError as exc:
            raise DataError(f"{source}:{number}: {exc}; each line is {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}") from None
        except msgspec.DecodeError as exc:
            raise DataError(f"{source}:{number}: not JSON ({exc})") from None
        if len(messages) < 2 or messages[-1].role != "assistant":
            raise DataError(f"{source}:{number}: an example is a prompt (a user message, perhaps after a system one) "
                            "and the assistant's answer, last")
        if not any(m.role == "user" for m in messages[:-1]):
            raise DataError(f"{source}:{number}: no user message before the answer")
        if not messages[-1].content.strip():
            raise DataError(f"{source}:{number}: the assistant's answer is empty")
        out.append(Example(number, messages))
    return out


def read_examples(path: Path, minimum: int = MIN_EXAMPLES) -> list[Example]:
    """`path` is a JSONL file, or the folder `appliance distill export` wrote (its train.jsonl; never its held-out part)."""
    if path.is_dir():
        path = path / TRAIN
    try:
        with path.open(encoding="utf-8") as handle:
            examples = parse_examples(handle, str(path))
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc.strerror}") from None
    check_count(len(examples), minimum, str(path))
    return examples


def check_count(count: int, minimum: int, source: str) -> None:
    if count < minimum:
        raise DataError(f"{source}: {count} example{'s' if count != 1 else ''}; training needs at least {minimum} "
                        "(export more verified answers with `appliance distill export`)")


def closing_token(template: ChatTemplate, vocabulary: Vocabulary, messages: Sequence[Message]) -> int:
    """The control token the template writes right after an assistant message's text: where the
    served model must stop."""
    marked = render_marked(template, [msgspec.structs.asdict(m) for m in messages])
    if marked is None:
        raise TemplateError("the chat template changes message text, so where an answer ends cannot be found")
    text, spans = marked
    after = pieces(text[spans[-1][1]:], [], list(vocabulary.control_tokens()))
    if not after or not after[0].control:
        raise TemplateError("the chat template does not close an assistant turn with a control token")
    return vocabulary.control_tokens()[after[0].text]


def encode(example: Example, template: ChatTemplate, vocabulary: Vocabulary) -> Encoded:
    """The prompt (as serving builds it) and the answer, labelled to train on the answer alone."""
    prompt_messages = [msgspec.structs.asdict(m) for m in example.messages[:-1]]
    _, prompt = vocabulary_prompt(template, vocabulary, prompt_messages)
    answer = vocabulary.tokenize(example.messages[-1].content, add_special=False, parse_special=False)
    answer.append(closing_token(template, vocabulary, example.messages))
    return Encoded(example.line, tuple(prompt + answer), (IGNORED,) * len(prompt) + tuple(answer))


def encode_all(examples: Sequence[Example], template: ChatTemplate, vocabulary: Vocabulary, max_tokens: int,
               source: str) -> tuple[list[Encoded], list[int]]:
    """The encoded examples that fit in `max_tokens`, and the lines of those that do not."""
    kept, too_long = [], []
    for example in examples:
        try:
            encoded = encode(example, template, vocabulary)
        except TemplateError as exc:
            raise DataError(f"{source}:{example.line}: {exc}") from None
        (kept if len(encoded.tokens) <= max_tokens else too_long).append(encoded)
    return kept, [e.line for e in too_long]


def write_encoded(encoded: Sequence[Encoded], path: Path) -> None:
    """The worker's input: token ids only, one example a line."""
    with path.open("w") as handle:
        for e in encoded:
            handle.write(json.dumps({"line": e.line, "tokens": e.tokens, "labels": e.labels}) + "\n")
