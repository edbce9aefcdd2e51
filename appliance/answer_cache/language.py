"""The language a question is written in: the error bound is kept per language, because a near miss
in Portuguese hides where an English one does not (docs/performance/cache.md).

py3langid (langid.py's maintained fork; a 4.6 MB naive Bayes model inside the package, about 0.3 ms a
question) limited to the languages below, so that a short English question is not read as Nigerian
Pidgin or Galician; its model file is checked against the digest it was measured with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_SHA256 = "f4f4a2c3465ca1f081541037f9cac23021d68151c2f709c55ae5eedfca522963"
# Widely written languages; a question in any other is read as its nearest of these.
LANGUAGES = ("en", "pt", "es", "fr", "de", "it", "nl", "pl", "sv", "da", "no", "fi", "cs", "ro", "hu", "tr", "ru", "uk", "el",
             "ja", "zh", "ko", "ar", "he", "hi", "id", "vi", "th")
# Past this the language is plain; the model reads only the start (a pasted log does not change a question's language).
MAX_CHARS = 2000


@dataclass(frozen=True)
class Languages:
    identifier: Any

    def of(self, text: str) -> str:
        return str(self.identifier.classify(text[:MAX_CHARS])[0])


def model_file() -> Path:
    import py3langid.langid as langid

    return Path(langid.MODEL_DIR) / langid.MODEL_FILE


def load() -> Languages:
    """The identifier, after checking its model file (blocking: call it off the event loop)."""
    import py3langid.langid as langid

    path = model_file()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != MODEL_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {MODEL_SHA256} (py3langid's model changed; measure it again)")
    identifier = langid.LanguageIdentifier.from_model_file(path, norm_probs=False)
    identifier.set_languages(list(LANGUAGES))
    return Languages(identifier)
