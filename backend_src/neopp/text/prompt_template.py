"""The generation prompts of a SenseNova-U1 checkpoint, token for token.

The checkpoint was trained on one chat layout (``neo1_0``: ChatML turns, no default system
message). A text-to-image request holds two prefixes the generation tower attends to:

* conditional: the generation system message, the user's prompt, an assistant turn whose think
  block is already closed (non-think mode), then ``<img>``;
* unconditional: no system turn, an empty user turn (or the negative prompt in its place), the
  assistant turn, then ``<img>``.

Text token ``i`` sits at position ``(t=i, h=0, w=0)``; the image's tokens all take ``t = len(ids)``,
which is the index offset a prefix hands to the generation tower. Any other layout shifts every
token the tower was trained on, so the strings here are fixed, not configurable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..contract.inputs import MAX_PROMPT_CHARS
from ..errors import ConfigError, InputError
from .checkpoint_tokenizer import CheckpointTokenizer, load_checkpoint_tokenizer

TEMPLATE_NAME = "neo1_0"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
SPECIAL_TOKENS = (IM_START, IM_END, THINK_OPEN, THINK_CLOSE, IMG_START, IMG_END, IMG_CONTEXT)
CLOSED_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"

__all__ = ["GENERATION_SYSTEM_MESSAGE", "IMAGE_TAIL", "PromptPrefix", "check_template", "conditional_query",
           "edit_prompt", "encode_conditional", "encode_think", "encode_unconditional", "image_only_query",
           "load_u1_tokenizer", "think_query", "unconditional_query", "with_pictures"]

GENERATION_SYSTEM_MESSAGE = (
    'You are an image generation and editing assistant that accurately understands and '
    'executes user intent.\n'
    '\n'
    'You support two modes:\n'
    '\n'
    '1. Think Mode:\n'
    'If the task requires reasoning, you MUST start with a <think></think> block. Put all '
    'reasoning inside the block using plain text. DO NOT include any image tags. Keep it '
    'reasonable and directly useful for producing the final image.\n'
    '\n'
    '2. Non-Think Mode:\n'
    'If no reasoning is needed, directly produce the final image.\n'
    '\n'
    'Task Types:\n'
    '\n'
    'A. Text-to-Image Generation:\n'
    "- Generate a high-quality image based on the user's description.\n"
    '- Ensure visual clarity, semantic consistency, and completeness.\n'
    "- DO NOT introduce elements that contradict or override the user's intent.\n"
    '\n'
    'B. Image Editing:\n'
    '- Use the provided image(s) as input or reference for modification or transformation.\n'
    '- The result can be an edited image or a new image based on the reference(s).\n'
    '- Preserve all unspecified attributes unless explicitly changed.\n'
    '\n'
    'General Rules:\n'
    '- For any visible text in the image, follow the language specified for the rendered text '
    "in the user's description, not the language of the prompt. If no language is specified, "
    "use the user's input language."
)


@dataclass(frozen=True)
class PromptPrefix:
    """A prefix's token ids, their (t, h, w) positions and the image's index offset."""

    ids: tuple[int, ...]

    @property
    def positions(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((t, 0, 0) for t in range(len(self.ids)))

    @property
    def index_offset(self) -> int:
        return len(self.ids)


def _turns(system: str, user: str) -> str:
    """The chat layout: a system turn only when there is a system message; an empty user turn
    still closes with ``<|im_end|>``; the assistant turn is left open."""
    head = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return f"{head}{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def conditional_query(prompt: str) -> str:
    """The conditional prefix's text (non-think mode)."""
    return _turns(GENERATION_SYSTEM_MESSAGE, prompt) + CLOSED_THINK + IMG_START


def think_query(prompt: str) -> str:
    """The conditional prefix's text in think mode: the think block is opened, not closed; the
    tower writes the reasoning, and ``IMAGE_TAIL`` follows it."""
    return _turns(GENERATION_SYSTEM_MESSAGE, prompt) + THINK_OPEN + "\n"


IMAGE_TAIL = "\n\n" + IMG_START  # after the reasoning, where the image starts


IMAGE_PLACE = "<image>"  # where a picture goes in an edit's prompt


def edit_prompt(prompt: str, count: int) -> str:
    """The user turn of an edit: the prompt may place its pictures with ``<image>``; those it does
    not place go first, each on its own line, labelled ``Image-1:``... when none is placed and
    there are several."""
    placed = prompt.count(IMAGE_PLACE)
    if placed > count:
        raise InputError(f"PROMPT: places {placed} pictures with {IMAGE_PLACE} but IMAGES holds {count}")
    if placed == 0 and count > 1:
        return "".join(f"Image-{i + 1}:{IMAGE_PLACE}\n" for i in range(count)) + prompt
    return f"{IMAGE_PLACE}\n" * (count - placed) + prompt


