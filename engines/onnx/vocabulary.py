"""An ONNX embedding model's vocabulary: a `tokenizers` tokenizer beside the model file. It adds the
model's special tokens itself and never truncates or pads: the engine refuses what is too long and
pads per pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(path: Path) -> Any:
    """A tokenizer.json, or a WordPiece vocab.txt (cased when its vocabulary has capitals)."""
    from tokenizers import Tokenizer
    from tokenizers.implementations import BertWordPieceTokenizer

    if path.suffix == ".json":
        tokenizer = Tokenizer.from_file(str(path))
    else:
        vocab = path.read_text(encoding="utf-8").splitlines()
        # An uncased vocabulary has no capital letters outside its bracketed specials.
        cased = any(t != t.lower() for t in vocab if not (t.startswith("[") and t.endswith("]")))
        tokenizer = BertWordPieceTokenizer(str(path), lowercase=not cased)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


class OnnxVocabulary:
    def __init__(self, path: Path) -> None:
        self.tokenizer = load_tokenizer(path)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special).ids)

    def detokenize(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def add_bos(self) -> bool:
        return True  # the tokenizer opens (and closes) an input with the model's own special tokens

    def chat_template(self) -> str | None:
        return None

    def special_tokens(self) -> dict[str, str]:
        return {}

    def control_tokens(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass  # Python objects only
