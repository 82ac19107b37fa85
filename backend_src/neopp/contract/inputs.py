"""Every generation model's inputs and outputs: names, Triton types, dims, which are optional.

The parsers check a request against these rows (``serving.request_parsing``,
``serving.stream_parsing``), the ``config.pbtxt`` blocks are written from them (``make
contract-configs``) and ``docs/contract.md`` is tested against them; the session, prompt-to-image
and prompt-encoder tables are derived from them (``serving.model_io``).
"""

from __future__ import annotations

from dataclasses import dataclass

# A prompt (PROMPT, NEGATIVE_PROMPT; /v1's prompt): at most this many characters, and at the
# boundary, before it is decoded, at most 4 UTF-8 bytes each. A checkpoint's tokenizer may bound
# it further (the demo's words; a U1 prefix's tokens).
MAX_PROMPT_CHARS = 8192
MAX_PROMPT_BYTES = 4 * MAX_PROMPT_CHARS

# An output's ``classification`` parameter (Triton's classification extension): every output here
# is a picture or its bytes, and Triton 2.51 dies (SIGFPE) classifying a BYTES output, so both
# ports refuse it before Triton sees it.
CLASSIFICATION_REFUSED = ("parameters.classification is not served: the outputs of this server are "
                          "pictures, not scores")

@dataclass(frozen=True)
class TensorSpec:
    """One row of the contract's input or output table."""

    data_type: str  # Triton config spelling, e.g. "TYPE_INT64"
    dims: tuple[int, ...]
    optional: bool = True


CFG_NORMS = ("global", "channel", "none")  # CFG_NORM: how the guided velocity is held to the cond one's norm

# docs/contract.md, "Inputs of every generation model"; Triton's auto-complete adds any missing row.
INPUT_SPECS: dict[str, TensorSpec] = {
    "COND_KV": TensorSpec("TYPE_BF16", (-1, 2, -1, -1, -1), optional=False),
    "UNCOND_KV": TensorSpec("TYPE_BF16", (-1, 2, -1, -1, -1)),
    "INDEX_OFFSET_COND": TensorSpec("TYPE_INT64", (1,), optional=False),
    "INDEX_OFFSET_UNCOND": TensorSpec("TYPE_INT64", (1,)),
    "SIZE": TensorSpec("TYPE_INT64", (2,)),
    "SEED": TensorSpec("TYPE_INT64", (1,)),
    "RNG_STATE": TensorSpec("TYPE_UINT8", (-1,)),
    "NOISE": TensorSpec("TYPE_FP32", (1, 3, -1, -1)),
    "TASK": TensorSpec("TYPE_STRING", (1,)),
    "CFG_SCALE": TensorSpec("TYPE_FP32", (1,)),
    "CFG_INTERVAL": TensorSpec("TYPE_FP32", (2,)),
    "CFG_NORM": TensorSpec("TYPE_STRING", (1,)),
    "TIMESTEP_SHIFT": TensorSpec("TYPE_FP32", (1,)),
    "STEPS": TensorSpec("TYPE_INT64", (1,)),
    "OUTPUT_FORMAT": TensorSpec("TYPE_STRING", (1,)),
    "RESIZE": TensorSpec("TYPE_INT64", (2,)),
    "IMAGE_GUIDANCE_SCALE": TensorSpec("TYPE_FP32", (1,)),
    "IMAGE_KV": TensorSpec("TYPE_BF16", (-1, 2, -1, -1, -1)),
    "INDEX_OFFSET_IMAGE": TensorSpec("TYPE_INT64", (1,)),
    "LORA": TensorSpec("TYPE_STRING", (1,)),
    "LORA_SCALE": TensorSpec("TYPE_FP32", (1,)),
    "CACHE": TensorSpec("TYPE_STRING", (1,)),
    "CACHE_THRESHOLD": TensorSpec("TYPE_FP32", (1,)),
    **{name: TensorSpec("TYPE_STRING", (1,)) for name in ("RECORD_PROMPT", "RECORD_NEGATIVE_PROMPT")},
    "RECORD_THINK": TensorSpec("TYPE_INT64", (1,)),
}
# Written into the picture's record only, never read to draw it: the prompts the prefixes came from
# (kept only where the model's ``record_prompt`` allows) and think mode's token cap (0: off).
RECORD_INPUTS = ("RECORD_PROMPT", "RECORD_NEGATIVE_PROMPT", "RECORD_THINK")
OUTPUT_SPECS: dict[str, TensorSpec] = {
    "IMAGE": TensorSpec("TYPE_STRING", (1,)),
    "NEXT_RNG_STATE": TensorSpec("TYPE_UINT8", (-1,)),
}
KV_INPUTS = ("COND_KV", "UNCOND_KV", "IMAGE_KV")
# The prompt encoder's prefixes: what neopp_t2i and the door pass a generation model (THINK_TEXT aside).
ENCODER_OUTPUTS = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")

