"""The noise stream: seeding, continuation, exported state, isolation."""

import numpy as np
import pytest
import torch

from neopp.errors import InputError
from neopp.sampling.rng import STATE_NBYTES, NoiseStream


def _spec_draws(seed, n, H=64, W=32):
    """The rule written out: a CPU generator seeded once, one randn(1,3,H,W) float32 per draw."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return [torch.randn(1, 3, H, W, generator=g, dtype=torch.float32) for _ in range(n)]


def test_seed_gives_the_spec_draw_and_is_reproducible():
    a = NoiseStream(200).draw(64, 32)
    assert a.shape == (1, 3, 64, 32) and a.dtype == torch.float32
    assert torch.equal(a, _spec_draws(200, 1)[0])
    assert torch.equal(a, NoiseStream(200).draw(64, 32))
    assert not torch.allclose(a, NoiseStream(201).draw(64, 32))


def test_draws_continue_the_stream_and_reseed_restarts_it():
    s = NoiseStream(7)
    d = [s.draw(64, 32) for _ in range(3)]
    want = _spec_draws(7, 3)
    for got, exp in zip(d, want):
        assert torch.equal(got, exp)
    assert not torch.allclose(d[0], d[1])
    s.reseed(7)
    assert torch.equal(s.draw(64, 32), want[0])


def test_unseeded_streams_differ():
    assert not torch.allclose(NoiseStream().draw(32, 32), NoiseStream().draw(32, 32))


def test_state_round_trip_bytes_and_array():
    s = NoiseStream(123)
    s.draw(32, 64)
    state = s.state()
    assert isinstance(state, bytes) and len(state) == STATE_NBYTES
    expected_next = _spec_draws(123, 2, 32, 64)[1]
    assert torch.equal(NoiseStream.from_state(state).draw(32, 64), expected_next)
    arr = np.frombuffer(state, dtype=np.uint8)
    assert torch.equal(NoiseStream.from_state(arr).draw(32, 64), expected_next)
    # exporting does not advance the stream
    assert torch.equal(s.draw(32, 64), expected_next)
    # the resumed stream's own state is exported identically
    assert NoiseStream.from_state(state).state() == state


def test_interleaved_streams_do_not_disturb_each_other():
    a, b = NoiseStream(1), NoiseStream(2)
    got_a, got_b = [], []
    for _ in range(3):
        got_a.append(a.draw(32, 32))
        got_b.append(b.draw(64, 32))
    # a third stream resumed from a's state, interleaved too
    c = NoiseStream.from_state(a.state())
    b.draw(32, 32)
    c_next = c.draw(32, 32)
    for got, exp in zip(got_a, _spec_draws(1, 3, 32, 32)):
        assert torch.equal(got, exp)
    for got, exp in zip(got_b, _spec_draws(2, 3, 64, 32)):
        assert torch.equal(got, exp)
    assert torch.equal(c_next, a.draw(32, 32))


@pytest.mark.parametrize("bad", [
    b"",
    b"\x00" * (STATE_NBYTES - 1),
    b"\x00" * (STATE_NBYTES + 1),
    np.zeros(STATE_NBYTES, dtype=np.float32),
    np.zeros(STATE_NBYTES, dtype=np.uint8),  # right size, not a valid mt19937 state
    np.full(STATE_NBYTES, 255, dtype=np.uint8),
])
def test_bad_states_are_rejected_naming_rng_state(bad):
    with pytest.raises(InputError, match="RNG_STATE"):
        NoiseStream.from_state(bad)


@pytest.mark.parametrize("seed", ["12", 1.5, True, 2**64])
def test_bad_seeds_are_rejected_naming_seed(seed):
    with pytest.raises(InputError, match="SEED"):
        NoiseStream(seed)
