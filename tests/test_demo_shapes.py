"""The shapes demo: prompt grammar, the fixed held-out split, the renderer, and the judge that scores
generated images (it must pass rendered scenes and fail noise, flat images and the wrong scene)."""

from __future__ import annotations

import numpy as np
import pytest

from demo.shapes import (
    ANCHORS,
    COLORS,
    POSITIONS,
    SHAPES,
    SIZES,
    Layout,
    Scene,
    all_scenes,
    held_out_scenes,
    judge,
    render,
    sample_batch,
    score,
    train_scenes,
)

# a spread of sizes, with both extreme aspect ratios
JUDGED_SIZES = [(128, 320), (320, 128), (128, 128), (320, 320), (192, 256), (256, 160)]


def test_vocabulary_and_sizes():
    assert len(COLORS) == 8 and len(SHAPES) == 3 and len(POSITIONS) == 5
    assert set(ANCHORS) == set(POSITIONS)
    assert len(SIZES) == 49 and (128, 320) in SIZES and (320, 128) in SIZES
    assert all(h % 32 == 0 and w % 32 == 0 and 128 <= min(h, w) and max(h, w) <= 320 for h, w in SIZES)


def test_every_scene_round_trips_through_its_prompt():
    scenes = all_scenes()
    assert len(scenes) == 840 == len(set(scenes))
    for scene in scenes:
        assert Scene.parse(scene.prompt) == scene
    assert Scene("triangle", "red", "at the top", "blue").prompt == "a red triangle at the top on a blue background"


@pytest.mark.parametrize(
    "prompt, problem",
    [
        ("a pink circle on the left on a blue background", "pink"),
        ("a red hexagon on the left on a blue background", "hexagon"),
        ("a red circle in the middle on a blue background", "in the middle"),
        ("a red circle on the left on a teal background", "teal"),
        ("a red circle on the left on a red background", "both red"),
        ("a red circle on the left", "does not read"),
        ("A red circle on the left on a blue background", "does not read"),
        ("a red circle on the left on a blue background ", "does not read"),
        ("a circle red on the left on a blue background", "circle"),
        ("", "does not read"),
    ],
)
def test_parse_refuses_prompts_outside_the_grammar(prompt, problem):
    with pytest.raises(ValueError, match=problem):
        Scene.parse(prompt)


def test_held_out_split_is_fixed_disjoint_and_leaves_every_value_in_training():
    held, train = held_out_scenes(), train_scenes()
    assert held == held_out_scenes() and train == train_scenes()
    assert len(held) == 200 == len(set(held)) and len(train) == 640
    assert not set(held) & set(train) and set(held) | set(train) == set(all_scenes())
    assert {s.shape for s in train} == set(SHAPES) and {s.position for s in train} == set(POSITIONS)
    assert {s.color for s in train} == set(COLORS) == {s.background for s in train}


def test_render_respects_size_colours_and_position():
    rng = np.random.default_rng(0)
    for (h, w), position in zip(JUDGED_SIZES, POSITIONS):
        scene = Scene("square", "orange", position, "yellow")
        image = render(scene, h, w, rng)
        assert image.shape == (h, w, 3) and image.dtype == np.uint8
        border = np.concatenate([image[:4].reshape(-1, 3), image[-4:].reshape(-1, 3)])
        border = np.concatenate([border, image[:, :4].reshape(-1, 3), image[:, -4:].reshape(-1, 3)])
        assert (border == COLORS["yellow"]).all()
        ys, xs = np.nonzero((image == COLORS["orange"]).all(axis=2))
        colours = {tuple(int(c) for c in px) for px in image.reshape(-1, 3)}
        assert colours == {COLORS["yellow"], COLORS["orange"]}
        side = ys.max() - ys.min() + 1
        assert 0.3 * min(h, w) - 1 <= side <= 0.45 * min(h, w) + 1
        ax, ay = ANCHORS[position]
        assert abs((xs.mean() + 0.5) / w - ax) < 0.06 and abs((ys.mean() + 0.5) / h - ay) < 0.06


def test_render_is_a_function_of_the_generator():
    scene = Scene("circle", "blue", "in the center", "white")
    a = render(scene, 160, 224, np.random.default_rng(5))
    assert np.array_equal(a, render(scene, 160, 224, np.random.default_rng(5)))
    assert not np.array_equal(a, render(scene, 160, 224, np.random.default_rng(6)))


