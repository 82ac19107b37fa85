"""Procedural data for the shapes demo (prompt -> image of one coloured shape) and its judge.

A prompt reads "a {color} {shape} {position} on a {color} background". The renderer draws the
training images; the judge reads an image back into the same four attributes, so generated
images can be scored without any learned model. Pure numpy and deterministic.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "orange": (245, 140, 30),
    "purple": (140, 60, 190),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
POSITIONS: tuple[str, ...] = ("on the left", "on the right", "at the top", "at the bottom", "in the center")
SIZES: tuple[tuple[int, int], ...] = tuple((h, w) for h in range(128, 321, 32) for w in range(128, 321, 32))

# Shape centre as (x, y) fractions of (width, height); rendering and judging share them.
ANCHORS: dict[str, tuple[float, float]] = {
    "on the left": (0.25, 0.5),
    "on the right": (0.75, 0.5),
    "at the top": (0.5, 0.25),
    "at the bottom": (0.5, 0.75),
    "in the center": (0.5, 0.5),
}
BORDER = 4  # the frame the judge reads the background from; shapes stay inside it
HELD_OUT_SIZE = 200
_HELD_OUT_SEED = 20240611

_PROMPT = re.compile(r"a (\S+) (\S+) (.+) on a (\S+) background")
_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_NAMES = tuple(COLORS)


@dataclass(frozen=True)
class Layout:
    """How large a shape is drawn and how far its centre strays from the anchor; each image draws
    its own from these ranges."""

    side_range: tuple[float, float] = (0.30, 0.45)  # bounding-box side, a fraction of the shorter image side
    jitter: float = 0.04  # centre jitter, a fraction of the image side along that axis


LAYOUT = Layout()  # the committed demo's


@dataclass(frozen=True)
class Scene:
    """One combination of the grammar; invalid values raise ValueError at construction."""

    shape: str
    color: str
    position: str
    background: str

    def __post_init__(self) -> None:
        for what, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.color, COLORS),
            ("position", self.position, POSITIONS),
            ("background colour", self.background, COLORS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")
        if self.color == self.background:
            raise ValueError(f"the shape and the background are both {self.color}; they must differ")

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} {self.position} on a {self.background} background"

    @classmethod
    def parse(cls, prompt: str) -> Scene:
        """The scene a prompt names; ValueError says which part is outside the grammar."""
        m = _PROMPT.fullmatch(prompt)
        if m is None:
            raise ValueError(
                f"prompt {prompt!r} does not read 'a <colour> <shape> <position> on a <colour> background'"
            )
        return cls(shape=m[2], color=m[1], position=m[3], background=m[4])


def all_scenes() -> list[Scene]:
    """Every combination, in a fixed order: 8 colours x 3 shapes x 5 positions x 7 backgrounds."""
    return [
        Scene(shape, color, position, background)
        for color in COLORS
        for shape in SHAPES
        for position in POSITIONS
        for background in COLORS
        if background != color
    ]


@cache
def _held_out_indices() -> frozenset[int]:
    """A fixed-seed draw, redrawn (deterministically) until training still shows every value."""
    scenes = all_scenes()
    rng = np.random.default_rng(_HELD_OUT_SEED)
    while True:
        held = frozenset(int(i) for i in rng.permutation(len(scenes))[:HELD_OUT_SIZE])
        train = [s for i, s in enumerate(scenes) if i not in held]
        if _covers_every_value(train):
            return held


def _covers_every_value(scenes: Sequence[Scene]) -> bool:
    return (
        {s.shape for s in scenes} == set(SHAPES)
        and {s.color for s in scenes} == set(COLORS)
        and {s.position for s in scenes} == set(POSITIONS)
        and {s.background for s in scenes} == set(COLORS)
    )


def held_out_scenes() -> list[Scene]:
    """The 200 combinations kept out of training, to test composition of seen attribute values."""
    held = _held_out_indices()
    return [s for i, s in enumerate(all_scenes()) if i in held]


def train_scenes() -> list[Scene]:
    return list(_train_pool())


@cache
def _train_pool() -> tuple[Scene, ...]:
    held = _held_out_indices()
    return tuple(s for i, s in enumerate(all_scenes()) if i not in held)


# ---------------------------------------------------------------- rendering


def _shape_mask(shape: str, height: int, width: int, cx: float, cy: float, side: float) -> np.ndarray:
    """Pixels whose centre lies inside the shape: a hard edge, no antialiasing."""
    y = np.arange(height, dtype=np.float32)[:, None] + 0.5 - cy
    x = np.arange(width, dtype=np.float32)[None, :] + 0.5 - cx
    r = side / 2
    if shape == "circle":
        return x * x + y * y <= r * r
    if shape == "square":
        return (np.abs(x) <= r) & (np.abs(y) <= r)
    # upright triangle: apex at the top middle, base along the bottom; half-width grows linearly
    return (y >= -r) & (y <= r) & (np.abs(x) <= (y + r) / 2)


def _centre(position: str, height: int, width: int, side: float, rng: np.random.Generator,
            jitter: float) -> tuple[float, float]:
    """The anchor plus jitter, clamped so the shape stays clear of the judge's border frame."""
    fx, fy = ANCHORS[position]
    jx, jy = rng.uniform(-jitter, jitter, size=2)
    lo = side / 2 + BORDER
    cx = float(np.clip((fx + jx) * width, lo, width - lo))
    cy = float(np.clip((fy + jy) * height, lo, height - lo))
    return cx, cy


