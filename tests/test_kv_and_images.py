"""KV prefix layouts and files (online and replay), their validation, and image encoding."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from neopp.errors import InputError
from neopp.image_io import encode_image
from neopp.model.kv_cache import load_kv_file, online_to_replay, replay_to_online, save_kv_file, validate_kv

DIMS = (3, 2, 16)  # layers, kv heads, head dim


def online(seq=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(DIMS[0], 2, seq, DIMS[1], DIMS[2], generator=g).to(dtype)


def test_layout_round_trip_tensor_ops():
    kv = online(seq=7)
    rep = online_to_replay(kv)
    assert rep.shape == (3, 2, 2, 7, 16)
    # element [l, kv, s, h, d] of online is [l, kv, h, s, d] of replay
    assert rep[2, 1, 1, 4, 9] == kv[2, 1, 4, 1, 9]
    assert torch.equal(rep, kv.transpose(2, 3))
    back = replay_to_online(rep)
    assert back.shape == kv.shape and torch.equal(back, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_file_round_trips(tmp_path, dtype):
    kv = online(seq=6, dtype=dtype)
    # exactly how LightLLM writes replay files
    torch.save(kv.transpose(2, 3).cpu(), tmp_path / "a.pt")
    got = load_kv_file(tmp_path / "a.pt")
    assert got.dtype == dtype and torch.equal(got, kv)
    # safetensors without metadata: replay layout
    save_file({"kv": kv.transpose(2, 3).contiguous()}, str(tmp_path / "b.safetensors"))
    assert torch.equal(load_kv_file(tmp_path / "b.safetensors"), kv)
    # safetensors holding the online tensor, told by the caller or by metadata
    save_file({"kv": kv.contiguous()}, str(tmp_path / "c.safetensors"))
    assert torch.equal(load_kv_file(tmp_path / "c.safetensors", layout="online"), kv)
    save_file({"kv": kv.contiguous()}, str(tmp_path / "d.safetensors"), metadata={"layout": "online"})
    assert torch.equal(load_kv_file(tmp_path / "d.safetensors"), kv)
    # the package's writer, online -> file -> online, each layout
    for name, layout in (("e.pt", "replay"), ("f.safetensors", "replay"), ("g.safetensors", "online")):
        path = save_kv_file(kv, tmp_path / name, layout=layout)
        assert torch.equal(load_kv_file(path), kv), name
    # a .pt written by save_kv_file is a plain replay tensor
    assert torch.equal(torch.load(tmp_path / "e.pt", weights_only=True), kv.transpose(2, 3))


def test_sample_kv_files_of_tiny_checkpoint_agree(tmp_path):
    from neopp.model.checkpoint_config import CheckpointConfig
    from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", variant="dense", seed=0)
    config = CheckpointConfig.from_checkpoint(ckpt)
    paths = write_sample_kv(tmp_path / "kv", "dense")
    loaded = {key: load_kv_file(p) for key, p in paths.items()}
    assert loaded, paths
    for key, kv in loaded.items():
        validate_kv(kv, config.kv_dims, key)
    for branch in ("cond", "uncond"):
        same = [kv for key, kv in loaded.items()
                if branch in str(key) and ("uncond" in str(key)) == (branch == "uncond")]
        assert len(same) >= 2, paths
        for kv in same[1:]:
            assert torch.equal(kv, same[0])


def test_valid_prefix_passes():
    assert validate_kv(online(seq=1), DIMS, "COND_KV") is None
    assert validate_kv(online(seq=9, dtype=torch.bfloat16), DIMS, "COND_KV", max_tokens=9) is None


def _nan():
    kv = online()
    kv[1, 0, 2, 1, 3] = float("nan")
    return kv


def _inf():
    kv = online()
    kv[0, 1, 4, 0, 0] = float("-inf")
    return kv


@pytest.mark.parametrize("kv,rule", [
    (online()[0], "5-D"),                                  # wrong rank
    (torch.zeros(1, 2, 3, 4, 5, 6), "5-D"),
    (torch.zeros(4, 2, 5, 2, 16), "layers"),
    (torch.zeros(3, 2, 5, 1, 16), "kv_heads"),
    (torch.zeros(3, 2, 5, 2, 8), "head_dim"),
    (torch.zeros(3, 3, 5, 2, 16), "dim 1"),
    (torch.zeros(3, 1, 5, 2, 16), "dim 1"),
    (torch.zeros(3, 2, 0, 2, 16), "seq"),
    (torch.zeros(3, 2, 11, 2, 16), "limit"),               # max_tokens = 10
    (_nan(), "NaN"),
    (_inf(), "Inf"),
])
@pytest.mark.parametrize("name", ["COND_KV", "UNCOND_KV"])
def test_validation_errors_name_the_tensor(kv, rule, name):
    with pytest.raises(InputError) as err:
        validate_kv(kv, DIMS, name, max_tokens=10)
    assert name in str(err.value) and rule in str(err.value)


def _pixels(h=64, w=96):
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("fmt,pil", [("jpeg", "JPEG"), ("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")])
@pytest.mark.parametrize("resize", [None, (50, 70), (128, 32)])
def test_encode_formats_and_sizes(fmt, pil, resize):
    px = _pixels()
    data = encode_image(px, fmt, resize=resize)
    img = Image.open(io.BytesIO(data))
    assert img.format == pil
    want_h, want_w = resize or px.shape[:2]
    assert img.size == (want_w, want_h)
    assert img.mode == "RGB"
    if fmt == "png":
        ref = Image.fromarray(px)
        if resize is not None:
            ref = ref.resize((want_w, want_h), Image.Resampling.LANCZOS)
        assert np.array_equal(np.asarray(img), np.asarray(ref))


def test_default_format_is_jpeg():
    assert Image.open(io.BytesIO(encode_image(_pixels()))).format == "JPEG"


@pytest.mark.parametrize("fmt", ["bmp", "gif", "", "tiff"])
def test_unknown_format_is_an_input_error(fmt):
    with pytest.raises(InputError, match="output_format"):
        encode_image(_pixels(), fmt)
