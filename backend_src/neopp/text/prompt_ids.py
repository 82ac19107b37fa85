"""Which token ids a request's two prefixes hold, by the kind of checkpoint.

* **A SenseNova-U1 checkpoint** (its ``config.json`` names the chat layout ``neo1_0`` in
  ``template``): its own byte-level BPE tokenizer over the official generation prompts
  (:mod:`.prompt_template`): the conditional query with the generation system message and a
  closed think block, the unconditional one, a negative prompt in its user turn.
* **The demo** (a WordLevel ``tokenizer.json``, no template): ``<bos>`` and the prompt's words,
  the format its language tower was trained on; an unknown word refuses the request.

Either way the understanding tower runs the same code over the ids, and a prefix's index offset
is its token count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import ConfigError
from ..json_file import read_json_object
from .checkpoint_tokenizer import CheckpointTokenizer
from .prompt_template import (
    IM_END,
    IMAGE_TAIL,
    IMG_CONTEXT,
    IMG_START,
    TEMPLATE_NAME,
    THINK_CLOSE,
    check_template,
    encode_conditional,
    encode_edit,
    encode_image_only,
    encode_think,
    encode_unconditional,
    load_u1_tokenizer,
)
from .tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WordTokenizer

# The most tokens a U1 prefix may hold: the system message alone is about 250; the tokenizer's
# own model_max_length lowers it where smaller.
MAX_PREFIX_TOKENS = 4096


class PromptIds(Protocol):
    """A checkpoint's way from a request's texts to its prefixes' token ids."""

    kind: str  # what the log line and the refusals call it

    def conditional(self, prompt: str) -> list[int]:
        """The ids of ``PROMPT``'s prefix (InputError naming ``PROMPT``)."""
        ...

    def unconditional(self, negative_prompt: str) -> list[int]:
        """The ids of the unconditional prefix; ``NEGATIVE_PROMPT`` takes its text's place."""
        ...

    def vocabulary_size(self) -> int:
        """One more than the largest id the tokenizer can produce: the embedding must have as many rows."""
        ...


@dataclass(frozen=True)
class DemoPromptIds:
    tokenizer: WordTokenizer
    kind: str = "demo words"

    def conditional(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, "PROMPT")

    def unconditional(self, negative_prompt: str) -> list[int]:
        return self.tokenizer.encode(negative_prompt, "NEGATIVE_PROMPT")

    def vocabulary_size(self) -> int:
        return len(self.tokenizer.vocab)


@dataclass(frozen=True)
class ThinkMarks:
    """The tokens that end the reasoning: ``</think>`` (kept) and the end of the turn (not kept)."""

    think_close: int
    end_of_turn: int


@dataclass(frozen=True)
class U1PromptIds:
    tokenizer: CheckpointTokenizer
    max_tokens: int = MAX_PREFIX_TOKENS
    kind: str = f"{TEMPLATE_NAME} template"

    def conditional(self, prompt: str) -> list[int]:
        return list(encode_conditional(self.tokenizer, prompt, self.max_tokens).ids)

    def unconditional(self, negative_prompt: str) -> list[int]:
        return list(encode_unconditional(self.tokenizer, negative_prompt, self.max_tokens).ids)

    def vocabulary_size(self) -> int:
        return max(self.tokenizer.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def think_conditional(self, prompt: str) -> list[int]:
        """The ids of ``PROMPT``'s think-mode query (its think block open)."""
        return list(encode_think(self.tokenizer, prompt, self.max_tokens).ids)

    def edit_conditional(self, prompt: str, grids: list[tuple[int, int]], think: bool = False) -> list[int]:
        """The ids of an edit's conditional prefix; ``grids``: each picture's (rows, cols) of tokens."""
        return list(encode_edit(self.tokenizer, prompt, [r * c for r, c in grids], self.max_tokens, think).ids)

    def image_only(self, grids: list[tuple[int, int]]) -> list[int]:
        """The ids of an edit's image-only prefix."""
        return list(encode_image_only(self.tokenizer, [r * c for r, c in grids], self.max_tokens).ids)

    def picture_token(self) -> int:
        """The id of ``<IMG_CONTEXT>``, whose embedding a picture's token replaces."""
        return self.tokenizer.token_id(IMG_CONTEXT)  # type: ignore[return-value]  # load_u1_tokenizer checked it

    def positions(self, ids: list[int], grids: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(t, h, w) of each token. Each text token takes the next temporal index; a picture's
        tokens all take one index (the one after ``<img>``) and their row and column on its grid."""
        start, context = self.tokenizer.token_id(IMG_START), self.tokenizer.token_id(IMG_CONTEXT)
        cells = [(r, c) for rows, cols in grids for r in range(rows) for c in range(cols)]
        out, t, previous, k = [], -1, None, 0
        for token in ids:
            t += (previous == start) + (token != context)
            if token == context:
                out.append((t, cells[k][0], cells[k][1]))
                k += 1
            else:
                out.append((t, 0, 0))
            previous = token
        return out

    def image_tail(self) -> list[int]:
        return self.tokenizer.encode(IMAGE_TAIL)

    def think_marks(self) -> ThinkMarks:
        ids = (self.tokenizer.token_id(THINK_CLOSE), self.tokenizer.token_id(IM_END))
        if None in ids:  # load_u1_tokenizer checked both: never a client's fault
            raise ConfigError("tokenizer.json: </think> or <|im_end|> has no id")
        return ThinkMarks(*ids)  # type: ignore[arg-type]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_prompt_ids(ckpt_dir: str | Path) -> PromptIds:
    """The prompt ids of the checkpoint in ``ckpt_dir``: U1's template where ``config.json`` names
    one (checked to be the one known), else the demo's words."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / TOKENIZER_FILE).is_file():
        raise ConfigError(f"no {TOKENIZER_FILE}; this checkpoint has no prompt encoder")
    template = read_json_object(ckpt_dir / "config.json", "config.json").get("template")
    if template is None:
        return DemoPromptIds(WordTokenizer.from_file(ckpt_dir / TOKENIZER_FILE))
    check_template(template)
    return U1PromptIds(load_u1_tokenizer(ckpt_dir), _max_tokens(ckpt_dir))


def _max_tokens(ckpt_dir: Path) -> int:
    """``model_max_length`` of ``tokenizer_config.json`` where it is smaller than the bound."""
    path = ckpt_dir / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return MAX_PREFIX_TOKENS
    given = read_json_object(path, "tokenizer config").get("model_max_length")
    if isinstance(given, int) and not isinstance(given, bool) and given > 0:
        return min(given, MAX_PREFIX_TOKENS)
    return MAX_PREFIX_TOKENS