def render(scene: Scene, height: int, width: int, rng: np.random.Generator,
           layout: Layout = LAYOUT) -> np.ndarray:
    """One image of the scene, uint8 [height, width, 3]; size and centre jitter come from rng."""
    if height < 32 or width < 32:
        raise ValueError(f"image {height}x{width} is too small; both sides must be at least 32")
    side = float(rng.uniform(*layout.side_range)) * min(height, width)
    cx, cy = _centre(scene.position, height, width, side, rng, layout.jitter)
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[:] = COLORS[scene.background]
    image[_shape_mask(scene.shape, height, width, cx, cy, side)] = COLORS[scene.color]
    return image


def sample_batch(
    rng: np.random.Generator, n: int, height: int, width: int, scenes: Sequence[Scene] | None = None,
    layout: Layout = LAYOUT,
) -> tuple[list[Scene], np.ndarray]:
    """n scenes drawn uniformly (with replacement) from `scenes` (default: training) and their images."""
    pool = _train_pool() if scenes is None else list(scenes)
    picked = [pool[int(i)] for i in rng.integers(len(pool), size=n)]
    images = np.empty((n, height, width, 3), dtype=np.uint8)
    for k, scene in enumerate(picked):
        images[k] = render(scene, height, width, rng, layout)
    return picked, images


# ---------------------------------------------------------------- judging

# RGB distance: above it a pixel is never background; also how far a read colour may sit from its
# palette name, and from the median of its region for a pixel to count towards a solid fill.
MAX_THRESHOLD = 60.0
UNIFORM_FRACTION = 0.75  # share of a region that must sit near its median colour for a solid fill
# Shape pixels needed, as a fraction of the shorter side squared (the smallest triangle is 0.045 of
# it); a fraction of the whole image would reject small triangles at 128x320.
MIN_SHAPE_AREA = 0.02
# Bounding-box fill ratio: rendered triangles read ~0.58-0.62, circles ~0.79-0.84, squares 1.0
# (the percentile box and the opening lift the first two above 1/2 and pi/4); cut half-way.
SQUARE_FILL = 0.92  # above: square
TRIANGLE_FILL = 0.70  # below: triangle; between the two: circle


@dataclass(frozen=True)
class Verdict:
    """What the judge saw, and whether each attribute matches the scene asked for.

    The read-outs are the nearest palette names; shape and position are None when no shape was
    found. A colour check also fails when its region is not one solid colour (noise, smears).
    """

    background_ok: bool
    color_ok: bool
    position_ok: bool
    shape_ok: bool
    background: str
    color: str | None
    position: str | None
    shape: str | None
    fill_ratio: float | None = None

    @property
    def ok(self) -> bool:
        return self.background_ok and self.color_ok and self.position_ok and self.shape_ok


def _nearest(rgb: np.ndarray) -> tuple[str, float]:
    d = np.linalg.norm(_PALETTE - rgb, axis=1)
    return _NAMES[int(d.argmin())], float(d.min())


