"""GPU placement without GPUs: the rules take a device count, so an 8-GPU node is a number here.

Covers the per-instance slices of a rank pool, Triton's KIND_GPU ids, the refusal of two models of
one layout on a GPU unless both share, and the shipped layouts (``configs/*.pbtxt``), which must
parse with Triton's own ModelConfig protobuf and keep the inputs/outputs of their config.pbtxt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from neopp.errors import ConfigError
from neopp.modes import load_mode
from neopp.serving.placement import (
    Placement,
    backend_devices,
    check_layout,
    check_overlaps,
    instance_slices,
    model_placement,
    parse_gpu_list,
    read_placement_fields,
)
from neopp.tools.gpu_layout import WRITTEN_NAME
from testing import MODEL_REPOSITORY as REPO
from testing import REPO as ROOT

# The layouts kept in git; `make serve GPUS=N` writes gpus<N> beside them for its machine (ignored by git).
SHIPPED = sorted(p for p in REPO.glob("*/configs/*.pbtxt") if not WRITTEN_NAME.fullmatch(p.stem))
LAYOUT_ONLY = {"layout", "gpus", "share_gpus", "device"}  # what a layout may change in config.pbtxt's parameters
NODE_GPUS = {"h200x8": 8, "h200x1": 1}  # the GPUs of the node each shipped layout is written for


def config(name: str, kind: str = "KIND_MODEL", count: int = 1, group_gpus: list[int] | None = None,
           **params: str) -> dict:
    """A model config as Triton hands it to the model (JSON shape); ``params`` are its parameters."""
    group = {"kind": kind, "count": count, **({"gpus": group_gpus} if group_gpus is not None else {})}
    return {"name": name, "instance_group": [group],
            "parameters": {k: {"string_value": v} for k, v in params.items()}}


def pbtxt(name: str, group: str, **params: str) -> str:
    entries = ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    return f'name: "{name}"\nbackend: "python"\ninstance_group [ {group} ]\nparameters [\n{entries}\n]\n'


def world_of(path: Path) -> int:
    params = read_placement_fields(path.read_text())["parameters"]
    return load_mode(ROOT / params["mode_file"]["string_value"]).world_size


# ---------------------------------------------------------------- lists and slices

def test_gpu_list_parses_and_refuses_repeats_and_junk():
    assert parse_gpu_list("4, 5,6,7") == (4, 5, 6, 7)
    for bad in ("0,0", "0,x", "-1", "1.5"):
        with pytest.raises(ConfigError, match="parameter gpus"):
            parse_gpu_list(bad)


def test_instance_i_takes_the_ith_disjoint_slice():
    assert instance_slices((0, 1, 2, 3), 2, 2) == ((0, 1), (2, 3))
    assert instance_slices((7, 6, 5, 4), 4, 1) == ((7, 6, 5, 4),)
    assert instance_slices((3, 1), 1, 2) == ((3,), (1,))


@pytest.mark.parametrize("gpus,world,instances,why", [
    ((0, 1, 2), 2, 1, "not a multiple"),      # half an instance
    ((0, 1), 2, 2, "a model runs 2"),   # the second engine would have no GPU
    ((0, 1, 2, 3), 2, 1, "a model runs 1"),  # two GPUs named but never used
])
def test_list_must_fill_every_instance_exactly(gpus, world, instances, why):
    with pytest.raises(ConfigError, match=why):
        instance_slices(gpus, world, instances)


def test_a_gpu_list_names_the_one_engine_s_ranks_whatever_the_instance_count():
    """A model's instances hand their requests to one engine: the list holds its ranks, once."""
    placement = model_placement(config("m", count=8, gpus="2,3"), world_size=2, device_count=8)
    assert placement.instances == ((2, 3),)
    assert backend_devices(placement, "MODEL", 0) == ("cuda:2", [2, 3])
    with pytest.raises(ConfigError, match="a model runs 1"):
        model_placement(config("m", count=2, gpus="0,1,2,3"), world_size=2, device_count=8)


def test_kind_gpu_ids_are_triton_s_and_need_no_backend_devices():
    placement = model_placement(config("m", "KIND_GPU", count=2, group_gpus=[0, 3]), world_size=1, device_count=4)
    assert placement.instances == ((0,), (0,), (3,), (3,))
    assert backend_devices(placement, "GPU", 0) is None
    every = model_placement(config("m", "KIND_GPU"), world_size=1, device_count=3)
    assert every.gpus == {0, 1, 2}  # no gpus field: Triton puts count instances on every GPU


def test_kind_gpu_refused_for_a_rank_pool_and_for_missing_devices():
    with pytest.raises(ConfigError, match="KIND_MODEL"):
        model_placement(config("m", "KIND_GPU", group_gpus=[0]), world_size=2, device_count=8)
    with pytest.raises(ConfigError, match=r"GPUs \[7\] but only 4"):
        model_placement(config("m", "KIND_GPU", group_gpus=[7]), world_size=1, device_count=4)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        model_placement(config("m", gpus="0,1"), world_size=2, device_count=0)


