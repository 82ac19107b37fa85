"""Shifted timesteps and initial noise scale, against closed forms."""

import dataclasses
import math

import pytest

from neopp.model.checkpoint_config import CheckpointConfig
from neopp.sampling.schedule import initial_noise_scale, shifted_timesteps

BASE = CheckpointConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                   rope_theta=10000.0, rope_theta_hw=10000.0, vision_hidden_size=16,
                   rope_theta_vision=10000.0, max_position_embeddings_vision=64)


def closed_form(k, n, s):
    # t' = 1 - s*sigma/(1+(s-1)*sigma) with sigma = 1 - k/n, simplified to (1-sigma)/(1+(s-1)*sigma)
    sigma = 1.0 - k / n
    return (1.0 - sigma) / (1.0 + (s - 1.0) * sigma)


@pytest.mark.parametrize("steps", [1, 3, 8, 50])
@pytest.mark.parametrize("shift", [1.0, 0.5, 3.0, 7.5])
def test_shifted_timesteps(steps, shift):
    ts = shifted_timesteps(steps, shift)
    assert len(ts) == steps + 1
    for k, t in enumerate(ts):
        assert t == pytest.approx(closed_form(k, steps, shift), abs=1e-12)
    assert ts[0] == pytest.approx(0.0, abs=1e-12) and ts[-1] == pytest.approx(1.0, abs=1e-12)
    assert all(b > a for a, b in zip(ts, ts[1:]))


def test_shift_values_by_hand():
    assert shifted_timesteps(4, 1.0) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    # shift 3, 2 steps: sigma 0.5 -> 1.5/2 = 0.75 -> t' = 0.25 (more time spent near noise)
    assert shifted_timesteps(2, 3.0) == pytest.approx([0.0, 0.25, 1.0])
    # shift 3, 4 steps: sigma .75 -> 2.25/2.5=.9 ; .5 -> .75 ; .25 -> .75/1.5=.5
    assert shifted_timesteps(4, 3.0) == pytest.approx([0.0, 0.1, 0.25, 0.5, 1.0])


def cfg(**kw):
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize("init,tokens,base,cap,want", [
    (1.0, 64, 64, 8.0, 1.0),
    (1.0, 16, 64, 8.0, 0.5),
    (1.0, 1024, 64, 8.0, 4.0),          # 1024x1024 image
    (1.0, 4096, 64, 8.0, 8.0),          # exactly the cap
    (1.0, 16384, 64, 8.0, 8.0),         # 16 capped to 8
    (2.0, 256, 64, 8.0, 4.0),
    (2.0, 1024, 64, 3.0, 3.0),          # other cap
    (1.0, 1024, 256, 8.0, 2.0),         # other base
    (1.0, 3, 64, 8.0, math.sqrt(3 / 64)),
])
def test_noise_scale_resolution(init, tokens, base, cap, want):
    c = cfg(noise_scale=init, noise_scale_base_image_seq_len=base, noise_scale_max_value=cap)
    assert c.noise_scale_mode == "resolution"  # the default
    assert initial_noise_scale(c, tokens) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("init,tokens,cap,want", [
    (1.0, 1024, 8.0, 2.0),                   # sqrt(1 * sqrt(16))
    (1.0, 16, 8.0, math.sqrt(0.5)),
    (2.0, 256, 8.0, math.sqrt(4.0)),
    (9.0, 64, 8.0, 3.0),
    (100.0, 4096, 8.0, 8.0),                 # sqrt(800) = 28.3 capped
    (4.0, 1024, 3.5, 3.5),                   # sqrt(16) = 4 capped at 3.5
])
def test_noise_scale_dynamic_sqrt(init, tokens, cap, want):
    c = cfg(noise_scale=init, noise_scale_mode="dynamic_sqrt", noise_scale_max_value=cap)
    assert initial_noise_scale(c, tokens) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tokens", [1, 64, 1024, 16384])
def test_noise_scale_constant(tokens):
    # "a constant mode uses noise_scale_init alone": independent of the size (values under the cap)
    c = cfg(noise_scale=1.7, noise_scale_mode="constant")
    assert initial_noise_scale(c, tokens) == pytest.approx(1.7, rel=1e-12)
