"""A model offers the adapters its engine would take, judged from headers: the folder's files
that fit its linears, within its memory bound, not merged at load; a file changed, added or
removed is judged again on the next look. Each verdict is held against the engine's own: an
offered adapter loads, a withheld one is refused."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from neopp.errors import ConfigError, InputError
from neopp.model.adapter_store import AdapterDirectory, AdapterStore
from neopp.model.adapters import build_adapter, is_adapter_target, tower_linears
from neopp.model.checkpoint import stored_shapes
from neopp.modes import ModeSpec
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.serving.adapter_offer import adapter_offer
from testing.tiny_checkpoint import write_tiny_checkpoint
from testing.tiny_lora import write_adapter

F32 = 4


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    root = tmp_path_factory.mktemp("offer")
    out = {}
    for version in ("dense", "moe"):
        ckpt = write_tiny_checkpoint(root / version, version, seed=3)
        pipe = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(name=version, version=version), device="cpu",
                                             dtype=torch.float32)
        out[version] = ckpt, tower_linears(pipe.transformer)
    return out


def weights_of(linears):
    return {k: lin.weight for k, lin in linears.items()}


def attention(linears):
    return sorted(k for k in linears if "self_attn." in k)


def mlp(linears):
    return sorted(k for k in linears if ".mlp_mot_gen." in k)


@pytest.mark.parametrize("version", ["dense", "moe"])
def test_the_target_pattern_names_exactly_the_tower_s_linears(towers, version):
    ckpt, linears = towers[version]
    assert set(stored_shapes(ckpt, is_adapter_target)) == set(linears)
    assert not is_adapter_target("language_model.model.layers.0.self_attn.q_proj.weight")  # the understanding tower's


def engine_takes(linears, folder, name, max_bytes=1 << 30):
    """The engine's own verdict: the store's load, as a request naming ``name`` runs it."""
    store = AdapterStore(AdapterDirectory(folder), lambda n, p, r, b: build_adapter(
        n, p, linears, torch.device("cpu"), torch.float32, r, b), max_bytes)
    try:
        store.get(name)
    except InputError:
        return False
    return True


def test_the_offer_holds_what_the_engine_takes_and_nothing_else(towers, tmp_path):
    dense_ckpt, dense = towers["dense"]
    _, moe = towers["moe"]
    weights = weights_of(dense)
    write_adapter(tmp_path, "attn", weights, attention(dense))
    write_adapter(tmp_path, "dense_mlp", weights, attention(dense) + mlp(dense))
    write_adapter(tmp_path, "experts", weights_of(moe), mlp(moe))
    wide = {k: torch.zeros(w.shape[0], w.shape[1] + 1) for k, w in weights.items()}
    write_adapter(tmp_path, "other_checkpoint", wide, attention(dense))
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    merged = write_adapter(tmp_path, "merged_at_load", weights, attention(dense), seed=5)
    write_adapter(tmp_path, "bad_sidecar", weights, attention(dense))
    (tmp_path / "bad_sidecar.json").write_text('{"sampling": {"output_format": "png"}}')

    for version, want in (("dense", ("attn", "dense_mlp")), ("moe", ("attn",))):
        ckpt, linears = towers[version]
        offer = adapter_offer(ckpt, tmp_path, ({"path": str(merged), "strength": 1.0},), F32, 1 << 30)
        listing = offer.listing()
        assert listing.names == want and listing.total == len(want), version
        for name in AdapterDirectory(tmp_path).names():
            if name != "merged_at_load":  # the engine would take it: it is withheld as merged, not as unfit
                assert engine_takes(linears, tmp_path, name) == (name in want), (version, name)
    assert adapter_offer(dense_ckpt, tmp_path, (), F32, 1 << 30).listing().names == \
        ("attn", "dense_mlp", "merged_at_load")


def test_the_memory_bound_withholds_what_the_engine_would_refuse(towers, tmp_path):
    ckpt, linears = towers["dense"]
    path = write_adapter(tmp_path, "big", weights_of(linears), attention(linears), rank=8)
    need = max(path.stat().st_size, sum(t.numel() for t in load_file(str(path)).values()) * F32)
    for bound, offered in ((need, True), (need - 1, False)):
        assert (adapter_offer(ckpt, tmp_path, (), F32, bound).listing().total == 1) == offered
        assert engine_takes(linears, tmp_path, "big", bound) == offered


def test_a_file_added_replaced_or_removed_is_judged_again(towers, tmp_path):
    ckpt, linears = towers["dense"]
    weights = weights_of(linears)
    offer = adapter_offer(ckpt, tmp_path, (), F32, 1 << 30)
    assert offer.listing().total == 0
    path = write_adapter(tmp_path, "a", weights, attention(linears))
    assert offer.listing().names == ("a",)
    wide = {k: torch.zeros(w.shape[0], w.shape[1] + 1) for k, w in weights.items()}
    write_adapter(tmp_path, "a", wide, attention(linears))  # replaced in place by one that does not fit
    os.utime(path, ns=(1, 1))  # a stamp of its own even within the clock's tick
    assert offer.listing().total == 0
    write_adapter(tmp_path, "a", weights, attention(linears))
    assert offer.listing().names == ("a",)
    path.unlink()
    assert offer.listing().total == 0 and offer._verdicts == {}


def test_a_folder_that_is_not_there_offers_nothing(towers, tmp_path):
    ckpt, _ = towers["dense"]
    assert adapter_offer(ckpt, tmp_path / "absent", (), F32, 1 << 30).listing().total == 0
    assert adapter_offer(ckpt, None, (), F32, 1 << 30).listing().total == 0


def test_judging_never_raises_on_a_hostile_file(towers, tmp_path):
    ckpt, _ = towers["dense"]
    (tmp_path / "huge_header.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    (tmp_path / "short.safetensors").write_bytes(b"\x01")
    os.symlink("/etc/passwd", tmp_path / "link.safetensors")
    offer = adapter_offer(ckpt, tmp_path, (), F32, 1 << 30)
    assert offer.listing().total == 0
    with pytest.raises(ConfigError):  # the same file refused by the reader the offer uses
        from neopp.model.lora import judge_lora_file

        judge_lora_file(tmp_path / "huge_header.safetensors")