def test_both_ways_of_naming_gpus_at_once_is_refused():
    cfg = config("m", "KIND_GPU", group_gpus=[0], gpus="0")
    with pytest.raises(ConfigError, match="not both"):
        model_placement(cfg, 1, 8)


def test_cpu_config_names_no_gpu_and_loads_without_cuda():
    placement = model_placement(config("m", "KIND_CPU"), world_size=4, device_count=0)
    assert placement.instances == () and backend_devices(placement, "CPU", 0) is None


# ---------------------------------------------------------------- overlaps between models

def test_overlap_refused_unless_both_share():
    a, b, c = Placement("a", ((0, 1),)), Placement("b", ((1,),)), Placement("c", ((2, 3),))
    check_overlaps([a, c], "x")
    with pytest.raises(ConfigError, match=r"a and b both use GPUs \[1\] in layout x"):
        check_overlaps([a, b, c], "x")
    with pytest.raises(ConfigError, match="share_gpus"):
        check_overlaps([Placement("a", ((1,),), share=True), b], "x")  # one side's consent is not enough
    check_overlaps([Placement("a", ((1,),), share=True), Placement("b", ((1,),), share=True), c], "x")


def write_model(repo: Path, name: str, default: str, layout: dict[str, str] | None = None) -> Path:
    folder = repo / name
    (folder / "configs").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(default)
    for layout_name, text in (layout or {}).items():
        (folder / "configs" / f"{layout_name}.pbtxt").write_text(text)
    return folder


def gpu_model(name: str, gpu: int, **params: str) -> str:
    return pbtxt(name, f"{{ kind: KIND_GPU count: 1 gpus: [ {gpu} ] }}", mode_file="m.json", layout="x", **params)


CPU_MODEL = '{ kind: KIND_CPU count: 1 }'


def test_layout_check_reads_the_siblings_configs_of_the_same_name(tmp_path):
    a = write_model(tmp_path, "a", pbtxt("a", CPU_MODEL, mode_file="m.json"), {"x": gpu_model("a", 0)})
    write_model(tmp_path, "b", pbtxt("b", CPU_MODEL, mode_file="m.json"), {"x": gpu_model("b", 0)})
    write_model(tmp_path, "bls", pbtxt("bls", CPU_MODEL))  # no GPUs, no file of the layout: ignored
    own = read_placement_fields((a / "configs" / "x.pbtxt").read_text())
    with pytest.raises(ConfigError, match=r"a and b both use GPUs \[0\]"):
        check_layout(own, a, 1, 8)
    (tmp_path / "b" / "configs" / "x.pbtxt").write_text(gpu_model("b", 1))
    assert check_layout(own, a, 1, 8).gpus == {0}


def test_layout_check_allows_a_declared_share(tmp_path):
    a = write_model(tmp_path, "a", "", {"x": gpu_model("a", 0, share_gpus="true")})
    write_model(tmp_path, "b", "", {"x": gpu_model("b", 0, share_gpus="true")})
    own = read_placement_fields((a / "configs" / "x.pbtxt").read_text())
    assert check_layout(own, a, 1, 8).gpus == {0}


def test_layout_check_refuses_a_sibling_left_to_the_automatic_rule(tmp_path):
    a = write_model(tmp_path, "a", "", {"x": gpu_model("a", 0)})
    write_model(tmp_path, "b", pbtxt("b", CPU_MODEL, mode_file="m.json"))  # falls back to config.pbtxt
    own = read_placement_fields((a / "configs" / "x.pbtxt").read_text())
    with pytest.raises(ConfigError, match="b names no GPUs in layout x"):
        check_layout(own, a, 1, 8)
    (tmp_path / "b" / "config.pbtxt").write_text(pbtxt("b", CPU_MODEL, mode_file="m.json", device="cpu"))
    check_layout(own, a, 1, 8)


def test_layout_name_must_be_the_file_s_name(tmp_path):
    a = write_model(tmp_path, "a", "", {"x": gpu_model("a", 0)})
    own = read_placement_fields((a / "configs" / "x.pbtxt").read_text())
    own["parameters"]["layout"] = {"string_value": "y"}
    with pytest.raises(ConfigError, match="configs/y.pbtxt does not exist"):
        check_layout(own, a, 1, 8)


# ---------------------------------------------------------------- the shipped layouts

@pytest.mark.parametrize("layout", sorted(NODE_GPUS))
def test_each_layout_covers_every_generation_model(layout):
    no_gpu = ("neopp_session", "neopp_t2i", "neopp_prompt_encoder")  # BLS models and the small text tower
    generation = sorted(p.parent.name for p in REPO.glob("*/config.pbtxt") if p.parent.name not in no_gpu)
    assert sorted(p.parent.parent.name for p in REPO.glob(f"*/configs/{layout}.pbtxt")) == generation
    assert {p.stem for p in SHIPPED} == set(NODE_GPUS)


