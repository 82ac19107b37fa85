"""Serving helpers that need no running server: launcher plumbing and request parsing rules."""

from __future__ import annotations

import os
import socket
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from neopp.contract.inputs import INPUT_SPECS
from neopp.errors import ConfigError, InputError
from neopp.launcher.triton_install import (
    SYSTEM_LIB_DIRS,
    find_install,
    prepare_backend_dir,
    python_tag,
    server_env,
)
from neopp.limits import Limits
from neopp.ports import ephemeral_range, free_ports
from neopp.serving.model_settings import PARAMETER_DEFAULTS, choose_device, resolve_checkpoint
from neopp.serving.parameters import read_parameters
from neopp.serving.request_parsing import parse_request


def test_backend_dir_holds_the_stub_for_this_python(tmp_path):
    install = find_install()
    out = prepare_backend_dir(tmp_path / "backends", install)
    py = out / "python"
    assert sorted(p.name for p in py.iterdir()) == [
        "libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    stub = install.site_packages / "pytriton/tritonserver/python_backend_stubs" / python_tag()
    assert (py / "triton_python_backend_stub").read_bytes() == (stub / "triton_python_backend_stub").read_bytes()
    assert os.access(py / "triton_python_backend_stub", os.X_OK)
    prepare_backend_dir(tmp_path / "backends", install)  # rerun is a no-op, not an error


def test_server_env_puts_interpreter_libdir_first_and_venv_bin_first():
    env = server_env(base={"LD_LIBRARY_PATH": "/elsewhere", "PATH": "/usr/bin"})
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    if sysconfig.get_config_var("LIBDIR") not in SYSTEM_LIB_DIRS:  # a Python of its own build (pyenv)
        assert libs.pop(0) == sysconfig.get_config_var("LIBDIR")
    assert libs[0].endswith("nvidia_pytriton.libs") and libs[-1] == "/elsewhere"
    assert Path(env["PATH"].split(os.pathsep)[0], "python").exists()


def test_a_system_python_adds_no_system_folder_to_the_library_path(monkeypatch):
    """A distribution's Python has LIBDIR /usr/lib/<arch>: the loader looks there anyway, and first on
    LD_LIBRARY_PATH it would put a system cuDNN or NCCL before the ones torch brings."""
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "/usr/lib/x86_64-linux-gnu" if name == "LIBDIR" else real(name))
    libs = server_env(base={"LD_LIBRARY_PATH": "", "PATH": "/usr/bin"})["LD_LIBRARY_PATH"].split(os.pathsep)
    assert "/usr/lib/x86_64-linux-gnu" not in libs and libs[0].endswith("nvidia_pytriton.libs")


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    assert all(10000 <= p < ephemeral_range()[0] for p in ports), "outside the range other binds draw from"
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_checkpoint_env_precedence(tmp_path):
    params = read_parameters({"parameters": {"checkpoint": {"string_value": "checkpoints/x"}}}, PARAMETER_DEFAULTS)
    root = tmp_path
    assert resolve_checkpoint(params, "neopp_moe", root, env={}) == root / "checkpoints/x"
    env = {"NEOPP_CHECKPOINT": "/a", "NEOPP_CHECKPOINT_NEOPP_MOE": "/b"}
    assert resolve_checkpoint(params, "neopp_moe", root, env=env) == Path("/b")
    assert resolve_checkpoint(params, "neopp_dense", root, env=env) == Path("/a")


@pytest.mark.skipif(torch.cuda.is_available(), reason="mapping without CUDA")
def test_device_mapping_without_cuda():
    assert choose_device("auto", "CPU", 0, 3) == "cpu"
    assert choose_device("cuda:1", "CPU", 0, 0) == "cuda:1"
    with pytest.raises(ConfigError, match="CUDA is not available"):
        choose_device("cuda", "CPU", 0, 0)
    with pytest.raises(ConfigError, match="parameter device"):
        choose_device("tpu", "CPU", 0, 0)


def _inputs(**overrides):
    base = {"COND_KV": torch.zeros(2, 2, 3, 2, 32, dtype=torch.bfloat16),
            "INDEX_OFFSET_COND": np.array([5], np.int64)}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_parse_request_types_values():
    req = parse_request(_inputs(SIZE=np.array([64, 96], np.int64), SEED=np.array([7], np.int64),
                                CFG_NORM=np.array([b"Channel"], np.object_), STEPS=np.array([3], np.int64),
                                CFG_INTERVAL=np.array([0.0, 0.5], np.float32)), Limits())
    assert (req.size, req.seed, req.index_offset_cond, req.prefix_tokens) == ((64, 96), 7, 5, 3)
    assert req.sampling_overrides == {"cfg_norm": "channel", "infer_steps": 3, "cfg_interval": (0.0, 0.5)}


