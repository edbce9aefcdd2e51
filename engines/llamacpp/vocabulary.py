"""A GGUF model's vocabulary, from llama.cpp: the engine's own Model, or a vocab_only load of the
file (a few MB) for a model not loaded yet."""

from __future__ import annotations

from pathlib import Path

from engines.llamacpp.runtime import Model


class LlamaVocabulary:
    def __init__(self, model: Model) -> None:
        self.model = model  # closed with the vocabulary

    @classmethod
    def of_file(cls, path: Path) -> LlamaVocabulary:
        return cls(Model(path, vocab_only=True))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: list[int]) -> str:
        return self.model.detokenize(tokens)

    def vocab_size(self) -> int:
        return self.model.n_vocab

    def add_bos(self) -> bool:
        return self.model.add_bos

    def chat_template(self) -> str | None:
        return self.model.meta("tokenizer.chat_template")

    def special_tokens(self) -> dict[str, str]:
        return self.model.special_tokens()

    def control_tokens(self) -> dict[str, int]:
        return self.model.control_tokens()

    def close(self) -> None:
        self.model.close()
