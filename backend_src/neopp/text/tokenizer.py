"""A word-level tokenizer read from the checkpoint's ``tokenizer.json``.

The demo's language tower knows a closed vocabulary. A prompt with a word outside it is refused,
naming the words and listing the vocabulary: an image that silently ignored half the prompt
would look like an answer to it. Case and punctuation are dropped; "an" reads as "a" where the
vocabulary has only "a" (the grammar allows both articles).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import ConfigError, InputError
from ..json_file import read_json_object

TOKENIZER_FILE = "tokenizer.json"
KIND = "word-level"
PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"
MAX_PROMPT_BYTES = 2048
_WORD = re.compile(r"[a-z0-9]+")
ALIASES = {"an": "a"}  # a word the vocabulary spells another way


@dataclass(frozen=True)
class WordTokenizer:
    vocab: tuple[str, ...]
    max_tokens: int

    @cached_property
    def ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.vocab)}

    @classmethod
    def from_file(cls, path: str | Path) -> WordTokenizer:
        raw = read_json_object(path, "tokenizer")
        if raw.get("kind") != KIND:
            raise ConfigError(f"{TOKENIZER_FILE}: 'kind' must be {KIND!r}, got {raw.get('kind')!r}")
        vocab = raw.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab) or len(set(vocab)) != len(vocab):
            raise ConfigError(f"{TOKENIZER_FILE}: 'vocab' must be a list of distinct words")
        if vocab[:3] != [PAD, BOS, UNK]:
            raise ConfigError(f"{TOKENIZER_FILE}: the vocabulary must start with {PAD}, {BOS}, {UNK}")
        max_tokens = raw.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens < 2:
            raise ConfigError(f"{TOKENIZER_FILE}: 'max_tokens' must be an integer >= 2")
        return cls(tuple(vocab), max_tokens)

    def to_json(self) -> dict:
        return {"kind": KIND, "vocab": list(self.vocab), "max_tokens": self.max_tokens}

    def words(self, prompt: str) -> list[str]:
        return _WORD.findall(prompt.lower())

    def encode(self, prompt: str, name: str = "PROMPT", known_only: bool = True) -> list[int]:
        """``<bos>`` then one id per word; an empty prompt is ``<bos>`` alone (the unconditional
        branch). ``name`` is the input the prompt came from, for the error message.
        ``known_only=False`` (training on a corpus larger than a small test vocabulary) maps an
        unknown word to ``<unk>`` instead of refusing the prompt."""
        if len(prompt.encode("utf-8")) > MAX_PROMPT_BYTES:
            raise InputError(f"{name}: at most {MAX_PROMPT_BYTES} bytes")
        ids = self.ids
        words = [w if w in ids else ALIASES.get(w, w) for w in self.words(prompt)]
        unknown = list(dict.fromkeys(w for w in words if w not in ids))  # a word is [a-z0-9]+: never <unk>
        if unknown and not known_only:
            words = [w if w in ids else UNK for w in words]
        elif unknown:
            known = ", ".join(w for w in self.vocab if w not in (PAD, BOS, UNK))
            raise InputError(f"{name}: unknown words {unknown}; this model knows only the words of its "
                             f"checkpoint's {TOKENIZER_FILE}: {known}")
        tokens = [ids[BOS]] + [ids[w] for w in words]
        if len(tokens) > self.max_tokens:
            raise InputError(f"{name}: {len(tokens) - 1} words, at most {self.max_tokens - 1}")
        return tokens
