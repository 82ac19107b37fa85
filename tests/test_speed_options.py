"""The speed options on the CPU: the attention kernels a setting names, the per-shape choice,
and the parameters' checks (the CUDA graphs themselves run in tests/test_cuda_graphs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.errors import ConfigError
from neopp.model.attention import AttentionKernels, grouped_attention
from neopp.model.speed import SpeedOptions
from neopp.modes import ModeSpec
from neopp.sampling.pipeline import NeoPPPipeline
from neopp.serving.model_settings import TritonModelSettings
from testing.probes import branch_velocity
from testing.stream_requests import make, tiny_setup
from testing.tiny_checkpoint import write_tiny_checkpoint
from tests.reference import neopp_reference as ref


def qkv(tokens: int = 48, prefix: int = 30, heads: int = 4, kv_heads: int = 2, hd: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, hd, generator=g)
    k = torch.randn(kv_heads, prefix + tokens, hd, generator=g)
    v = torch.randn(kv_heads, prefix + tokens, hd, generator=g)
    return q, k, v


def plain_attention(q, k, v):
    """Softmax attention in float64, each query head over its KV head, written out."""
    heads, kv_heads = q.shape[1], k.shape[0]
    out = []
    for h in range(heads):
        kh, vh = k[h // (heads // kv_heads)].double(), v[h // (heads // kv_heads)].double()
        w = (q[:, h].double() @ kh.T / q.shape[-1] ** 0.5).softmax(-1)
        out.append(w @ vh)
    return torch.stack(out, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("setting", ["default", "flash", "math"])
def test_each_kernel_the_cpu_has_computes_the_attention(setting):
    q, k, v = qkv()
    got = AttentionKernels(setting)(q, k, v)
    torch.testing.assert_close(got.double(), plain_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_a_named_kernel_is_the_one_that_runs():
    """cuDNN's kernel does not exist on the CPU: naming it fails instead of quietly falling back."""
    q, k, v = qkv()
    with pytest.raises(RuntimeError):
        AttentionKernels("cudnn")(q, k, v)


def test_auto_measures_each_shape_once_and_keeps_the_fastest():
    kernels = AttentionKernels("auto", measure_on_cpu=True)
    q, k, v = qkv()
    got = kernels(q, k, v)
    (key, times), = kernels.timings.items()
    assert set(times) == {"flash", "math"}  # the memory-efficient and cuDNN kernels refuse the CPU
    assert kernels.chosen[key] == kernels.kernel_for(q, k, v)
    assert min(times, key=times.get) in {"flash", "math"}
    torch.testing.assert_close(got.double(), plain_attention(q, k, v), rtol=1e-5, atol=1e-5)
    q2, k2, v2 = qkv(prefix=31, seed=1)  # one more key: the same bucket, no new measurement
    kernels(q2, k2, v2)
    assert len(kernels.timings) == 1
    kernels(*qkv(prefix=400))  # another bucket
    assert len(kernels.timings) == 2


def test_auto_keeps_torchs_pick_on_the_cpu():
    q, k, v = qkv()
    kernels = AttentionKernels("auto")
    assert torch.equal(kernels(q, k, v), grouped_attention(q, k, v))
    assert not kernels.timings


@pytest.mark.parametrize("options, words", [
    ({"cuda_graphs": "yes"}, "cuda_graphs"),
    ({"attention_kernel": "flash3"}, "attention_kernel"),
    ({"max_graphs": 0}, "max_graphs"),
])
def test_bad_options_name_the_parameter(options, words):
    with pytest.raises(ConfigError, match=words):
        SpeedOptions(**options)