def image_only_query(count: int) -> str:
    """The image-only branch of an edit: its pictures as the user turn, no system turn, no prompt."""
    return _turns("", IMAGE_PLACE * count) + IMG_START


def with_pictures(query: str, tokens: list[int]) -> str:
    """Each ``<image>`` in turn becomes its picture's block: ``<img>``, one ``<IMG_CONTEXT>`` per
    image token, ``</img>``."""
    for n in tokens:
        query = query.replace(IMAGE_PLACE, IMG_START + IMG_CONTEXT * n + IMG_END, 1)
    return query


def unconditional_query(negative_prompt: str = "") -> str:
    """The unconditional prefix's text; a negative prompt takes the empty user turn's place."""
    return _turns("", negative_prompt) + IMG_START


def load_u1_tokenizer(folder: str | Path) -> CheckpointTokenizer:
    """A U1 checkpoint's tokenizer, refused unless each of the template's special tokens is one id."""
    return load_checkpoint_tokenizer(folder, SPECIAL_TOKENS)


def check_template(name: object) -> None:
    """A checkpoint names its chat layout in ``config.json``'s ``template``; only one is known."""
    if name != TEMPLATE_NAME:
        raise ConfigError(f"config.json: 'template' must be {TEMPLATE_NAME!r}, got {name!r}")


def encode_conditional(tokenizer: CheckpointTokenizer, prompt: str, max_tokens: int) -> PromptPrefix:
    """The conditional prefix of ``PROMPT``."""
    return _encode(tokenizer, conditional_query(_bounded(prompt, "PROMPT")), "PROMPT", max_tokens)


def encode_think(tokenizer: CheckpointTokenizer, prompt: str, max_tokens: int) -> PromptPrefix:
    """The think-mode query of ``PROMPT`` (the reasoning and the image tail come after it)."""
    return _encode(tokenizer, think_query(_bounded(prompt, "PROMPT")), "PROMPT", max_tokens)


def encode_unconditional(tokenizer: CheckpointTokenizer, negative_prompt: str, max_tokens: int) -> PromptPrefix:
    """The unconditional prefix; ``NEGATIVE_PROMPT`` empty gives the plain unconditional query."""
    text = _bounded(negative_prompt, "NEGATIVE_PROMPT")
    return _encode(tokenizer, unconditional_query(text), "NEGATIVE_PROMPT", max_tokens)


def encode_edit(tokenizer: CheckpointTokenizer, prompt: str, tokens: list[int], max_tokens: int,
                think: bool = False) -> PromptPrefix:
    """The conditional prefix of an edit: the pictures (``tokens`` image tokens each) and ``PROMPT``;
    ``think`` opens the think block instead of closing it."""
    user = edit_prompt(_bounded(prompt, "PROMPT"), len(tokens))
    query = think_query(user) if think else conditional_query(user)
    return _encode_pictures(tokenizer, with_pictures(query, tokens), tokens, "PROMPT", max_tokens)


def encode_image_only(tokenizer: CheckpointTokenizer, tokens: list[int], max_tokens: int) -> PromptPrefix:
    """The image-only prefix of an edit."""
    return _encode_pictures(tokenizer, with_pictures(image_only_query(len(tokens)), tokens), tokens, "IMAGES",
                            max_tokens)


def _encode_pictures(tokenizer: CheckpointTokenizer, query: str, tokens: list[int], name: str,
                     max_tokens: int) -> PromptPrefix:
    """The text is bounded as a text prefix is; the pictures' tokens are bounded by their sizes.
    A prompt that writes a picture's own marks would shift every picture after it: refused."""
    ids = tokenizer.encode(query)
    context = tokenizer.token_id(IMG_CONTEXT)
    if sum(1 for i in ids if i == context) != sum(tokens):
        raise InputError(f"PROMPT: must not hold {IMG_CONTEXT}, which only the pictures of IMAGES write")
    if len(ids) - sum(tokens) > max_tokens:
        raise InputError(f"{name}: its prefix makes {len(ids) - sum(tokens)} text tokens, at most {max_tokens}")
    return PromptPrefix(tuple(ids))


def _bounded(text: str, name: str) -> str:
    """Bounds the tokenizer's work before the token count is known."""
    if len(text) > MAX_PROMPT_CHARS:
        raise InputError(f"{name}: at most {MAX_PROMPT_CHARS} characters")
    return text


def _encode(tokenizer: CheckpointTokenizer, query: str, name: str, max_tokens: int) -> PromptPrefix:
    ids = tokenizer.encode(query)
    if len(ids) > max_tokens:
        raise InputError(f"{name}: its prefix makes {len(ids)} tokens, at most {max_tokens}")
    return PromptPrefix(tuple(ids))
