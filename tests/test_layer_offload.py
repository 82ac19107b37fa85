"""Layer offload against the same tower with every layer resident.

On a CPU there is nothing to offload to, so the server refuses it by name; the offload itself
runs here as a stand-in whose "device" is the CPU too. What that checks is everything but the
CUDA copies and events: which storage each layer's tensors point at and when (only the running
layer's on a slot, every other one's on its host copy), the ring of slots, views kept as views,
and the bytes: a tower whose layers go through the ring computes exactly what it computes with
them resident, float32 on the CPU, for every kind of layer (dense, MoE looped and grouped, FP8,
GGUF blocks), batched steps, per-request adapters, the step cache and the understanding tower.
"""

from __future__ import annotations

import pytest
import torch

from neopp.errors import ConfigError
from neopp.model import layers as layer_module
from neopp.model.adapters import tower_linears
from neopp.model.kernel_choices import KernelChoices
from neopp.model.layer_offload import AHEAD, LayerOffload, layer_offload, layer_tensors
from neopp.model.speed import SpeedOptions
from neopp.modes import OFFLOAD_POLICIES, ModeSpec, SamplingParams, mode_from_dict
from neopp.request import GenerationRequest
from neopp.sampling.batching import StepBatcher, start
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.sampling.rng import NoiseStream
from neopp.text.language_tower import LanguageTower
from testing.stream_requests import assert_pixels_match
from testing.tiny_checkpoint import random_kv, tiny_config, write_tiny_checkpoint
from testing.tiny_gguf import WIDE, write_gguf
from testing.tiny_lora import write_adapter
from testing.tiny_u1 import write_tiny_u1_checkpoint

CPU = torch.device("cpu")
DEEP = {"llm_config": {"num_hidden_layers": 5}}  # enough layers for the ring to turn


def make(cfg: dict, i: int, height: int, width: int, steps: int, seed: int, lora: str | None = None,
         **sampling) -> GenerationRequest:
    """A guided request on prefix pair ``i`` of a checkpoint of config ``cfg``."""
    return GenerationRequest(lora=lora, lora_scale=0.8, cond_kv=random_kv(cfg, 9 + 6 * i, 2 * i),
                             uncond_kv=random_kv(cfg, 3 + i, 2 * i + 1),
                             index_offset_cond=30 + i, index_offset_uncond=4 + i, height=height, width=width,
                             noise=NoiseStream(seed).draw(height, width),
                             sampling_params=SamplingParams(infer_steps=steps, **sampling))


def stand_in(policy: str) -> LayerOffload:
    return LayerOffload(policy, CPU)


def pipeline(ckpt, mode: ModeSpec | None = None, offload: LayerOffload | None = None) -> NeoPPPipeline:
    return NeoPPPipeline.from_pretrained(ckpt, mode or ModeSpec(), "cpu", torch.float32, offload=offload)


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def on_host(pipe: NeoPPPipeline) -> bool:
    """Does every layer tensor point at its host copy (no layer left on a slot)?"""
    offload = pipe.transformer.offload
    return all(storage(t) == storage(h) for held in offload.layers for t, h in zip(held.bases, held.host))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    return root, write_tiny_checkpoint(root / "dense", "dense", seed=3, overrides=DEEP), tiny_config("dense", DEEP)


@pytest.mark.parametrize("policy", ["low", "balanced"])
def test_a_dense_tower_draws_the_same_bytes_streamed_and_leaves_nothing_on_a_slot(tiny, policy):
    _, dense, cfg = tiny
    req = make(cfg, 0, 64, 96, 3, 5)
    want = pipeline(dense).sample(req)
    pipe = pipeline(dense, offload=stand_in(policy))
    assert torch.equal(pipe.sample(req), want)
    offload = pipe.transformer.offload
    assert len(offload.layers) == len(pipe.transformer.layers) and len(offload.slots) == AHEAD[policy] + 1
    assert on_host(pipe)
    # A slot holds one layer: the ring's device bytes are its slots' worth, not the tower's.
    assert offload.device_bytes == len(offload.slots) * offload.layers[0].nbytes < offload.host_bytes