def test_a_fixed_side_without_jitter_gives_one_picture_per_prompt_and_size():
    """The probe's data: the prompt and the image size decide every pixel, and the judge reads it."""
    scenes = held_out_scenes()[:6]
    fixed = Layout(side_range=(0.4, 0.4), jitter=0.0)
    first = [render(s, 192, 256, np.random.default_rng(1), fixed) for s in scenes]
    again = [render(s, 192, 256, np.random.default_rng(2), fixed) for s in scenes]
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert score(np.stack(first), scenes)["overall"] == 1.0
    _, batch = sample_batch(np.random.default_rng(3), 4, 192, 256, scenes=scenes[:1], layout=fixed)
    assert all(np.array_equal(image, first[0]) for image in batch)


def test_sample_batch_draws_from_the_given_scenes():
    rng = np.random.default_rng(1)
    scenes, images = sample_batch(rng, 12, 128, 192)
    assert images.shape == (12, 128, 192, 3) and images.dtype == np.uint8 and len(scenes) == 12
    assert set(scenes) <= set(train_scenes())
    held = held_out_scenes()[:3]
    scenes, images = sample_batch(rng, 30, 160, 160, scenes=held)
    assert set(scenes) <= set(held) and len(set(scenes)) > 1
    assert score(images, scenes)["overall"] == 1.0


def test_judge_reads_rendered_scenes_across_sizes():
    rng = np.random.default_rng(2)
    scenes = all_scenes()
    misses = []
    for k in range(300):
        h, w = JUDGED_SIZES[k % len(JUDGED_SIZES)]
        scene = scenes[int(rng.integers(len(scenes)))]
        verdict = judge(render(scene, h, w, rng), scene)
        if not verdict.ok:
            misses.append((h, w, scene.prompt, verdict))
    assert len(misses) <= 3, misses[:5]


def test_judge_reports_what_it_saw():
    scene = Scene("triangle", "purple", "on the right", "green")
    verdict = judge(render(scene, 128, 320, np.random.default_rng(3)), scene)
    assert verdict.ok
    assert (verdict.background, verdict.color, verdict.shape, verdict.position) == (
        "green",
        "purple",
        "triangle",
        "on the right",
    )


def test_judge_fails_the_wrong_scene():
    rendered = Scene("circle", "red", "on the left", "white")
    image = render(rendered, 192, 192, np.random.default_rng(4))
    verdict = judge(image, Scene("square", "blue", "on the left", "white"))
    assert not verdict.ok and not verdict.color_ok and not verdict.shape_ok
    assert verdict.background_ok and verdict.position_ok
    assert (verdict.color, verdict.shape) == ("red", "circle")
    verdict = judge(image, Scene("circle", "red", "on the right", "black"))
    assert not verdict.position_ok and not verdict.background_ok and verdict.position == "on the left"


def test_judge_fails_noise_and_flat_images():
    """What an untrained generator gives: every scene fails on noise and on a flat image."""
    rng = np.random.default_rng(5)
    scenes = all_scenes()
    asked = [scenes[int(i)] for i in rng.integers(len(scenes), size=40)]
    noise = rng.integers(0, 256, size=(40, 160, 224, 3), dtype=np.uint8)
    soft_noise = np.clip(rng.normal(128, 40, size=(40, 160, 224, 3)), 0, 255).astype(np.uint8)
    for images in (noise, soft_noise):
        result = score(images, asked)
        assert result["overall"] == 0.0 and result["color"] == 0.0 and result["background"] == 0.0
    for scene in asked[:10]:
        flat = np.empty((128, 128, 3), dtype=np.uint8)
        flat[:] = COLORS[scene.background]
        verdict = judge(flat, scene)
        assert verdict.background_ok and not verdict.ok
        assert not (verdict.color_ok or verdict.shape_ok or verdict.position_ok) and verdict.shape is None


def test_score_counts_each_attribute():
    rng = np.random.default_rng(6)
    scenes, images = sample_batch(rng, 8, 128, 128)
    assert score(images, scenes) == {
        "background": 1.0,
        "color": 1.0,
        "position": 1.0,
        "shape": 1.0,
        "overall": 1.0,
        "n": 8.0,
    }
    images[0] = COLORS[scenes[0].background]  # no shape: only the background is right
    images[1] = render(
        Scene(
            "circle" if scenes[1].shape != "circle" else "square",
            scenes[1].color,
            scenes[1].position,
            scenes[1].background,
        ),
        128,
        128,
        rng,
    )
    result = score(list(images), scenes)
    assert result == {"background": 1.0, "color": 7 / 8, "position": 7 / 8, "shape": 6 / 8, "overall": 6 / 8, "n": 8.0}
    with pytest.raises(ValueError):
        score(images, scenes[:3])