@pytest.mark.parametrize("overrides,message", [
    ({"COND_KV": None}, "COND_KV: required"),
    ({"COND_KV": torch.zeros(2, 2, 3, 2, 32)}, "COND_KV: datatype must be BF16"),
    ({"UNCOND_KV": torch.zeros(2, 2, 3, 2, 32, dtype=torch.bfloat16)}, "INDEX_OFFSET_UNCOND: required together"),
    ({"IMAGE_KV": torch.zeros(2, 2, 3, 2, 32, dtype=torch.bfloat16)}, "INDEX_OFFSET_IMAGE: required together"),
    ({"INDEX_OFFSET_IMAGE": np.array([3], np.int64)}, "IMAGE_KV: required together"),
    ({"IMAGE_KV": torch.zeros(2, 2, 3, 2, 32), "INDEX_OFFSET_IMAGE": np.array([3], np.int64)},
     "IMAGE_KV: datatype must be BF16"),
    ({"IMAGE_KV": torch.zeros(2, 2, 3, 2, 32, dtype=torch.bfloat16), "INDEX_OFFSET_IMAGE": np.array([-1], np.int64)},
     "INDEX_OFFSET_IMAGE: -1 is out of range"),
    ({"SEED": np.array([1], np.int64), "RNG_STATE": np.zeros(4, np.uint8)}, "not both"),
    ({"STEPS": np.array([201], np.int64)}, "STEPS: must be in 1..200"),
    ({"RESIZE": np.array([-1, 8], np.int64)}, "RESIZE: [height, width] must be positive"),
    ({"RESIZE": np.array([8, 5000], np.int64)}, "RESIZE: each side must be at most"),
    ({"TASK": np.array([b"edit"], np.object_)}, "TASK: unknown task"),
    ({"CFG_SCALE": np.array([np.inf], np.float32)}, "CFG_SCALE: must be a finite number"),
    ({"SIZE": np.array([64.0, 64.0], np.float32)}, "SIZE: datatype must be INT64"),
    ({"BOGUS": np.array([1], np.int64)}, "BOGUS: unknown input"),
    ({"NOISE": np.zeros((1, 3, 8), np.float32)}, "NOISE: shape must be [1, 3, -1, -1]"),
    ({"NOISE": np.zeros((1, 3, 8, 8), np.float64)}, "NOISE: datatype must be FP32"),
    ({"SIZE": np.array([64, 64], np.int64), "NOISE": np.zeros((1, 3, 64, 32), np.float32)},
     "NOISE: shape must be [1, 3, 64, 64]"),
    ({"NOISE": np.full((1, 3, 8, 8), np.inf, np.float32)}, "NOISE: must be finite"),
    ({"NOISE": np.full((1, 3, 8, 8), -2e3, np.float32)}, "NOISE: values must lie within"),
    ({"RNG_STATE": np.zeros(4, np.uint8), "NOISE": np.zeros((1, 3, 8, 8), np.float32)},
     "not both RNG_STATE and NOISE"),
])
def test_parse_request_errors_name_input_and_rule(overrides, message):
    with pytest.raises(InputError) as info:
        parse_request(_inputs(**overrides), Limits(max_side=2048))
    assert message in str(info.value)


def test_contract_table_is_complete():
    assert set(INPUT_SPECS) == {
        "COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND", "SIZE", "SEED", "RNG_STATE", "NOISE",
        "TASK", "CFG_SCALE", "CFG_INTERVAL", "CFG_NORM", "TIMESTEP_SHIFT", "STEPS", "OUTPUT_FORMAT", "RESIZE",
        "IMAGE_GUIDANCE_SCALE", "IMAGE_KV", "INDEX_OFFSET_IMAGE", "LORA", "LORA_SCALE", "CACHE", "CACHE_THRESHOLD",
        "RECORD_PROMPT", "RECORD_NEGATIVE_PROMPT", "RECORD_THINK"}
    assert [n for n, s in INPUT_SPECS.items() if not s.optional] == ["COND_KV", "INDEX_OFFSET_COND"]
