"""What ``model_repository/neopp_prompt_encoder/1/model.py`` does: prompt text in, KV prefixes out.

The checkpoint's language tower (:mod:`neopp.text.language_tower`) encodes ``PROMPT`` into
``COND_KV`` and ``NEGATIVE_PROMPT`` (default: empty, the unconditional prefix) into
``UNCOND_KV``, each with its index offset: exactly the inputs a generation model takes, in its
online layout and dtype (BF16), so ``neopp_t2i`` passes them on unchanged.

Parameters (``config.pbtxt``): ``checkpoint`` (env ``NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER`` or
``NEOPP_CHECKPOINT`` overrides it, as for the generation models; the folder must hold
``tokenizer.json`` with ``tokenizer_config.json`` and the language tower), ``device`` (as the
generation models' parameter), ``num_threads`` (torch CPU threads; 0 keeps torch's default).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..contract.statuses import INVALID_INPUT
from ..errors import ConfigError, InputError
from ..model.checkpoint_config import CheckpointConfig
from ..text.edit_images import read_pictures
from ..text.language_tower import LanguageTower, cannot_edit
from ..text.think import think
from .error_status import error_class, error_response
from .model_settings import choose_device, int_param, project_root, resolve_checkpoint
from .parameters import narrow_kv_dims, read_parameters
from .prompt_parsing import PromptRequest, parse_prompts

ENCODER_PARAMETERS = {"checkpoint": "checkpoints/neopp", "device": "auto", "num_threads": "0"}
KV_OUTPUTS = ("COND_KV", "UNCOND_KV", "IMAGE_KV")


def encoder_checkpoint(model_config: dict[str, Any], model_dir: Path | None) -> Path:
    """The checkpoint folder, resolved the way every generation model resolves its own."""
    params = read_parameters(model_config, ENCODER_PARAMETERS)
    name = str(model_config.get("name", "neopp_prompt_encoder"))
    return resolve_checkpoint(params, name, project_root(model_dir))


def encode_prompts(tower: LanguageTower, req: PromptRequest,
                   cancelled: Callable[[], bool] | None = None) -> dict[str, torch.Tensor | np.ndarray]:
    """The outputs: BF16 prefixes (online layout), INT64 [1] offsets, and the reasoning of think
    mode (its conditional prefix continues from it; "" without THINK), which ``cancelled`` stops.
    With ``IMAGES``, the pictures sit in the conditional prefix and make the image-only one."""
    pictures = None
    if req.images:
        why = cannot_edit(tower)
        if why is not None:
            raise InputError(f"IMAGES: {why}")
        pictures = tower.embed_pictures(read_pictures(req.images))
    cond, reasoning = None, ""
    if req.think:
        thought = think(tower, req.prompt, req.think_max_tokens, cancelled, pictures)
        cond, reasoning = (thought.kv, thought.offset), thought.text
    if pictures is not None:  # think mode wrote its own conditional prefix
        edited, image_only = tower.edit_prefixes(req.prompt, pictures, with_cond=cond is None)
        prefixes = {"COND": cond or edited, "IMAGE": image_only}
    else:
        prefixes = {"COND": cond or tower.conditional(req.prompt)}
    prefixes["UNCOND"] = tower.unconditional(req.negative_prompt)
    outputs: dict[str, torch.Tensor | np.ndarray] = {}
    for branch, (kv, offset) in prefixes.items():
        outputs[f"{branch}_KV"] = kv.to(device="cpu", dtype=torch.bfloat16).contiguous()
        outputs[f"INDEX_OFFSET_{branch}"] = np.array([offset], dtype=np.int64)
    outputs["THINK_TEXT"] = np.array([reasoning.encode("utf-8")], dtype=np.object_)
    return outputs


class PromptEncoderTritonModel:
    """Triton Python-backend model ``neopp_prompt_encoder``."""

    MODEL_DIR: Path | None = None  # model.py sets it to its model folder

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config: Any) -> Any:
        """Narrow COND_KV/UNCOND_KV to ``[layers, 2, -1, kv_heads, head_dim]`` of the checkpoint, so
        the metadata states the geometry the matching generation model reports."""
        config = auto_complete_model_config.as_dict()
        ckpt = encoder_checkpoint(config, cls.MODEL_DIR)
        try:
            layers, kv_heads, head_dim = CheckpointConfig.from_checkpoint(ckpt).kv_dims
        except ConfigError as exc:
            raise ConfigError(f"model {config.get('name')}: checkpoint {ckpt}: {exc}") from exc
        for entry in config.get("output", []):
            if entry["name"] in KV_OUTPUTS:
                narrow_kv_dims(entry, [layers, 2, -1, kv_heads, head_dim])
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb, self.logger = pb_utils, pb_utils.Logger
        config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"]) if args.get("model_repository") else self.MODEL_DIR
        self.model_name = args.get("model_name", config.get("name", "neopp_prompt_encoder"))
        params = read_parameters(config, ENCODER_PARAMETERS)
        ckpt = encoder_checkpoint(config, model_dir)
        match = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
        device = choose_device(params["device"], args.get("model_instance_kind", "CPU"),
                               int(args.get("model_instance_device_id", 0) or 0), int(match.group(1)) if match else 0)
        threads = int_param({"num_threads": params["num_threads"] or "0"}, "num_threads")
        if threads > 0:
            torch.set_num_threads(threads)
        try:
            # bf16 on a GPU (an 8B understanding tower is 16 GiB so, 33 in float32); float32 on the CPU
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
            self.tower = LanguageTower.from_pretrained(ckpt, device=device, dtype=dtype)
        except (ConfigError, OSError) as exc:
            raise ConfigError(f"model {self.model_name}: checkpoint {ckpt}: {exc}") from exc
        self.logger.log_info(f"{self.model_name}: loaded {ckpt} device={device} dtype={dtype} "
                             f"kv_dims={self.tower.config.kv_dims} "
                             f"prompts={self.tower.prompt_ids.kind} "
                             f"vocabulary={self.tower.prompt_ids.vocabulary_size()}")

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request; a refused request never affects the next one."""
        return [self._serve(request) for request in requests]

    def finalize(self) -> None:
        self.tower = None

    def _serve(self, request: Any) -> Any:
        pb = self.pb
        try:
            req = parse_prompts({tensor.name(): tensor.as_numpy() for tensor in request.inputs()})
            outputs = encode_prompts(self.tower, req, request.is_cancelled)
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the model stays usable
            if error_class(exc) is INVALID_INPUT:
                self.logger.log_warn(f"{self.model_name}: refused: {exc}")
            return error_response(pb, exc, self.logger, self.model_name)
        return pb.InferenceResponse(output_tensors=[
            pb.Tensor.from_dlpack(name, value) if isinstance(value, torch.Tensor) else pb.Tensor(name, value)
            for name, value in outputs.items()])