def _read_color(pixels: np.ndarray) -> tuple[str, np.ndarray, bool]:
    """Nearest palette name of the median, its RGB, and whether the region is a near-solid fill of it."""
    median = np.median(pixels, axis=0)
    name, dist = _nearest(median)
    near = np.linalg.norm(pixels - median, axis=1) <= MAX_THRESHOLD
    return name, median, dist <= MAX_THRESHOLD and float(near.mean()) >= UNIFORM_FRACTION


def _threshold(background: str) -> float:
    """Half-way to the palette colour nearest the background, so e.g. orange on yellow still separates."""
    d = np.linalg.norm(_PALETTE - np.array(COLORS[background], dtype=np.float32), axis=1)
    return min(MAX_THRESHOLD, float(np.sort(d)[1]) / 2)


def _open(mask: np.ndarray) -> np.ndarray:
    """3x3 erosion then dilation: drops specks and one-pixel threads, keeps solid shapes."""
    h, w = mask.shape
    p = np.pad(mask, 1)
    eroded = np.ones_like(mask)
    for dy in range(3):
        for dx in range(3):
            eroded &= p[dy : dy + h, dx : dx + w]
    p = np.pad(eroded, 1)
    out = np.zeros_like(mask)
    for dy in range(3):
        for dx in range(3):
            out |= p[dy : dy + h, dx : dx + w]
    return out


def _box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Bounding box (y0, y1, x0, x1; inclusive) of the mask's 0.5th-99.5th coordinate percentiles."""
    ys, xs = np.nonzero(mask)
    y0, y1 = np.percentile(ys, [0.5, 99.5]).round().astype(int)
    x0, x1 = np.percentile(xs, [0.5, 99.5]).round().astype(int)
    return int(y0), int(y1), int(x0), int(x1)


def _read_shape(mask: np.ndarray) -> tuple[str, str, float]:
    """Position (nearest anchor to the box centre) and shape (from the box's fill ratio)."""
    h, w = mask.shape
    y0, y1, x0, x1 = _box(mask)
    cx, cy = (x0 + x1 + 1) / 2 / w, (y0 + y1 + 1) / 2 / h
    position = min(ANCHORS, key=lambda p: (ANCHORS[p][0] - cx) ** 2 + (ANCHORS[p][1] - cy) ** 2)
    fill = float(mask[y0 : y1 + 1, x0 : x1 + 1].mean())
    shape = "square" if fill > SQUARE_FILL else "circle" if fill >= TRIANGLE_FILL else "triangle"
    return position, shape, fill


def judge(image: np.ndarray, scene: Scene) -> Verdict:
    """Read an RGB image ([H, W, 3], values 0-255) back into the grammar and compare with `scene`."""
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] image, got shape {image.shape}")
    h, w = image.shape[:2]
    pixels = image.astype(np.float32)
    frame = np.ones((h, w), dtype=bool)
    frame[BORDER:-BORDER, BORDER:-BORDER] = False
    background, bg_rgb, bg_solid = _read_color(pixels[frame])
    far = np.linalg.norm(pixels - bg_rgb, axis=2) > _threshold(background)
    mask = _open(far)
    background_ok = bg_solid and background == scene.background
    if mask.sum() < MIN_SHAPE_AREA * min(h, w) ** 2:
        return Verdict(background_ok, False, False, False, background, None, None, None)
    color, _, solid = _read_color(pixels[mask])
    position, shape, fill = _read_shape(mask)
    return Verdict(
        background_ok=background_ok,
        color_ok=solid and color == scene.color,
        position_ok=position == scene.position,
        shape_ok=shape == scene.shape,
        background=background,
        color=color,
        position=position,
        shape=shape,
        fill_ratio=fill,
    )


def score(images: np.ndarray | Sequence[np.ndarray], scenes: Sequence[Scene]) -> dict[str, float]:
    """Accuracy per attribute and overall (all four right) of images judged against their scenes."""
    if len(images) != len(scenes):
        raise ValueError(f"{len(images)} images for {len(scenes)} scenes")
    if not scenes:
        raise ValueError("nothing to score")
    verdicts = [judge(np.asarray(img), s) for img, s in zip(images, scenes)]
    n = len(verdicts)
    return {
        "background": sum(v.background_ok for v in verdicts) / n,
        "color": sum(v.color_ok for v in verdicts) / n,
        "position": sum(v.position_ok for v in verdicts) / n,
        "shape": sum(v.shape_ok for v in verdicts) / n,
        "overall": sum(v.ok for v in verdicts) / n,
        "n": float(n),
    }
