"""The demo's word-level tokenizer, stored as a Hugging Face ``tokenizers`` WordLevel file.

The demo's language tower knows a closed vocabulary. A prompt with a word outside it is refused,
naming the words and listing the vocabulary: an image that silently ignored half the prompt
would look like an answer to it. Case and punctuation are dropped; "an" reads as "a" where the
vocabulary has only "a" (the grammar allows both articles).

The files are the ones a real checkpoint has: ``tokenizer.json`` (a WordLevel model, word ids
in vocabulary order) and ``tokenizer_config.json`` (``model_max_length``: tokens, ``<bos>``
included). A real checkpoint's byte-level BPE file is read by :mod:`.checkpoint_tokenizer`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers

from ..errors import ConfigError, InputError
from ..json_file import read_json_object

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PAD, BOS, UNK = "<pad>", "<bos>", "<unk>"
DEMO_PROMPT_BYTES = 2048  # the demo's prompts are a few words
_WORD = re.compile(r"[a-z0-9]+")
ALIASES = {"an": "a"}  # a word the vocabulary spells another way


@dataclass(frozen=True)
class WordTokenizer:
    vocab: tuple[str, ...]
    max_tokens: int

    @cached_property
    def ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.vocab)}

    @cached_property
    def model(self) -> Tokenizer:
        """The WordLevel tokenizer that maps the prompt's words to ids."""
        tok = Tokenizer(models.WordLevel(vocab=self.ids, unk_token=UNK))
        tok.normalizer = normalizers.Lowercase()
        return tok

    @classmethod
    def from_file(cls, path: str | Path) -> WordTokenizer:
        """``tokenizer.json`` and, beside it, ``tokenizer_config.json``."""
        raw = read_json_object(path, "tokenizer")
        model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
        if model.get("type") != "WordLevel":
            raise ConfigError(f"{TOKENIZER_FILE}: the model must be a WordLevel one, got {model.get('type')!r}")
        vocab = _ordered_vocab(model.get("vocab"))
        if vocab[:3] != [PAD, BOS, UNK]:
            raise ConfigError(f"{TOKENIZER_FILE}: the vocabulary must start with {PAD}, {BOS}, {UNK}")
        config = read_json_object(Path(path).parent / TOKENIZER_CONFIG_FILE, "tokenizer config")
        max_tokens = config.get("model_max_length")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2:
            raise ConfigError(f"{TOKENIZER_CONFIG_FILE}: 'model_max_length' must be an integer >= 2")
        return cls(tuple(vocab), max_tokens)

    def to_json(self) -> dict:
        """``tokenizer.json``'s content."""
        return json.loads(self.model.to_str())

    def config_json(self) -> dict:
        """``tokenizer_config.json``'s content."""
        return {"model_max_length": self.max_tokens, "bos_token": BOS, "pad_token": PAD, "unk_token": UNK}

    def words(self, prompt: str) -> list[str]:
        return _WORD.findall(prompt.lower())

    def encode(self, prompt: str, name: str = "PROMPT", known_only: bool = True) -> list[int]:
        """``<bos>`` then one id per word; an empty prompt is ``<bos>`` alone (the unconditional
        branch). ``name`` is the input the prompt came from, for the error message.
        ``known_only=False`` (training on a corpus larger than a small test vocabulary) maps an
        unknown word to ``<unk>`` instead of refusing the prompt."""
        if len(prompt.encode("utf-8")) > DEMO_PROMPT_BYTES:
            raise InputError(f"{name}: at most {DEMO_PROMPT_BYTES} bytes")
        ids = self.ids
        words = [w if w in ids else ALIASES.get(w, w) for w in self.words(prompt)]
        unknown = list(dict.fromkeys(w for w in words if w not in ids))  # a word is [a-z0-9]+: never <unk>
        if unknown and known_only:
            known = ", ".join(w for w in self.vocab if w not in (PAD, BOS, UNK))
            raise InputError(f"{name}: unknown words {unknown}; this model knows only the words of its "
                             f"checkpoint's {TOKENIZER_FILE}: {known}")
        tokens = [ids[BOS]] + (self.model.encode(words, is_pretokenized=True).ids if words else [])
        if len(tokens) > self.max_tokens:
            raise InputError(f"{name}: {len(tokens) - 1} words, at most {self.max_tokens - 1}")
        return tokens


def _ordered_vocab(vocab: object) -> list[str]:
    """The WordLevel vocabulary as a list in id order; its ids must be 0..n-1."""
    if not isinstance(vocab, dict) or not all(isinstance(w, str) and type(i) is int for w, i in vocab.items()):
        raise ConfigError(f"{TOKENIZER_FILE}: the model's 'vocab' must map words to integer ids")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ConfigError(f"{TOKENIZER_FILE}: the vocabulary's ids must be 0..{len(vocab) - 1}, each once")
    return sorted(vocab, key=vocab.__getitem__)