# Think mode (the prompt encoder and neopp_t2i): the tower reasons before the image, at most
# THINK_MAX_TOKENS tokens (default 1024), and THINK_TEXT answers the reasoning ("" without THINK).
THINK_INPUT_SPECS: dict[str, TensorSpec] = {
    "THINK": TensorSpec("TYPE_BOOL", (1,)),
    "THINK_MAX_TOKENS": TensorSpec("TYPE_INT64", (1,)),
}
THINK_TEXT_SPEC = TensorSpec("TYPE_STRING", (1,), optional=False)
DEFAULT_THINK_TOKENS = 1024  # the official default cap
MAX_THINK_TOKENS = 4096

# Editing (the prompt encoder and neopp_t2i): IMAGES holds the input pictures, each an encoded
# PNG, JPEG or WebP file, in the order the prompt refers to them ("Image-1", "Image-2", ...). With
# IMAGES the encoder also answers the image-only branch (IMAGE_KV, INDEX_OFFSET_IMAGE).
EDIT_INPUT_SPECS: dict[str, TensorSpec] = {"IMAGES": TensorSpec("TYPE_STRING", (-1,))}
EDIT_OUTPUTS = ("IMAGE_KV", "INDEX_OFFSET_IMAGE")
EDIT_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # as Pillow names them
MAX_EDIT_IMAGES = 4
MAX_EDIT_IMAGE_BYTES = 16 * 1024 * 1024  # one encoded file
MAX_EDIT_IMAGE_PIXELS = 4096 * 4096  # one decoded picture, before it is resized for the tower

# A streamed twin takes the plain inputs (COND_KV may come as base64 instead) and answers every step.
STREAM_INPUT_SPECS: dict[str, TensorSpec] = {
    **{name: TensorSpec(spec.data_type, spec.dims, optional=True) if name == "COND_KV" else spec
       for name, spec in INPUT_SPECS.items()},
    "PREVIEW_EVERY": TensorSpec("TYPE_INT64", (1,)),
    "PREVIEW_SIZE": TensorSpec("TYPE_INT64", (2,)),
    **{name: TensorSpec("TYPE_STRING", (1,)) for name in ("COND_KV_B64", "UNCOND_KV_B64", "IMAGE_KV_B64")},
    "BASE64_OUTPUT": TensorSpec("TYPE_INT64", (1,)),
}
STREAM_OUTPUT_SPECS: dict[str, TensorSpec] = {
    **OUTPUT_SPECS,
    "STEP": TensorSpec("TYPE_INT64", (1,)),
    "TOTAL_STEPS": TensorSpec("TYPE_INT64", (1,)),
    "PREVIEW": TensorSpec("TYPE_STRING", (1,)),
}
B64_INPUTS = {"COND_KV_B64": "COND_KV", "UNCOND_KV_B64": "UNCOND_KV", "IMAGE_KV_B64": "IMAGE_KV"}
STREAM_ONLY = ("PREVIEW_EVERY", "PREVIEW_SIZE", "BASE64_OUTPUT", *B64_INPUTS)
