"""Seeded malformed requests for a generation model: every input of the contract, broken.

``generate_cases(n, seed, kv_dims, limits)`` gives ``n`` requests, each a complete input set
(``{name: (array, Triton datatype)}``) with exactly one fault, and the input names one of
which the server's error message must contain. The same seed gives the same requests, so a
failure can be replayed. Requests stay tiny (a few KB), except the over-limit prefixes.
Only numpy here: the client side (tritonclient) is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from neopp.errors import InputError
from neopp.limits import Limits
from neopp.sampling.rng import STATE_NBYTES, NoiseStream

Inputs = dict[str, tuple[np.ndarray, str]]
I64, I32, F32, U8 = np.int64, np.int32, np.float32, np.uint8
_VALID_WORDS = {b"t2i", b"i2i", b"global", b"channel", b"none", b"jpeg", b"jpg", b"png", b"webp"}
_TYPES = {np.dtype(I64): "INT64", np.dtype(I32): "INT32", np.dtype(F32): "FP32", np.dtype(U8): "UINT8",
          np.dtype(np.float64): "FP64", np.dtype(np.object_): "BYTES"}


@dataclass(frozen=True)
class FuzzCase:
    """One malformed request; the error message must name one of ``names``."""

    label: str
    inputs: Inputs
    names: tuple[str, ...]


def tensor(arr: np.ndarray, datatype: str | None = None) -> tuple[np.ndarray, str]:
    return arr, datatype or _TYPES[arr.dtype]


def text(value: bytes | str) -> tuple[np.ndarray, str]:
    return np.array([value if isinstance(value, bytes) else value.encode()], np.object_), "BYTES"


class _Fuzzer:
    """Builds a valid base request per case and breaks one thing in it."""

    def __init__(self, rng: np.random.Generator, kv_dims: tuple[int, int, int], limits: Limits) -> None:
        self.rng, self.dims, self.lim = rng, kv_dims, limits

    # ---- valid pieces
    def kv(self, seq: int | None = None, shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, str]:
        layers, heads, hd = self.dims
        if seq is None:  # never NKV tokens: a transposed (replay) tensor must not fit by chance
            seq = int(self.rng.choice([s for s in range(1, 13) if s != heads]))
        shape = shape or (layers, 2, seq, heads, hd)
        return self.rng.standard_normal(shape).astype(F32), "BF16"

    def base(self) -> Inputs:
        return {
            "COND_KV": self.kv(), "UNCOND_KV": self.kv(),
            "INDEX_OFFSET_COND": tensor(np.array([self.rng.integers(0, 100)], I64)),
            "INDEX_OFFSET_UNCOND": tensor(np.array([self.rng.integers(0, 100)], I64)),
            "SIZE": tensor(np.array([32, 32], I64)), "STEPS": tensor(np.array([2], I64)),
            "OUTPUT_FORMAT": text(b"png"), "SEED": tensor(np.array([self.rng.integers(0, 2**31)], I64)),
        }

    def pick(self, values: list):
        return values[int(self.rng.integers(len(values)))]

    def junk_word(self) -> bytes:
        return bytes(self.rng.integers(97, 123, int(self.rng.integers(1, 12))).astype(U8))

    def non_utf8(self) -> bytes:
        return self.pick([b"\xff\xfe", b"png\xc3", b"\x80abc", b"t2i\xed\xa0\x80"])

    def bad_rng_content(self) -> np.ndarray:
        while True:  # random bytes are almost never a valid mt19937 state; make sure
            arr = self.pick([np.zeros(STATE_NBYTES, U8), np.full(STATE_NBYTES, 255, U8),
                             self.rng.integers(0, 256, STATE_NBYTES).astype(U8)])
            try:
                NoiseStream.from_state(arr)
            except InputError:
                return arr

    # ---- faults: each returns (label, overrides, names); None drops an input
    def f_missing(self):
        name = self.pick(["COND_KV", "INDEX_OFFSET_COND"])
        return f"missing-{name}", {name: None}, (name,)

    def f_kv_rank(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        rank = self.pick([1, 2, 3, 4, 6])
        shape = tuple(int(v) for v in self.rng.integers(1, 5, rank))
        return f"kv-rank{rank}", {name: self.kv(shape=shape)}, (name,)

    def f_kv_geometry(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        layers, heads, hd = self.dims
        shape = [layers, 2, 5, heads, hd]
        axis = self.pick([0, 1, 3, 4])
        wrong = max(1, shape[axis] + self.pick([-1, 1, 3]))
        shape[axis] = wrong if wrong != shape[axis] else wrong + 1
        return f"kv-axis{axis}", {name: self.kv(shape=tuple(shape))}, (name,)

    def f_kv_replay_layout(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        arr, dt = self.kv()
        return "kv-replay-layout", {name: (np.ascontiguousarray(arr.transpose(0, 1, 3, 2, 4)), dt)}, (name,)

    def f_kv_empty(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        return "kv-zero-tokens", {name: self.kv(seq=0)}, (name,)

    def f_kv_over_limit(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        layers, heads, hd = self.dims
        arr = np.full((layers, 2, self.lim.max_prefix_tokens + 1, heads, hd), 0.5, F32)
        return "kv-over-limit", {name: (arr, "BF16")}, (name,)

    def f_kv_nonfinite(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        arr, dt = self.kv()
        idx = tuple(int(self.rng.integers(s)) for s in arr.shape)
        arr[idx] = self.pick([np.nan, np.inf, -np.inf])
        return "kv-nan-inf", {name: (arr, dt)}, (name,)

    def f_kv_dtype(self):
        name = self.pick(["COND_KV", "UNCOND_KV"])
        arr, _ = self.kv()
        return "kv-dtype", {name: self.pick([(arr, "FP32"), (arr.astype(np.float16), "FP16")])}, (name,)

    def f_offset_range(self):
        name = self.pick(["INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND"])
        value = self.pick([-1, -int(self.rng.integers(2, 2**62)), self.lim.max_index_offset + 1,
                           int(self.rng.integers(self.lim.max_index_offset + 1, 2**62)), 2**63 - 1, -(2**63)])
        return "offset-range", {name: tensor(np.array([value], I64))}, (name,)

    def f_offset_form(self):
        name = self.pick(["INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND", "SEED", "STEPS"])
        bad = self.pick([np.array([1, 2], I64), np.array([[1]], I64), np.array([1], I32), np.array([1.0], F32)])
        return "scalar-form", {name: tensor(bad)}, (name,)

    def f_size(self):
        name = self.pick(["SIZE", "RESIZE"])
        h, w = self.pick([(0, 32), (32, 0), (-32, 64), (64, -1), (33, 64), (64, 100), (2**40, 32),
                          (self.lim.max_side + 32, 32), (2**62, 2**62), (-(2**63), 32)])
        if name == "SIZE" and self.rng.integers(2):
            h, w = 32 * int(self.rng.integers(1, 64)) + int(self.rng.integers(1, 32)), 32
        if name == "RESIZE" and h > 0 and w > 0 and max(h, w) <= self.lim.max_side:
            h = self.lim.max_side + 1  # any positive RESIZE within the limit is valid
        return "size", {name: tensor(np.array([h, w], I64))}, (name,)

    def f_size_form(self):
        name = self.pick(["SIZE", "RESIZE", "CFG_INTERVAL"])
        bad = self.pick([np.array([64], I64), np.array([64, 64, 64], I64), np.array([[64, 64]], I64),
                         np.array([64, 64], I32), np.array([64, 64], np.float64)])
        return "pair-form", {name: tensor(bad)}, (name,)

    def f_steps(self):
        value = self.pick([0, -1, self.lim.max_steps + 1, int(self.rng.integers(self.lim.max_steps + 1, 2**62)),
                           -(2**63)])
        return "steps", {"STEPS": tensor(np.array([value], I64))}, ("STEPS",)

    def f_strings(self):
        name = self.pick(["TASK", "CFG_NORM", "OUTPUT_FORMAT"])
        value = self.pick([self.junk_word(), b"", self.non_utf8(), b"png" * 50, b"t2i\x00"])
        if value == b"png" * 50:
            value = b"x" * int(self.rng.integers(100, 4000))
        if value.lower() in _VALID_WORDS:  # a random word may happen to be a valid one
            value += b"x"
        return "string-value", {name: text(value)}, (name,)

    def f_string_form(self):
        name = self.pick(["TASK", "CFG_NORM", "OUTPUT_FORMAT"])
        bad = self.pick([(np.array([b"png", b"png"], np.object_), "BYTES"), tensor(np.array([1], I64)),
                         (np.array([[b"t2i"]], np.object_), "BYTES")])
        return "string-form", {name: bad}, (name,)

    def f_floats(self):
        name = self.pick(["CFG_SCALE", "TIMESTEP_SHIFT", "IMAGE_GUIDANCE_SCALE"])
        bad = [np.nan, np.inf, -np.inf]
        if name == "TIMESTEP_SHIFT":
            bad += [0.0, -float(self.rng.uniform(0, 100))]
        if name == "IMAGE_GUIDANCE_SCALE":
            bad += [0.0, 2.0, float(self.rng.uniform(-10, 0.99)), float(self.rng.uniform(1.01, 10))]
        return "float-value", {name: tensor(np.array([self.pick(bad)], F32))}, (name,)

    def f_float_form(self):
        name = self.pick(["CFG_SCALE", "TIMESTEP_SHIFT", "IMAGE_GUIDANCE_SCALE"])
        bad = self.pick([np.array([1.0, 1.0], F32), np.array([1], I64), np.array([1.0], np.float64)])
        return "float-form", {name: tensor(bad)}, (name,)

    def f_interval(self):
        lo = float(self.rng.uniform(0, 1))
        value = self.pick([[lo + 0.5, lo], [np.nan, 1.0], [0.0, np.inf], [-np.inf, 1.0]])
        return "cfg-interval", {"CFG_INTERVAL": tensor(np.array(value, F32))}, ("CFG_INTERVAL",)

    def f_uncond_pairs(self):
        kind = self.pick(["kv-without-offset", "offset-without-kv", "guidance-without-uncond"])
        if kind == "kv-without-offset":
            return kind, {"INDEX_OFFSET_UNCOND": None}, ("INDEX_OFFSET_UNCOND",)
        if kind == "offset-without-kv":
            return kind, {"UNCOND_KV": None}, ("UNCOND_KV",)
        scale = float(self.rng.uniform(1.01, 20))
        return kind, {"UNCOND_KV": None, "INDEX_OFFSET_UNCOND": None,
                      "CFG_SCALE": tensor(np.array([scale], F32))}, ("UNCOND_KV",)

    def f_rng_state(self):
        kind = self.pick(["length", "content", "dtype", "with-seed"])
        if kind == "length":
            n = self.pick([0, 1, STATE_NBYTES - 1, STATE_NBYTES + 1, int(self.rng.integers(2, 3 * STATE_NBYTES))])
            n = n if n != STATE_NBYTES else n + 1
            return "rng-length", {"SEED": None, "RNG_STATE": tensor(self.rng.integers(0, 256, n).astype(U8))}, \
                ("RNG_STATE",)
        if kind == "content":
            return "rng-content", {"SEED": None, "RNG_STATE": tensor(self.bad_rng_content())}, ("RNG_STATE",)
        if kind == "dtype":
            return "rng-dtype", {"SEED": None, "RNG_STATE": tensor(np.zeros(STATE_NBYTES, I64))}, ("RNG_STATE",)
        return "rng-with-seed", {"RNG_STATE": tensor(self.bad_rng_content())}, ("SEED", "RNG_STATE")

    def f_unknown_input(self):
        name = self.pick(["FOO", "cond_kv", "PROMPT", "MODEL", "COND_KV2"]) + str(int(self.rng.integers(10)))
        return "unknown-input", {name: tensor(np.array([1], I64))}, (name,)

    def faults(self) -> list[Callable[[], tuple[str, dict, tuple[str, ...]]]]:
        return [getattr(self, n) for n in sorted(dir(self)) if n.startswith("f_")]


def generate_cases(n: int, seed: int, kv_dims: tuple[int, int, int], limits: Limits | None = None,
                   over_limit_every: int = 100) -> Iterator[FuzzCase]:
    """``n`` malformed requests, built one at a time; the fault kinds take turns, details are random.

    Over-limit prefixes are large (``max_prefix_tokens + 1`` tokens), so only one case in
    ``over_limit_every`` is one.
    """
    rng = np.random.default_rng(seed)
    fuzzer = _Fuzzer(rng, kv_dims, limits or Limits())
    kinds = [f for f in fuzzer.faults() if f.__name__ != "f_kv_over_limit"]
    for i in range(n):
        fault = fuzzer.f_kv_over_limit if i % over_limit_every == over_limit_every - 1 else kinds[i % len(kinds)]
        label, overrides, names = fault()
        inputs = fuzzer.base()
        for name, value in overrides.items():
            if value is None:
                inputs.pop(name, None)
            else:
                inputs[name] = value
        yield FuzzCase(f"{i}:{label}", inputs, names)
