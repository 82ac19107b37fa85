"""An edit's prefixes written out plainly from the official editing rules, independent of the encoder.

* The texts, piece by piece: the conditional query puts the pictures before the prompt
  (``Image-1:`` labels when there are several), the image-only query holds only the pictures,
  and each picture is ``<img>``, one ``<IMG_CONTEXT>`` per image token, ``</img>``.
* The positions, by the official cumulative rule: a token advances the temporal index unless it
  is ``<IMG_CONTEXT>``, and the token after ``<img>`` advances it too; a picture's tokens carry
  their row and column on its grid.
* The pixels of a picture that needs no resize: RGB over 255, then the ImageNet mean and std.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from neopp.text.prompt_template import GENERATION_SYSTEM_MESSAGE
from testing.tiny_u1 import REAL_IDS
from tests.reference.reference_ops import F64, as_model
from tests.reference.reference_tower import picture_tokens

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def picture_block(rows: int, cols: int) -> list[str]:
    return ["<img>", *["<IMG_CONTEXT>"] * (rows * cols), "</img>"]


def edit_pieces(prompt: str, grids: list[tuple[int, int]], think: bool = False) -> list[str]:
    user: list[str] = ["user\n"]
    for i, (rows, cols) in enumerate(grids):
        user += ([f"Image-{i + 1}:"] if len(grids) > 1 else []) + picture_block(rows, cols) + ["\n"]
    user.append(prompt)
    ending = ["<think>", "\n"] if think else ["<think>", "\n\n", "</think>", "\n\n", "<img>"]
    return ["<|im_start|>", "system\n" + GENERATION_SYSTEM_MESSAGE, "<|im_end|>", "\n", "<|im_start|>", *user,
            "<|im_end|>", "\n", "<|im_start|>", "assistant\n", *ending]


def image_only_pieces(grids: list[tuple[int, int]]) -> list[str]:
    blocks = [piece for rows, cols in grids for piece in picture_block(rows, cols)]
    return ["<|im_start|>", "user\n", *blocks, "<|im_end|>", "\n", "<|im_start|>", "assistant\n", "<img>"]


def reference_positions(ids: list[int], grids: list[tuple[int, int]]) -> torch.Tensor:
    """[S, 3] (t, h, w) by the official cumulative rule."""
    x = torch.tensor(ids)
    after_img = torch.cat([torch.zeros(1, dtype=torch.long), (x == REAL_IDS["<img>"]).long()])[:-1]
    context = x == REAL_IDS["<IMG_CONTEXT>"]
    t = torch.cumsum(after_img + (~context).long(), 0) - 1
    h, w = torch.zeros_like(t), torch.zeros_like(t)
    h[context] = torch.cat([torch.arange(r * c) // c for r, c in grids])
    w[context] = torch.cat([torch.arange(r * c) % c for r, c in grids])
    return torch.stack([t, h, w], dim=1)


def reference_pixels(data: bytes) -> torch.Tensor:
    """[3, H, W] float64 of a picture whose sides are already multiples of 32 within the pixel range."""
    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64) / 255.0
    x = torch.from_numpy(rgb).permute(2, 0, 1)
    return (x - torch.tensor(MEAN, dtype=F64)[:, None, None]) / torch.tensor(STD, dtype=F64)[:, None, None]


def reference_picture_tokens(ckpt, data: bytes) -> torch.Tensor:
    """The understanding tower's picture embedding of one such picture, float64 [rows * cols, D]."""
    return picture_tokens(as_model(ckpt), reference_pixels(data), "vision_model.embeddings.")
