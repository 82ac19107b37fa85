# ruff: noqa: F811 - the fixtures imported below are parameters of the tests
"""Editing on a SenseNova-U1 checkpoint: input pictures in the prompt encoder, against references
written from the official editing rules (``tests.reference.u1_edits``), never this project's encoder.

The checkpoint is tiny but real in form (``testing.tiny_u1``): the understanding tower with its
picture embedding under the real key names, the tokenizer's special tokens at their real ids.
Pictures of 512x512 and 512x544 pixels need no resize, so their pixels are checked plainly; the
resize rule is checked on its own, against figures worked out from the official formula.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from neopp.errors import InputError
from neopp.serving.prompt_encoding import encode_prompts
from neopp.serving.prompt_parsing import PromptRequest
from neopp.text.edit_images import fitted_size, read_pictures
from neopp.text.language_tower import LanguageTower
from neopp.text.think import think
from testing import tiny_u1
from tests.reference.language_reference import reference_forward
from tests.reference.u1_edits import (
    edit_pieces,
    image_only_pieces,
    picture_block,
    reference_picture_tokens,
    reference_pixels,
    reference_positions,
)
from tests.reference.u1_prompts import expected_ids
from tests.test_u1_prompt_encoder import bare, ckpt, tower  # noqa: F401 - the same tiny U1 checkpoint

PROMPT = "make the cat blue — 猫を青に « ok »!"


def picture(width: int, height: int, seed: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, fmt)
    return buf.getvalue()


ONE = (picture(512, 512, 1),)
TWO = (picture(512, 512, 1), picture(544, 512, 2))
GRIDS = {1: [(16, 16)], 2: [(16, 16), (16, 17)]}


def within_float32(kv: torch.Tensor, ref: torch.Tensor) -> None:
    assert kv.shape == ref.shape
    assert (kv.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("files", [ONE, TWO], ids=["one picture", "two pictures"])
def test_ids_positions_and_offsets_are_the_official_ones(tower, bare, files):
    grids = GRIDS[len(files)]
    ids = tower.prompt_ids
    cond, image_only = ids.edit_conditional(PROMPT, grids), ids.image_only(grids)
    assert cond == expected_ids(bare, edit_pieces(PROMPT, grids))
    assert image_only == expected_ids(bare, image_only_pieces(grids))
    for seq in (cond, image_only):
        assert torch.equal(torch.tensor(ids.positions(seq, grids)), reference_positions(seq, grids))
    out = encode_prompts(tower, PromptRequest(PROMPT, images=files))
    for name, seq in (("COND", cond), ("IMAGE", image_only)):
        assert out[f"INDEX_OFFSET_{name}"].tolist() == [int(reference_positions(seq, grids)[-1, 0]) + 1]
        assert out[f"{name}_KV"].shape[2] == len(seq)
    # each picture takes one temporal index: the offset is far below the token count
    assert out["INDEX_OFFSET_COND"][0] == len(cond) - sum(r * c for r, c in grids) + len(grids)


def test_a_picture_s_pixels_and_tokens_are_the_official_ones(ckpt, tower):
    (pic,) = read_pictures(ONE)
    assert (pic.pixels[0].double() - reference_pixels(ONE[0])).abs().max() < 1e-6
    tokens = tower.embed_pictures((pic,)).tokens[0]
    ref = reference_picture_tokens(ckpt, ONE[0])
    assert (tokens.double() - ref).abs().max() <= 2e-5 * ref.abs().max()


@pytest.mark.parametrize("files", [ONE, TWO], ids=["one picture", "two pictures"])
def test_prefixes_match_the_float64_tower(ckpt, tower, files):
    grids = GRIDS[len(files)]
    pictures = torch.cat([reference_picture_tokens(ckpt, f) for f in files])
    cond, image_only = tower.edit_prefixes(PROMPT, tower.embed_pictures(read_pictures(files)))
    for (kv, offset), seq in ((cond, tower.prompt_ids.edit_conditional(PROMPT, grids)),
                              (image_only, tower.prompt_ids.image_only(grids))):
        positions = reference_positions(seq, grids)
        within_float32(kv, reference_forward(ckpt, seq, positions, pictures)[0])
        assert offset == int(positions[-1, 0]) + 1
    out = encode_prompts(tower, PromptRequest(PROMPT, images=files))  # the served dtype: one bf16 rounding
    assert torch.equal(out["COND_KV"], cond[0].to(torch.bfloat16))
    assert torch.equal(out["IMAGE_KV"], image_only[0].to(torch.bfloat16))
    assert torch.equal(out["UNCOND_KV"], tower.unconditional("")[0].to(torch.bfloat16))


def test_think_with_a_picture_reasons_greedily_from_its_positions(ckpt, tower, bare):
    """The reference writes each token by running the whole sequence again, its positions
    continuing after the picture's (one temporal index for the whole picture)."""
    grids, cap = GRIDS[1], 3
    pictures = reference_picture_tokens(ckpt, ONE[0])
    ids = expected_ids(bare, edit_pieces(PROMPT, grids, think=True))
    positions = reference_positions(ids, grids)
    for _ in range(cap):
        token = int(torch.argmax(reference_forward(ckpt, ids, positions, pictures)[2]))
        if token == tiny_u1.REAL_IDS["<|im_end|>"]:
            break
        ids.append(token)
        positions = torch.cat([positions, torch.tensor([[int(positions[-1, 0]) + 1, 0, 0]])])
        if token == tiny_u1.REAL_IDS["</think>"]:
            break
    tail = expected_ids(bare, ["\n\n", "<img>"])
    ids += tail
    last = int(positions[-1, 0])
    positions = torch.cat([positions, torch.tensor([[last + 1 + i, 0, 0] for i in range(len(tail))])])
    thought = think(tower, PROMPT, cap, pictures=tower.embed_pictures(read_pictures(ONE)))
    assert list(thought.ids) == ids
    assert thought.offset == int(positions[-1, 0]) + 1
    within_float32(thought.kv, reference_forward(ckpt, ids, positions, pictures)[0])