def test_graphs_apply_to_cuda_only():
    run = torch.nn.Identity()
    assert SpeedOptions().layer_graphs(run, torch.device("cpu")) is None
    assert SpeedOptions(cuda_graphs="off").layer_graphs(run, torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        SpeedOptions(cuda_graphs="on").layer_graphs(run, torch.device("cpu"))


def config_with(**params) -> dict:
    return {"name": "neopp_dense", "parameters": {k: {"string_value": v} for k, v in params.items()}}


def test_the_model_parameters_reach_the_options(tmp_path):
    settings = TritonModelSettings.from_config(
        config_with(cuda_graphs="off", attention_kernel="flash", max_graphs="3"), tmp_path / "repo" / "neopp_dense")
    assert settings.speed == SpeedOptions("off", "flash", 3)
    default = TritonModelSettings.from_config(config_with(), tmp_path / "repo" / "neopp_dense")
    assert default.speed == SpeedOptions()
    # opt-in until a recorded GPU run shows them byte-equal to eager: graphs off, torch's own kernel pick
    assert (default.speed.cuda_graphs, default.speed.attention_kernel) == ("off", "default")

    wrong = TritonModelSettings.from_config(config_with(cuda_graphs="sometimes"), tmp_path / "repo" / "neopp_dense")
    with pytest.raises(ConfigError, match="cuda_graphs"):  # checked where the engine loads: its stub only
        _ = wrong.speed


def test_the_unproven_gpu_kernels_are_opt_in():
    """The grouped MoE experts and the compiled FP8 quantisation run only when asked for."""
    from neopp.model.kernel_choices import KernelChoices

    assert KernelChoices.from_env({}) == KernelChoices(128, "loop", "eager")
    chosen = KernelChoices.from_env({"NEOPP_MOE_DISPATCH": "grouped", "NEOPP_FP8_ACTIVATION_QUANT": "compiled"})
    assert (chosen.moe_dispatch, chosen.fp8_activation_quant) == ("grouped", "compiled")


def test_a_whole_image_with_a_named_kernel(tmp_path):
    """The math kernel through the whole tower draws the image torch's pick draws, within float32
    reassociation (a wrong attention differs by tens of levels almost everywhere)."""
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    req = make(kvs, 0, 64, 96, 4, seed=5)
    want = pipe.generate(req)
    math = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32,
                                         speed=SpeedOptions(attention_kernel="math"))
    assert pipe.layer_graphs is None and math.layer_graphs is None
    diff = np.abs(math.generate(make(kvs, 0, 64, 96, 4, seed=5)).astype(int) - want.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_compiled_layers_compute_the_tower(tmp_path):
    """`torch.compile`d layers (the CPU's C++ kernels here, Triton's on a GPU) against the float64
    reference velocity, and the whole image against eager within float32 reassociation."""
    ckpt, pipe, kvs = tiny_setup(tmp_path)
    compiled = NeoPPPipeline.from_pretrained(ckpt, device="cpu", dtype=torch.float32,
                                             speed=SpeedOptions(compile_layers="on"))
    assert compiled.transformer.layer_parts != pipe.transformer.layer_parts
    req = make(kvs, 0, 64, 96, 4, seed=5)
    t = 0.3
    want = ref.reference_velocity(ckpt, req.cond_kv, req.index_offset_cond, req.noise, t, 64, 96)
    got = branch_velocity(compiled, req, req.noise, t).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    diff = np.abs(compiled.generate(make(kvs, 0, 64, 96, 4, seed=5)).astype(int) - pipe.generate(req).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01
    compiled.use_speed(SpeedOptions())
    assert compiled.transformer.layer_parts == pipe.transformer.layer_parts


def test_graphs_are_refused_where_a_step_reads_values_on_the_host():
    """MoE experts run as a loop read each expert's token count on the host: no graph holds that."""
    run, cuda = torch.nn.Identity(), torch.device("cuda")
    assert SpeedOptions().layer_graphs(run, cuda, reads_host_values=True) is None
    with pytest.raises(ConfigError, match="MoE experts read their token counts on the host"):
        SpeedOptions(cuda_graphs="on").layer_graphs(run, cuda, reads_host_values=True)


def test_a_tower_says_whether_its_step_reads_host_values(tmp_path):
    moe = write_tiny_checkpoint(tmp_path / "moe", "moe")
    mode = ModeSpec(name="moe", version="moe")
    loop = NeoPPPipeline.from_pretrained(moe, mode, "cpu", torch.float32)
    assert loop.transformer.reads_host_values and loop.layer_graphs is None
    ckpt, dense, _ = tiny_setup(tmp_path / "dense")
    assert not dense.transformer.reads_host_values
