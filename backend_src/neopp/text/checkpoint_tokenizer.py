"""The checkpoint's own tokenizer, read from its folder with Hugging Face ``tokenizers``.

A SenseNova-U1 checkpoint ships a byte-level BPE ``tokenizer.json`` whose added tokens
(``<|im_start|>``, ``<think>``, ``<img>`` ...) sit at fixed ids. Its ``tokenizer_config.json``
adds no BOS or EOS to a text, so the file alone fixes the ids. The generation prompts are
written as text holding those tokens, so the tokenizer must map each of them to its single id;
:func:`load_checkpoint_tokenizer` checks that once, at load, instead of trusting the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ..errors import ConfigError
from .tokenizer import TOKENIZER_FILE

MAX_TOKENIZER_BYTES = 64 << 20  # a real Qwen3 tokenizer.json is ~11 MB


@dataclass(frozen=True)
class CheckpointTokenizer:
    """Text to ids exactly as the checkpoint's tokenizer does it, with no extra BOS/EOS."""

    tokenizer: Tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens written out."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_checkpoint_tokenizer(folder: str | Path, required: tuple[str, ...] = ()) -> CheckpointTokenizer:
    """Read ``folder/tokenizer.json``; every token in ``required`` must encode to one id."""
    path = Path(folder) / TOKENIZER_FILE
    try:
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise ConfigError(f"{TOKENIZER_FILE}: larger than {MAX_TOKENIZER_BYTES} bytes")
        tok = CheckpointTokenizer(Tokenizer.from_file(str(path)))
    except OSError as exc:
        raise ConfigError(f"{TOKENIZER_FILE}: cannot be read ({exc.strerror})") from exc
    except Exception as exc:  # noqa: BLE001 - the library raises its own untyped error for a bad file
        raise ConfigError(f"{TOKENIZER_FILE}: not a Hugging Face tokenizer file") from exc
    for token in required:
        if tok.token_id(token) is None or len(tok.encode(token)) != 1:
            raise ConfigError(f"{TOKENIZER_FILE}: the special token {token!r} is missing")
    return tok