def test_the_resize_is_the_official_rule():
    assert fitted_size(200, 300, 2048 * 2048) == (448, 640)  # scaled up to 512 * 512 pixels at least
    assert fitted_size(3000, 4000, 2048 * 2048) == (1760, 2336)  # scaled down, floor to whole tokens
    assert fitted_size(1000, 700, 2048 * 2048) == (992, 704)  # rounded to the nearest whole token
    with pytest.raises(InputError, match="IMAGES: picture 1 .* at most 200 times"):
        fitted_size(32, 6432, 2048 * 2048)
    # the filter is Pillow's default, which the official code leaves in place
    data = picture(300, 200, 3)
    expected = Image.open(io.BytesIO(data)).convert("RGB").resize((640, 448))
    buf = io.BytesIO()
    expected.save(buf, "PNG")
    (pic,) = read_pictures((data,))
    assert (pic.pixels[0].double() - reference_pixels(buf.getvalue())).abs().max() < 1e-6


def test_transparent_pixels_are_laid_on_white():
    rgba = np.zeros((512, 512, 4), dtype=np.uint8)
    rgba[:, :256] = (10, 20, 30, 255)  # left half opaque, right half transparent
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    expected = np.full((512, 512, 3), 255, dtype=np.uint8)
    expected[:, :256] = (10, 20, 30)
    plain = io.BytesIO()
    Image.fromarray(expected, "RGB").save(plain, "PNG")
    (pic,) = read_pictures((buf.getvalue(),))
    assert (pic.pixels[0].double() - reference_pixels(plain.getvalue())).abs().max() < 1e-6


def huge_bilevel_png() -> bytes:
    buf = io.BytesIO()
    Image.new("1", (4100, 4100)).save(buf, "PNG")  # a few kB on the wire, 16.8 M pixels decoded
    return buf.getvalue()


@pytest.mark.parametrize(("files", "prompt", "message"), [
    ((b"not a picture at all",), PROMPT, "IMAGES: picture 1 does not decode as PNG, JPEG, WEBP"),
    ((ONE[0], picture(64, 64, 4, fmt="GIF")), PROMPT, "IMAGES: picture 2 does not decode"),
    ((ONE[0][:200],), PROMPT, "IMAGES: picture 1 does not decode"),
    ((huge_bilevel_png(),), PROMPT, "IMAGES: picture 1 is 4100x4100 pixels; at most 16777216"),
    (ONE, "<image> then <image>", "PROMPT: places 2 pictures with <image> but IMAGES holds 1"),
    (ONE, "sneak <IMG_CONTEXT> in", "PROMPT: must not hold <IMG_CONTEXT>"),
])
def test_bad_pictures_and_prompts_are_refused_by_name_and_the_next_edit_is_served(tower, files, prompt, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        encode_prompts(tower, PromptRequest(prompt, images=files))
    assert encode_prompts(tower, PromptRequest(PROMPT, images=ONE))["INDEX_OFFSET_IMAGE"][0] > 0


def test_a_prompt_may_place_its_picture(tower, bare):
    text = "".join(edit_pieces("put <image> in the sky", []))
    text = text.replace("<image>", "".join(picture_block(16, 16)))
    assert tower.prompt_ids.edit_conditional("put <image> in the sky", GRIDS[1]) == expected_ids(bare, [text])


def test_checkpoints_that_cannot_edit_refuse_by_name_and_still_serve_prompts(tmp_path):
    """A tiny generation checkpoint carries one understanding vision key of another width, as a
    decoy the generation loader must skip: the encoder loads, and editing names that key."""
    no_vision = tiny_u1.write_tiny_u1_checkpoint(tmp_path / "novision", seed=5, vision=False)
    tower = LanguageTower.from_pretrained(no_vision)
    with pytest.raises(InputError, match=r"IMAGES: this checkpoint cannot edit pictures: its vision embedding "
                                         r"tensor 'vision_model.embeddings.patch_embedding.weight' has shape"):
        encode_prompts(tower, PromptRequest(PROMPT, images=ONE))
    assert encode_prompts(tower, PromptRequest(PROMPT))["INDEX_OFFSET_COND"][0] > 0  # prompts still served


def test_a_partial_picture_embedding_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = tiny_u1.write_tiny_u1_checkpoint(tmp_path / "partial", seed=5)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["vision_model.embeddings.dense_embedding.bias"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    tower = LanguageTower.from_pretrained(ckpt)
    with pytest.raises(InputError, match="tensor 'vision_model.embeddings.dense_embedding.bias' is missing"):
        encode_prompts(tower, PromptRequest(PROMPT, images=ONE))