@pytest.mark.parametrize("dispatch", ["loop", "grouped"])
def test_moe_experts_looped_or_grouped_stay_views_of_their_stacks(tmp_path, monkeypatch, dispatch):
    monkeypatch.setattr(layer_module, "kernel_choices", lambda: KernelChoices(moe_dispatch=dispatch))
    moe = write_tiny_checkpoint(tmp_path / "moe", "moe", seed=4, overrides=DEEP)
    mode = ModeSpec(name="moe", version="moe")
    req = make(tiny_config("moe", DEEP), 0, 64, 64, 3, 2)
    want = pipeline(moe, mode).sample(req)
    pipe = pipeline(moe, mode, stand_in("balanced"))
    assert torch.equal(pipe.sample(req), want)
    mlp = pipe.transformer.layers[0].mlp
    assert (mlp.grouped is None) == (dispatch == "loop")
    if mlp.grouped is not None:  # the experts' weights are views into the stacks, on the host and in the run
        held = pipe.transformer.offload.layers[0]
        assert held.views and all(storage(e.gate.weight) == storage(mlp.grouped.stacks[0]) for e in mlp.experts)
        running = pipe.transformer.offload.each([0])
        assert next(running) == 0 and storage(mlp.experts[1].up.weight) == storage(mlp.grouped.stacks[1])
        stack = [id(t) for t in held.bases].index(id(mlp.grouped.stacks[1]))
        assert storage(mlp.grouped.stacks[1]) != storage(held.host[stack])
        running.close()
        assert on_host(pipe)


def test_fp8_and_gguf_layers_draw_the_same_bytes_streamed(tiny, tmp_path):
    _, dense, cfg = tiny
    req = make(cfg, 1, 64, 64, 3, 7)
    fp8 = ModeSpec(name="fp8", dit_quantized=True, dit_quant_scheme="fp8-sgl")
    assert torch.equal(pipeline(dense, fp8, stand_in("low")).sample(req), pipeline(dense, fp8).sample(req))
    wide = write_tiny_checkpoint(tmp_path / "wide", "dense", seed=2, overrides=WIDE)
    file = write_gguf(wide, tmp_path / "q4k", "Q4_K", seed=3)
    wide_req = make(tiny_config("dense", WIDE), 0, 64, 64, 3, 1)
    streamed = pipeline(file, offload=stand_in("balanced"))
    assert all(isinstance(t, torch.Tensor) for t in layer_tensors(streamed.transformer.layers[0]))
    assert torch.equal(streamed.sample(wide_req), pipeline(file).sample(wide_req))


def batched(pipe: NeoPPPipeline, reqs: list[GenerationRequest]) -> dict[int, object]:
    """Every request through one step batcher, all joining at the first step: final pixels by job."""
    batcher, active, finals = StepBatcher(pipe), [start(pipe, i, r) for i, r in enumerate(reqs)], {}
    for _ in range(100):
        if not active:
            break
        events = batcher.step(active)
        for a, ev in zip(active, events):
            assert ev.error is None
            if ev.final is not None:
                finals[a.job] = ev.final
        active = [a for a, ev in zip(active, events) if not ev.last]
    return finals


def test_batched_steps_adapters_and_the_step_cache_are_those_of_resident_layers(tiny):
    root, dense, cfg = tiny
    resident, pipe = pipeline(dense), pipeline(dense, offload=stand_in("balanced"))
    weights = {k: lin.weight for k, lin in tower_linears(resident.transformer).items()}
    write_adapter(root / "adapters", "attn", weights, sorted(k for k in weights if "q_proj" in k or "down" in k))
    for p in (resident, pipe):
        p.use_adapter_dir(root / "adapters")
    reqs = [make(cfg, 0, 64, 96, 4, 1), make(cfg, 1, 96, 64, 3, 2), make(cfg, 2, 64, 64, 5, 4, enable_cfg=False),
            make(cfg, 0, 64, 64, 3, 9, lora="attn"),
            make(cfg, 2, 64, 64, 10, 3, cache="fbcache", cache_threshold=0.5)]
    want, got = batched(resident, reqs), batched(pipe, reqs)
    assert sorted(got) == list(range(len(reqs)))
    for i in range(len(reqs)):
        assert_pixels_match(got[i], want[i], f"request {i}")
    assert_pixels_match(got[0], resident.generate(reqs[0]), "request 0 alone")
    assert on_host(pipe)


