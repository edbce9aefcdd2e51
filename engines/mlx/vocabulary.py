"""An MLX folder's vocabulary: the transformers tokenizer mlx-lm loads (no weights, no mlx arrays),
with each token's bytes for streaming text out of token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (printable stand-ins for every byte value)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, n = visible[:], 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            codes.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, codes)}


class MlxVocabulary:
    def __init__(self, folder: Path) -> None:
        from mlx_lm.utils import load_config, load_tokenizer

        # As mlx_lm.load does: the end-of-turn tokens are config.json's (or generation_config's).
        self.tokenizer: Any = load_tokenizer(folder, eos_token_ids=load_config(folder).get("eos_token_id"))
        hf = self.tokenizer._tokenizer  # the transformers tokenizer mlx-lm wraps
        self.hf = hf
        decoder = _byte_decoder()
        special = set(hf.all_special_ids)
        self.pieces: dict[int, bytes] = {}
        for token, ident in hf.get_vocab().items():
            if ident in special or token in hf.all_special_tokens:
                self.pieces[ident] = token.encode()
            else:
                self.pieces[ident] = bytes(decoder.get(ch, ord("?")) for ch in token)
        self.eos: frozenset[int] = frozenset(self.tokenizer.eos_token_ids)

    def piece(self, token: int) -> bytes:
        return self.pieces.get(token, b"")  # control tokens' text is in the pieces too

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        # transformers parses special tokens in text unless told to split them as plain text
        return list(self.hf.encode(text, add_special_tokens=add_special, split_special_tokens=not parse_special))

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def vocab_size(self) -> int:
        return len(self.pieces)

    def add_bos(self) -> bool:
        return bool(getattr(self.hf, "add_bos_token", False))

    def chat_template(self) -> str | None:
        return self.hf.chat_template

    def special_tokens(self) -> dict[str, str]:
        return {k: v for k, v in (("bos_token", self.hf.bos_token), ("eos_token", self.hf.eos_token)) if v}

    def control_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.hf.added_tokens_decoder.items() if t.special and t.content}

    def close(self) -> None:
        pass  # Python objects only
