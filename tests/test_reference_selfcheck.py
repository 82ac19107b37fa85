"""The float64 reference's building blocks against torch's own primitives.

The reference is written with explicit loops; this checks those loops (patch
cuts, pixel shuffle, 3x3 conv, 2x2 dense conv, softmax, schedule) against
independent torch implementations, so a bug in the reference cannot silently
agree with a bug in the runner.  No runner code is involved here.
"""

import math

import torch
import torch.nn.functional as F

from tests.reference import neopp_reference as ref

F64 = torch.float64


def test_cut_matches_conv_patch_order_and_inverse():
    g = torch.Generator().manual_seed(1)
    img = torch.randn(3, 64, 96, generator=g, dtype=F64)
    w = torch.randn(5, 3, 16, 16, generator=g, dtype=F64)
    # conv with kernel = stride = 16, flattened row-major == cut (c,p,q) @ w.flatten
    conv = F.conv2d(img[None], w, stride=16)[0]  # [5, 4, 6]
    mine = ref.cut(img, 16, channel_last=False) @ w.reshape(5, -1).T
    torch.testing.assert_close(mine, conv.reshape(5, -1).T, rtol=0, atol=1e-12)
    z = ref.cut(img, 32, channel_last=True)
    assert z.shape == (6, 32 * 32 * 3)
    # token (r=1, c=2), pixel (p=3, q=5), channel 2
    assert z[1 * 3 + 2, (3 * 32 + 5) * 3 + 2] == img[2, 32 + 3, 64 + 5]
    torch.testing.assert_close(ref.uncut_channel_last(z, 64, 96, 32), img, rtol=0, atol=0)


def test_pixel_shuffle_and_conv3x3_match_torch():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4 * 64, 2, 3, generator=g, dtype=F64)
    for r in (2, 8):
        torch.testing.assert_close(ref.pixel_shuffle(x, r), F.pixel_shuffle(x[None], r)[0], rtol=0, atol=0)
    y = torch.randn(6, 5, 7, generator=g, dtype=F64)
    w = torch.randn(4, 6, 3, 3, generator=g, dtype=F64)
    b = torch.randn(4, generator=g, dtype=F64)
    torch.testing.assert_close(ref.conv3x3(y, w, b), F.conv2d(y[None], w, b, padding=1)[0], rtol=1e-12, atol=1e-12)


def test_small_functions():
    x = torch.tensor([[1.0, -2.0, 3.0]], dtype=F64)
    torch.testing.assert_close(ref.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(ref.gelu(x), F.gelu(x))
    torch.testing.assert_close(ref.silu(x), F.silu(x))
    w = torch.tensor([1.0, 2.0, 0.5], dtype=F64)
    torch.testing.assert_close(ref.rmsnorm(x, w, 1e-6), x / math.sqrt(14 / 3 + 1e-6) * w)
    torch.testing.assert_close(ref.rmsnorm(x, w, 0.5), x / math.sqrt(14 / 3 + 0.5) * w)
    # rotation of a pair by 90 degrees: (a, b) -> (-b, a)
    v = torch.tensor([[[1.0, 0.0, 2.0, 5.0]]], dtype=F64)
    out = v.clone()
    ref.rotate_pair(out, v, 2, 3, torch.tensor([math.pi / 2], dtype=F64))
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0, -5.0, 2.0]]], dtype=F64))
    ts = ref.shifted_timesteps(4, 3.0)
    assert ts[0] == 0.0 and ts[-1] == 1.0
    assert math.isclose(ts[2], 1 - 1.5 / 2.0)  # sigma 0.5 -> 3*0.5/(1+2*0.5) = 0.75