@pytest.mark.parametrize("policy", ["low", "balanced"])
def test_only_the_running_layer_points_at_a_slot_and_the_ring_reuses_its_slots(tiny, policy):
    _, dense, _ = tiny
    pipe = pipeline(dense, offload=stand_in(policy))
    offload, layers = pipe.transformer.offload, pipe.transformer.layers
    slot_storages = set()
    for order in ([0, 1, 2, 3, 4], [2, 3], [1]):  # a whole pass, then the parts a step cache runs
        seen = []
        for i in offload.each(order):
            seen.append(i)
            on_slot = [j for j, layer in enumerate(layers) if storage(layer.q_proj.weight)
                       != storage(offload.layers[j].host[[id(t) for t in offload.layers[j].bases].index(
                           id(layer.q_proj.weight))])]
            assert on_slot == [i]
            slot_storages.add(storage(layers[i].q_proj.weight))
        assert seen == order and on_host(pipe)
    assert len(slot_storages) == len(offload.slots)
    for i in offload.each(range(5)):  # a loop left early leaves nothing bound
        if i == 1:
            break
    assert on_host(pipe)
    stale = offload.each([0, 1])  # a loop left open: the next one takes its layer back ...
    assert next(stale) == 0
    current = offload.each([3, 4])
    assert next(current) == 3
    stale.close()  # ... and its late cleanup leaves the current loop's layer alone
    assert storage(layers[3].q_proj.weight) != storage(offload.layers[3].host[0])
    assert list(current) == [4] and on_host(pipe)


def test_the_understanding_tower_writes_the_same_prefixes_streamed(tmp_path):
    ckpt = write_tiny_u1_checkpoint(tmp_path / "u1", seed=5)
    resident = LanguageTower.from_pretrained(ckpt, "cpu", torch.float32)
    streamed = LanguageTower.from_pretrained(ckpt, "cpu", torch.float32, offload=stand_in("low"))
    ids = resident.prompt_ids.conditional("a red circle")
    for a, b in ((resident.encode_ids(ids), streamed.encode_ids(ids)),
                 (resident.unconditional("blurry"), streamed.unconditional("blurry"))):
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
    many = [ids, resident.prompt_ids.conditional("two squares")]
    for a, b in zip(resident.encode_many(many), streamed.encode_many(many), strict=True):
        assert torch.equal(a[0], b[0])


def test_offload_is_refused_where_it_cannot_run_naming_it(tiny):
    _, dense, _ = tiny
    assert OFFLOAD_POLICIES == ("none", *AHEAD) and layer_offload("none", CPU) is None
    with pytest.raises(ConfigError, match="offload: 'low' needs a CUDA device"):
        layer_offload("low", CPU)
    with pytest.raises(ConfigError, match="offload: 'balanced' needs a CUDA device"):
        pipeline(dense, ModeSpec(offload="balanced"))
    with pytest.raises(ConfigError, match="mode m: offload: one of none, low, balanced, got 'all'"):
        mode_from_dict({"offload": "all"}, "m")
    with pytest.raises(ConfigError, match="offload: one of none, low, balanced"):
        LanguageTower.from_pretrained(dense, "cpu", torch.float32, offload="half")
    pipe = pipeline(dense, offload=stand_in("low"))
    with pytest.raises(ConfigError, match="parameter cuda_graphs: 'on' cannot run with offload 'low'"):
        pipe.use_speed(SpeedOptions(cuda_graphs="on"))
    pipe.use_speed(SpeedOptions(cuda_graphs="auto"))
    assert pipe.layer_graphs is None


def test_the_mode_file_key_and_the_parameter(tmp_path):
    from neopp.serving.model_settings import _offload

    assert mode_from_dict({"offload": "low"}, "m").offload == "low"
    assert mode_from_dict({}, "m").offload == "none"
    assert _offload("") is None and _offload(" Balanced ") == "balanced"
    with pytest.raises(ConfigError, match="parameter offload: one of none, low, balanced"):
        _offload("some")
    sampling = SamplingParams(infer_steps=2)
    assert ModeSpec(sampling_params=sampling).offload == "none"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["low", "balanced"])
def test_on_cuda_the_streamed_tower_draws_the_resident_bytes_and_holds_its_slots_only(tiny, policy):
    _, dense, cfg = tiny
    cuda = torch.device("cuda")
    resident = NeoPPPipeline.from_pretrained(dense, ModeSpec(), "cuda", torch.bfloat16)
    streamed = NeoPPPipeline.from_pretrained(dense, ModeSpec(offload=policy), "cuda", torch.bfloat16)
    offload = streamed.transformer.offload
    assert offload is not None and offload.copy_stream is not None
    assert all(h.is_pinned() for held in offload.layers for h in held.host)
    req = make(cfg, 0, 64, 96, 4, 5)
    assert torch.equal(streamed.sample(req), resident.sample(req))
    batch = [make(cfg, 1, 64, 64, 3, 2), make(cfg, 2, 96, 64, 4, 3)]
    want, got = batched(resident, batch), batched(streamed, batch)
    for i in range(len(batch)):
        assert_pixels_match(got[i], want[i], f"request {i}")
    assert all(t.device.type == "cpu" for held in offload.layers for t in held.bases)
    assert offload.device_bytes <= len(offload.ring) * max(held.nbytes for held in offload.layers)
    assert layer_offload(policy, cuda).policy == policy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["low", "balanced"])
