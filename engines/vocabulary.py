"""A model's vocabulary: what templating, tokenizing and the API's checks need, and no weights.

One implementation per engine family (engines/llamacpp/vocabulary.py over a runtime Model,
engines/mlx/vocabulary.py over the transformers tokenizer, engines/onnx/vocabulary.py over a
`tokenizers` tokenizer). An engine answers the Engine protocol's vocabulary calls from its own
(`SpeaksVocabulary`), and a model loaded on demand (appliance/fleet/on_demand.py) from one loaded alone.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Vocabulary(Protocol):
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def vocab_size(self) -> int: ...

    def add_bos(self) -> bool: ...

    def chat_template(self) -> str | None: ...

    def special_tokens(self) -> dict[str, str]: ...

    def control_tokens(self) -> dict[str, int]:
        """The text and id of each control token: only a chat template may write them."""
        ...

    def close(self) -> None: ...


class SpeaksVocabulary:
    """The Engine protocol's vocabulary calls, answered by `self.vocabulary`."""

    vocabulary: Vocabulary

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocabulary.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.vocabulary.detokenize(tokens)

    def vocab_size(self) -> int:
        return self.vocabulary.vocab_size()

    def add_bos(self) -> bool:
        return self.vocabulary.add_bos()

    def chat_template(self) -> str | None:
        return self.vocabulary.chat_template()

    def special_tokens(self) -> dict[str, str]:
        return self.vocabulary.special_tokens()

    def control_tokens(self) -> dict[str, int]:
        return self.vocabulary.control_tokens()
