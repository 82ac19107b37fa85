"""``LightX2VPipeline`` for NeoPP: the object LightLLM's image server builds and drives.

Same constructor, ``create_generator(config_json=...)``, ``enable_parallel``, ``enable_lora``,
``enable_quantize``, ``modify_config`` and ``generate`` as LightX2V's, and a ``runner`` with
LightX2V's NeoPP methods and hook points (see ``lightx2v_runner``). The work runs here (one
process, a torchrun rank when ``WORLD_SIZE`` is set, or a pool of rank processes for a
parallel mode started without torchrun) or, with ``server_url=``, on a Triton server, where
the same calls give the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..engines.engine import Engine
from ..engines.factory import build_engine
from ..engines.intra_op import on_passing_thread
from ..engines.spec import EngineSpec
from ..errors import ConfigError, InputError
from ..model.checkpoint import default_dtype
from ..modes import TASKS, ModeSpec
from .lightx2v_config import LockedConfig, mode_of, read_config_json
from .lightx2v_rng import seed_all
from .lightx2v_runner import NeoppRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_RESULT_PATH = "lightx2v_gen_result.png"


class LightX2VPipeline:
    """LightX2V's pipeline object; ``server_url`` + ``triton_model`` run each generation on Triton."""

    def __init__(self, task: str = "", model_path: str = "", model_cls: str = "",
                 support_tasks: Sequence[str] = (), server_url: str | None = None,
                 triton_model: str = "neopp_dense", headers: dict[str, str] | None = None, **unused: Any) -> None:
        if model_cls not in ("neopp", ""):
            raise ConfigError(f"model_cls: this facade serves NeoPP only ('neopp'), got {model_cls!r}")
        _refuse_unused("LightX2VPipeline", unused)
        self.support_tasks = tuple(support_tasks) or TASKS
        for name in self.support_tasks:
            if name not in TASKS:
                raise ConfigError(f"support_tasks: unknown task {name!r}; NeoPP supports {TASKS}")
        if task and task not in self.support_tasks:
            raise ConfigError(f"task: {task!r} is not in support_tasks {self.support_tasks}")
        self.task, self.model_path, self.model_cls = task, model_path, "neopp"
        self.server_url, self.triton_model, self.headers = server_url, triton_model, headers
        self.settings: dict[str, Any] = {}  # what enable_* set; the config JSON is applied over it
        self.runner: NeoppRunner | None = None

    # ---- set-up ------------------------------------------------------------------------
    def enable_parallel(self, cfg_p_size: int = 1, seq_p_size: int = 1, seq_p_attn_type: str = "ulysses") -> None:
        self.settings["parallel"] = {"cfg_p_size": cfg_p_size, "seq_p_size": seq_p_size,
                                     "seq_p_attn_type": seq_p_attn_type}

    def enable_lora(self, lora_configs: list[dict], lora_dynamic_apply: bool = False) -> None:
        """LoRAs are merged into the weights at load (numerically what applying them per step gives)."""
        self.settings["lora_configs"] = list(lora_configs)
        self.settings["lora_dynamic_apply"] = bool(lora_dynamic_apply)

    def enable_quantize(self, dit_quantized: bool = False, quant_scheme: str = "fp8-sgl",
                        dit_quantized_ckpt: str | None = None, **unused: Any) -> None:
        """FP8 layer linears; weights quantised at load unless the checkpoint holds FP8 weights already."""
        if dit_quantized_ckpt:
            raise ConfigError("dit_quantized_ckpt: point model_path at the FP8 checkpoint folder instead")
        self.settings.update(dit_quantized=bool(dit_quantized), dit_quant_scheme=quant_scheme)

    def create_generator(self, config_json: str | Path | None = None, device: str | None = None,
                         dtype: str | torch.dtype | None = None, lora_dir: str | Path | None = None,
                         **unused: Any) -> None:
        """Load the mode (config JSON over the enable_* settings) and the engine that runs it."""
        raw = read_config_json(config_json) if config_json is not None else _generator_args(unused)
        config = LockedConfig({**self.settings, **raw, "model_path": self.model_path, "model_cls": "neopp",
                               "task": self.task or self.support_tasks[0]})
        name = Path(config_json).stem if config_json is not None else "neopp"
        mode = mode_of(config, name, Path(config_json).parent if config_json else None,
                       Path(lora_dir) if lora_dir else None)
        config.update({k: v for k, v in unused.items() if k not in raw})  # other LightX2V settings, as given
        engine, noise_device = self._engine(mode, device, dtype)
        self.runner = NeoppRunner(config, mode, engine, noise_device)

    def _engine(self, mode: ModeSpec, device: str | None,
                dtype: str | torch.dtype | None) -> tuple[Engine, torch.device]:
        if self.server_url:
            from ..engines.remote import TritonEngine

            return TritonEngine(self.server_url, self.triton_model, self.model_path, mode, self.headers), \
                torch.device(device or "cpu")
        dev = torch.device(device or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"))
        run_dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or default_dtype(dev))
        if mode.world_size > 1 and "WORLD_SIZE" in os.environ:  # one rank of a torchrun launch
            spec = EngineSpec(self.model_path, mode, (str(dev),), dtype=run_dtype, torchrun_rank=True)
            return build_engine(spec), dev
        # loaded on a thread that ends, so that only the engine's step thread keeps a CPU thread team
        spec = EngineSpec.local(self.model_path, mode, str(dev), dtype=run_dtype)
        return on_passing_thread(lambda: build_engine(spec)), dev

    def modify_config(self, config_modify: dict[str, Any]) -> None:
        """Change the runner's config (it may be locked); LightLLM turns the debug saving off here."""
        if config_modify.get("load_kv_cache_in_pipeline_for_debug"):
            raise ConfigError("load_kv_cache_in_pipeline_for_debug: not supported; call runner.load_kvcache(...) "
                              "with your files before generate")
        runner = self._runner()
        with runner.config.temporarily_unlocked():
            runner.config.update(config_modify)

    # ---- generation --------------------------------------------------------------------
    def generate(self, seed: int | None = None, prompt: str = "", negative_prompt: str = "",
                 save_result_path: str = DEFAULT_RESULT_PATH, task: str | None = None,
                 target_shape: Sequence[int] | None = None, size: Sequence[int] | None = None,
                 return_result_tensor: bool = False, **unused: Any) -> Any:
        """One image. An integer seed seeds every global generator first (LightX2V's ``seed_all``);
        ``None`` draws from them as they are, e.g. as LightLLM restored a session's state."""
        runner = self._runner()
        if prompt or negative_prompt:
            raise InputError("prompt: NeoPP is conditioned through KV prefixes (runner.set_kvcache); "
                             "prompt and negative_prompt are not used")
        if return_result_tensor:
            raise InputError("return_result_tensor: not supported; the result is the hook's (encoded image)")
        _refuse_unused("generate", unused)
        task = task or self.task or "t2i"
        if task not in self.support_tasks:
            raise InputError(f"task: {task!r} is not in support_tasks {self.support_tasks}")
        shape = size if size is not None else target_shape
        default = runner.engine.config.fit(runner.mode).default_size  # the checkpoint's size, if it names one
        height, width = (int(v) for v in shape) if shape else default
        if seed is not None:
            seed_all(seed)
        info = SimpleNamespace(seed=seed, task=task, size=(height, width), target_shape=[height, width],
                               save_result_path=save_result_path)
        return runner.run_pipeline(info)

    def close(self) -> None:
        """Stops rank processes (a parallel mode without torchrun) or the gRPC channel."""
        if self.runner is not None:
            self.runner.engine.close()

    def _runner(self) -> NeoppRunner:
        if self.runner is None:
            raise ConfigError("call create_generator(config_json=...) first")
        return self.runner


def _generator_args(given: dict[str, Any]) -> dict[str, Any]:
    """Without a config JSON, LightX2V takes the sampling defaults from create_generator's arguments."""
    names = {"infer_steps": "infer_steps", "guidance_scale": "cfg_scale", "sample_shift": "timestep_shift"}
    raw = {ours: given[theirs] for theirs, ours in names.items() if given.get(theirs) is not None}
    if given.get("height") and given.get("width"):
        raw["default_size"] = [given["height"], given["width"]]
    return raw


def _refuse_unused(where: str, unused: dict[str, Any]) -> None:
    """LightX2V arguments for other models: refused when set, so nothing is dropped silently."""
    given = sorted(k for k, v in unused.items() if v not in (None, "", [], (), False))
    if given:
        raise InputError(f"{given[0]}: not used by NeoPP's {where} (given: {', '.join(given)})")


__all__ = ["LightX2VPipeline", "NeoppRunner", "seed_all"]