def test_on_cuda_a_slow_copy_or_a_slow_layer_never_reads_a_weight_early_or_late(tiny, policy):
    """The compute stream sleeps in every layer (a copy that did not wait for its slot to be free
    would overwrite the running layer), or the copy stream sleeps first (a layer that did not wait
    for its copy would read the slot's previous layer): each layer's sums are its host copy's."""
    _, dense, _ = tiny
    offload = NeoPPPipeline.from_pretrained(dense, ModeSpec(offload=policy), "cuda", torch.float32).transformer.offload
    want = [[h.double().sum().item() for h in held.host] for held in offload.layers]
    order = [0, 1, 2, 3, 4, 2, 3, 4, 0, 1]
    for slow_copy in (False, True):
        sums = []
        if slow_copy:
            with torch.cuda.stream(offload.copy_stream):
                torch.cuda._sleep(200_000_000)
        for i in offload.each(order):
            if not slow_copy:
                torch.cuda._sleep(50_000_000)
            sums.append([t.double().sum() for t in offload.layers[i].bases])
        got = [[x.item() for x in layer] for layer in sums]
        assert got == [want[i] for i in order], f"slow {'copy' if slow_copy else 'layer'}"


def test_the_gpu_benchmark_runs_its_stand_in_on_the_cpu(tmp_path):
    from bench import offload_check

    assert offload_check.main(["--device", "cpu", "--shrink", "16", "--layers", "3", "--size", "64", "--steps", "2",
                               "--out", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "offload_gpu.md").read_text().splitlines() if line.startswith("| ")][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| none", "| low", "| balanced"]
    assert all(row.endswith("| True |") for row in rows)


def test_the_understanding_tower_keeps_a_gguf_file_s_blocks_and_writes_its_floats_prefixes(tmp_path):
    from neopp.model.gguf_checkpoint import GGUFLinear
    from testing.tiny_gguf import dequantized_reference

    u1 = write_tiny_u1_checkpoint(tmp_path / "u1", seed=6)
    file = write_gguf(u1, tmp_path / "q8", "Q8_0", seed=1)
    blocks = LanguageTower.from_pretrained(file, "cpu", torch.float32, offload=stand_in("balanced"))
    floats = LanguageTower.from_pretrained(dequantized_reference(file, tmp_path / "floats"), "cpu", torch.float32)
    assert all(isinstance(lin, GGUFLinear) for layer in blocks.layers for lin in layer.linears()
               if lin is not getattr(layer.mlp, "router", None))
    ids = floats.prompt_ids.conditional("a blue square")
    assert torch.equal(blocks.encode_ids(ids)[0], floats.encode_ids(ids)[0])


def test_the_memory_tables_count_the_towers_from_the_loader_s_keys(tmp_path):
    from bench import offload_memory as om

    eight = om.Counts.of(om.EIGHT_B)
    assert eight.layers == 36 and abs(eight.layers * eight.quantized + eight.outside - 7.03e9) < 0.01e9
    assert abs(om.Counts.of(om.A3B).layers * om.Counts.of(om.A3B).layer_bytes("bf16") / 1e9 - 16.3) < 0.1
    resident = om.need(om.EIGHT_B, eight, "bf16", "none", 2048)
    assert om.need(om.EIGHT_B, eight, "bf16", "low", 2048) < om.need(om.EIGHT_B, eight, "bf16", "balanced", 2048)
    assert resident - om.need(om.EIGHT_B, eight, "bf16", "low", 2048) == pytest.approx(
        35 * eight.layer_bytes("bf16") / 1e9)
    om.main(["--out", str(tmp_path)])
    rows = [line for line in (tmp_path / "offload_memory.md").read_text().splitlines() if line.startswith("| U1")]
    assert len(rows) == 2 * 2 * 4 * 3  # two 8B towers, two tables, four formats, three offloads