def pinned_to_cpu(own: dict) -> bool:
    return own["parameters"]["device"]["string_value"] == "cpu"


def front(own: dict) -> bool:
    """A plain model whose mode's engine another model loads: it holds no weights."""
    return bool(own["parameters"].get("engine_model", {}).get("string_value"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_shipped_layout_loads_on_its_node_and_not_on_a_smaller_one(path):
    own = read_placement_fields(path.read_text())
    assert own["parameters"]["layout"]["string_value"] == path.stem
    if front(own):  # on the CPU, whatever the node: its engine model holds the GPUs
        assert not check_layout(own, path.parent.parent, world_of(path), device_count=NODE_GPUS[path.stem]).gpus
        return
    if pinned_to_cpu(own):  # a mode the node cannot hold: it names no GPU and loads anywhere
        assert world_of(path) > NODE_GPUS[path.stem]
        assert not check_layout(own, path.parent.parent, world_of(path), device_count=0).gpus
        return
    placement = check_layout(own, path.parent.parent, world_of(path), device_count=NODE_GPUS[path.stem])
    assert placement.gpus and all(len(gpus) == world_of(path) for gpus in placement.instances)
    fewer = max(placement.gpus)  # its highest GPU is then missing; a sibling's missing GPU is that sibling's refusal
    with pytest.raises(ConfigError, match=f"only {fewer} are visible|CUDA is not available"):
        check_layout(own, path.parent.parent, world_of(path), device_count=fewer)


def test_h200x8_shares_only_where_declared_and_uses_all_eight():
    placements = [model_placement(read_placement_fields(p.read_text()), world_of(p), 8)
                  for p in REPO.glob("*/configs/h200x8.pbtxt")]
    check_overlaps(placements, "h200x8")
    assert set().union(*(p.gpus for p in placements)) == set(range(8))
    by_model = {p.model: p for p in placements}
    assert by_model["neopp_dense_cfg_seq"].instances == ((4, 5, 6, 7),) and not by_model["neopp_dense_cfg_seq"].share
    assert by_model["neopp_dense_cfg"].instances == by_model["neopp_moe_cfg"].instances == ((2, 3),)
    assert not by_model["neopp_dense_stream"].gpus and not by_model["neopp_dense_cfg_stream"].gpus  # fronts


def test_h200x1_puts_every_one_process_mode_on_gpu_0_by_declaration():
    own = {p.parent.parent.name: read_placement_fields(p.read_text()) for p in REPO.glob("*/configs/h200x1.pbtxt")}
    placements = [model_placement(c, 1, 1) for c in own.values() if not pinned_to_cpu(c) and not front(c)]
    assert sorted(p.model for p in placements) == ["neopp_dense", "neopp_dense_8steps", "neopp_dense_fp8", "neopp_moe"]
    assert all(set(p.instances) == {(0,)} and p.share for p in placements)
    check_overlaps(placements, "h200x1")
    kinds = {m: c["instance_group"][0]["kind"] for m, c in own.items() if pinned_to_cpu(c) or front(c)}
    assert kinds == dict.fromkeys(["neopp_dense_cfg", "neopp_dense_cfg_seq", "neopp_dense_cfg_stream",
                                   "neopp_dense_stream", "neopp_moe_cfg"], "KIND_CPU")


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_shipped_layout_parses_and_keeps_the_model_s_interface(path):
    layout, default = parse(path), parse(path.parent.parent / "config.pbtxt")
    assert (layout.name, layout.backend) == (default.name, default.backend)
    assert list(layout.input) == list(default.input) and list(layout.output) == list(default.output)
    assert layout.dynamic_batching == default.dynamic_batching  # the queue's priority levels too
    params = {k: v.string_value for k, v in layout.parameters.items()}
    base = {k: v.string_value for k, v in default.parameters.items()}
    assert {k: v for k, v in params.items() if k not in LAYOUT_ONLY} == \
        {k: v for k, v in base.items() if k not in LAYOUT_ONLY}
    assert params["device"] in (base["device"], "cpu")  # a layout may only pin a mode to the CPU


@pytest.mark.parametrize("path", SHIPPED + sorted(REPO.glob("*/config.pbtxt")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_own_reader_agrees_with_triton_s_protobuf(path):
    """The runtime reads sibling configs without tritonclient; it must see what Triton sees."""
    proto = json_format.MessageToDict(parse(path), preserving_proto_field_name=True)
    mine = read_placement_fields(path.read_text())
    assert mine["name"] == proto["name"]
    assert [(g["kind"], g["count"], g["gpus"]) for g in mine["instance_group"]] == \
        [(g.get("kind", "KIND_AUTO"), g.get("count", 1), g.get("gpus", [])) for g in proto["instance_group"]]
    assert mine["parameters"] == proto.get("parameters", {})
