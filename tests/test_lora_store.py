"""The adapter directory and store: names only, lazy load, the LRU's byte bound, refusals that
name the key and leave the model as it was, recommended sampling values, the request inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from neopp.errors import InputError
from neopp.launcher.door.openai_images import OpenAIError, parse_images_request
from neopp.limits import Limits
from neopp.model.adapter_store import AdapterDirectory, AdapterStore, adapter_sampling, apply_recommended
from neopp.model.adapters import tower_linears
from neopp.modes import ModeSpec, SamplingParams
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.serving.request_parsing import parse_request
from testing.stream_requests import make
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_adapter

Q = "q_proj_mot_gen.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_store")
    ckpt = write_tiny_checkpoint(root / "dense", "dense", seed=3)
    pipe = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32)
    weights = {k: lin.weight for k, lin in tower_linears(pipe.transformer).items()}
    return pipe, weights, root


def folder_with(tmp_path, weights, *names, rank=4):
    for i, name in enumerate(names):
        write_adapter(tmp_path, name, weights, sorted(k for k in weights if k.endswith(Q)), rank=rank, seed=i)
    return tmp_path


def test_adapters_load_on_first_use_and_the_lru_keeps_the_byte_bound(tiny, tmp_path):
    pipe, weights, _ = tiny
    pipe.use_adapter_dir(folder_with(tmp_path, weights, "a", "b", "c"))
    one = pipe.adapters.get("a").nbytes
    loads = []
    inner = pipe.adapters._load
    store = AdapterStore(pipe.adapters.directory, lambda *args: loads.append(args[0]) or inner(*args),
                         max_bytes=2 * one)
    assert store.resident() == {} and store.directory.names() == ["a", "b", "c"]
    first = store.get("a")
    assert store.get("a") is first and loads == ["a"]
    store.get("b")
    store.get("a")  # a is now the most recently used
    store.get("c")
    assert list(store.resident()) == ["a", "c"] and loads == ["a", "b", "c"]
    assert store.unload("a") and not store.unload("a") and list(store.resident()) == ["c"]
    assert store.unload("c") and store.get("c") is not store.get("a") and loads == ["a", "b", "c", "c", "a"]
    write_adapter(tmp_path, "c", weights, sorted(k for k in weights if k.endswith(Q)), rank=2, seed=5)
    assert store.get("c").rank == 2 and loads[-1] == "c"  # replaced in place: read again
    (tmp_path / "c.safetensors").unlink()
    with pytest.raises(InputError, match="^LORA: no adapter named 'c'"):
        store.get("c")  # removed: refused, resident or not, and no longer held
    assert "c" not in store.resident()
    small = AdapterStore(pipe.adapters.directory, inner, max_bytes=one - 1)
    with pytest.raises(InputError, match=r"^LORA: adapter 'a' refused: .* \d+ bytes .*over .* lora_max_bytes"):
        small.get("a")
    pipe.use_adapter_dir(None)


@pytest.mark.parametrize("name", ["../a", "a/b", ".hidden", "", "a" * 65, "a..b", "/etc/passwd"])
def test_a_request_names_an_adapter_never_a_path(tiny, tmp_path, name):
    with pytest.raises(InputError, match="^LORA: .* is not an adapter name"):
        AdapterDirectory(tmp_path).path(name)


def test_an_absent_adapter_is_refused_with_what_is_offered(tiny, tmp_path):
    pipe, weights, _ = tiny
    directory = AdapterDirectory(folder_with(tmp_path, weights, "a"))
    with pytest.raises(InputError, match=r"^LORA: no adapter named 'zz' on this model; offered: a$"):
        directory.path("zz")
    with pytest.raises(InputError, match="offered: none"):
        AdapterDirectory(None).path("a")


def bad_files(folder, weights):
    q = sorted(k for k in weights if k.endswith(Q))[0]
    base = q[: -len(".weight")]
    out, in_f = weights[q].shape
    (folder / "garbage.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    save_file({base + ".lora_up.weight": torch.zeros(out, 4), base + ".lora_down.weight": torch.zeros(4, in_f + 1)},
              str(folder / "wide.safetensors"))
    save_file({base + ".lora_up.weight": torch.zeros(out, 4)}, str(folder / "half.safetensors"))
    save_file({base + ".lora_mid.weight": torch.zeros(4, 4)}, str(folder / "scheme.safetensors"))
    save_file({"nowhere.layers.0.q.lora_up.weight": torch.zeros(out, 4),
               "nowhere.layers.0.q.lora_down.weight": torch.zeros(4, in_f)}, str(folder / "elsewhere.safetensors"))
    save_file({base + ".lora_up.weight": torch.full((out, 4), float("nan")),
               base + ".lora_down.weight": torch.zeros(4, in_f)}, str(folder / "nan.safetensors"))
    return base


def test_a_malformed_or_unfitting_adapter_is_refused_naming_the_key_and_the_model_stays(tiny, tmp_path):
    pipe, weights, root = tiny
    base = bad_files(tmp_path, weights)
    pipe.use_adapter_dir(tmp_path)
    expected = {"garbage": "header is not JSON|not a readable safetensors", "wide": f"'{base}.lora_down.weight'",
                "half": f"'{base}.lora_up.weight' has no matching down", "scheme": f"'{base}.lora_mid.weight'",
                "elsewhere": "'nowhere.layers.0.q.lora_up.weight' matches no weight", "nan": "NaN"}
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=7, uncond_tokens=3, seed=1)
    req = make([kv], 0, 64, 64, 1, 1)
    for name, message in expected.items():
        req.lora = name
        with pytest.raises(InputError, match=f"^LORA: adapter '{name}' refused: .*({message})"):
            start(pipe, 0, req)
    assert pipe.adapters.resident() == {}
    req.lora = None
    assert StepBatcher(pipe).step([start(pipe, 0, req)])[0].error is None  # the model still runs
    pipe.use_adapter_dir(None)


def test_moe_takes_attention_adapters_and_refuses_routed_expert_ones(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "moe", "moe", seed=3)
    pipe = NeoPPPipeline.from_pretrained(ckpt, ModeSpec(name="neopp_moe", version="moe"), device="cpu",
                                         dtype=torch.float32)
    weights = {k: lin.weight for k, lin in tower_linears(pipe.transformer).items()}
    write_adapter(tmp_path / "ad", "experts", weights, sorted(k for k in weights if ".experts.0.up_proj" in k))
    write_adapter(tmp_path / "ad", "attn", weights, sorted(k for k in weights if "_proj_mot_gen" in k))
    pipe.use_adapter_dir(tmp_path / "ad")
    with pytest.raises(InputError, match="^LORA: adapter 'experts' refused: .*experts.0.up_proj.lora_up.weight' "
                                         "targets a routed expert"):
        pipe.adapters.get("experts")
    kvs = [write_sample_kv(tmp_path / f"kv{i}", "moe", cond_tokens=5 + i, uncond_tokens=3, seed=i) for i in range(2)]
    reqs = [make(kvs, 0, 64, 64, 2, 1), make(kvs, 1, 64, 64, 2, 2)]
    reqs[1].lora = "attn"
    solo = [run_steps(pipe, [r])[0] for r in reqs]
    for got, want in zip(run_steps(pipe, reqs), solo):
        assert np.array_equal(got, want)
    reqs[1].lora = None
    assert not np.array_equal(run_steps(pipe, [reqs[1]])[0], solo[1])


def run_steps(pipe, reqs):
    batcher, active = StepBatcher(pipe), [start(pipe, i, r) for i, r in enumerate(reqs)]
    finals = {}
    while active:
        events = batcher.step(active)
        finals.update((a.job, ev.final) for a, ev in zip(active, events) if ev.final is not None)
        active = [a for a, ev in zip(active, events) if not ev.last]
    return [finals[i] for i in range(len(reqs))]


def test_recommended_values_from_a_sidecar_or_the_metadata(tiny, tmp_path):
    pipe, weights, _ = tiny
    keys = sorted(k for k in weights if k.endswith(Q))
    eight = {"infer_steps": 8, "enable_cfg": False}
    write_adapter(tmp_path, "meta", weights, keys, metadata={"neopp_sampling": json.dumps(eight)})
    write_adapter(tmp_path, "side", weights, keys)
    (tmp_path / "side.json").write_text(json.dumps({"sampling": {"infer_steps": 6, "timestep_shift": 2.0}}))
    write_adapter(tmp_path, "badside", weights, keys)
    (tmp_path / "badside.json").write_text(json.dumps({"sampling": {"output_format": "png"}}))
    directory, mode = AdapterDirectory(tmp_path), SamplingParams()
    assert directory.recommended("meta") == eight
    assert adapter_sampling(directory, "side", mode, {}).infer_steps == 6
    got = adapter_sampling(directory, "meta", mode, {"infer_steps": 20})
    assert (got.infer_steps, got.enable_cfg) == (20, False)  # the request's own value wins
    assert apply_recommended(mode, {"cfg_scale": 2.0}, eight).enable_cfg is True  # asked for guidance: kept
    with pytest.raises(InputError, match="^LORA: adapter 'badside' refused: .*key 'output_format'"):
        adapter_sampling(directory, "badside", mode, {})


def kv_inputs(**extra):
    kv = torch.zeros(2, 2, 3, 2, 16, dtype=torch.bfloat16)
    return {"COND_KV": kv, "INDEX_OFFSET_COND": np.array([0], np.int64), **extra}


def test_lora_inputs_parse_and_refuse():
    name = np.array([b"style"], dtype=np.object_)
    parsed = parse_request(kv_inputs(LORA=name, LORA_SCALE=np.array([0.5], np.float32)), Limits())
    assert (parsed.lora, parsed.lora_scale) == ("style", 0.5)
    assert parse_request(kv_inputs(LORA=name), Limits()).lora_scale == 1.0
    assert parse_request(kv_inputs(), Limits()).lora is None
    for extra, message in [({"LORA_SCALE": np.array([1.0], np.float32)}, "^LORA_SCALE: given without LORA"),
                           ({"LORA": name, "LORA_SCALE": np.array([np.nan], np.float32)}, "^LORA_SCALE: must be"),
                           ({"LORA": name, "LORA_SCALE": np.array([9.0], np.float32)}, "^LORA_SCALE: must be"),
                           ({"LORA": np.array([b"../x"], dtype=np.object_)}, "^LORA: '../x' is not an adapter")]:
        with pytest.raises(InputError, match=message):
            parse_request(kv_inputs(**extra), Limits())


def test_the_openai_body_takes_lora_and_lora_scale():
    req, _ = parse_images_request({"prompt": "a cat", "lora": "style", "lora_scale": 0.5})
    assert (req.lora, req.lora_scale) == ("style", 0.5)
    for body, param in [({"lora_scale": 1.0}, "lora_scale"), ({"lora": 3}, "lora"), ({"lora": "x" * 200}, "lora"),
                        ({"lora": "s", "lora_scale": 20}, "lora_scale"), ({"lora": " "}, "lora")]:
        with pytest.raises(OpenAIError) as info:
            parse_images_request({"prompt": "a cat", **body})
        assert info.value.param == param
