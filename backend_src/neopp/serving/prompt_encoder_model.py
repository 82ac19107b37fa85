"""What ``model_repository/neopp_prompt_encoder/1/model.py`` does: prompt text in, KV prefixes out.

The checkpoint's language tower (:mod:`neopp.text.language_tower`) encodes ``PROMPT`` into
``COND_KV`` and ``NEGATIVE_PROMPT`` (default: empty, the unconditional prefix) into
``UNCOND_KV``, each with its index offset: exactly the inputs a generation model takes, in its
online layout and dtype (BF16), so ``neopp_t2i`` passes them on unchanged.

The model's first instance (the owner) loads the tower once (``prefill_host``); every instance,
the owner included, hands its requests to it and waits for the answer, so prompts that arrive
together on several instances are prefilled in one forward.

Parameters (``config.pbtxt``): ``checkpoint`` (env ``NEOPP_CHECKPOINT_NEOPP_PROMPT_ENCODER`` or
``NEOPP_CHECKPOINT`` overrides it, as for the generation models; the folder must hold
``tokenizer.json`` with ``tokenizer_config.json`` and the language tower), ``device`` (as the
generation models' parameter), ``num_threads`` (torch CPU threads; 0 keeps torch's default),
``max_prefill_batch`` (the most requests prefilled together; 1: each alone, so a prefix never
depends on which prompts shared its forward, not even in its last bit), ``offload`` (``none``,
``low`` or ``balanced``: the tower's layers in pinned host memory, streamed to the GPU as the
generation models' parameter does; env ``NEOPP_OFFLOAD`` is the default).
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.statuses import INTERNAL, WORKERS_DOWN
from ..errors import ConfigError
from ..model.checkpoint_config import CheckpointConfig
from .engine_link import EngineLink, EngineUnavailable
from .metrics import PrefillMetrics
from .model_settings import choose_device, int_param, project_root, resolve_checkpoint
from .parameters import narrow_kv_dims, read_parameters
from .triton_model import ENGINE_LOST_PAUSE_S, ENGINE_LOST_RETRIES, engine_lost, first_instance, stop_on_sigterm
from .wire import failure_header, unpack_tensors

if TYPE_CHECKING:
    from ..text.language_tower import LanguageTower
    from .prefill_host import PrefillHost

ENCODER_PARAMETERS = {"checkpoint": "checkpoints/neopp", "device": "auto", "num_threads": "0",
                      "max_prefill_batch": "16", "offload": "none"}
KV_OUTPUTS = ("COND_KV", "UNCOND_KV", "IMAGE_KV")
MAX_PREFILL_BATCH = 256
MAX_ANSWER_BYTES = 1 << 34  # an answer comes from the owner stub, never from a client


def encoder_checkpoint(model_config: dict[str, Any], model_dir: Path | None) -> Path:
    """The checkpoint folder, resolved the way every generation model resolves its own."""
    params = read_parameters(model_config, ENCODER_PARAMETERS)
    name = str(model_config.get("name", "neopp_prompt_encoder"))
    return resolve_checkpoint(params, name, project_root(model_dir))


def max_prefill_batch(params: dict[str, str]) -> int:
    value = int_param(params, "max_prefill_batch")
    if not 1 <= value <= MAX_PREFILL_BATCH:
        raise ConfigError(f"max_prefill_batch: must be 1..{MAX_PREFILL_BATCH}, got {value}")
    return value


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
        """The owner loads the tower and opens its socket; every instance links to it."""
        import triton_python_backend_utils as pb_utils

        self.pb, self.logger = pb_utils, pb_utils.Logger
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "neopp_prompt_encoder"))
        params = read_parameters(config, {**ENCODER_PARAMETERS, "offload": os.environ.get("NEOPP_OFFLOAD") or "none"})
        batch = max_prefill_batch(params)
        self._stopping = stop_on_sigterm(self.logger, self.model_name)
        self.host: PrefillHost | None = None
        if first_instance(args):
            from .prefill_host import PrefillHost  # torch: the owner's alone

            self.metrics = PrefillMetrics(pb_utils, self.model_name)
            tower = self._load_tower(args, config, params)
            self.host = PrefillHost(self.model_name, tower, batch, self._stopping, self.logger.log_error,
                                    self.metrics.batch, self.metrics.held)
        else:
            self.logger.log_info(f"{self.model_name} ({args.get('model_instance_name', '')}): hands its requests "
                                 "to the tower of its first instance")
        self.link = EngineLink(self.model_name, self.model_name, "plain")

    def _load_tower(self, args: dict[str, str], config: dict[str, Any], params: dict[str, str]) -> LanguageTower:
        import torch

        from ..text.language_tower import LanguageTower

        model_dir = Path(args["model_repository"]) if args.get("model_repository") else self.MODEL_DIR
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
            offload = params["offload"].strip().lower() or "none"
            tower = LanguageTower.from_pretrained(ckpt, device=device, dtype=dtype, offload=offload)
        except (ConfigError, OSError) as exc:
            raise ConfigError(f"model {self.model_name}: checkpoint {ckpt}: {exc}") from exc
        self.logger.log_info(f"{self.model_name}: loaded {ckpt} device={device} dtype={dtype} "
                             f"kv_dims={tower.config.kv_dims} prompts={tower.prompt_ids.kind} "
                             f"vocabulary={tower.prompt_ids.vocabulary_size()} "
                             f"max_prefill_batch={params['max_prefill_batch']} offload={offload}")
        return tower

    def execute(self, requests: list[Any]) -> list[Any]:
        """Every request to the tower's owner at once; one answer each, in order. A refused request
        never affects the next one."""
        answers = [queue.Queue() for _ in requests]
        for request, answer in zip(requests, answers, strict=True):
            self._submit(request, answer)
        return [self._answer(request, answer) for request, answer in zip(requests, answers, strict=True)]

    def finalize(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None
        self.link.close()

    def _submit(self, request: Any, answer: queue.Queue) -> None:
        def cancelled() -> bool:
            return request.is_cancelled() or self._stopping.is_set()

        try:
            self.link.submit(request.inputs(), None, lambda header, blobs: answer.put((header, blobs)), cancelled,
                             final_only=True)
        except EngineUnavailable as exc:
            answer.put((failure_header(WORKERS_DOWN, str(exc)), []))

    def _answer(self, request: Any, answer: queue.Queue) -> Any:
        """The request's response; one whose owner died while it held it is sent again (the link
        waits for the owner the launcher's reload brings back)."""
        retries = ENGINE_LOST_RETRIES
        while True:
            header, blobs = answer.get()
            if retries and engine_lost(header) and not self._stopping.is_set() and not request.is_cancelled():
                retries -= 1
                self.logger.log_warn(f"{self.model_name}: {header.get('message')}; sending the request again")
                time.sleep(ENGINE_LOST_PAUSE_S)
                self._submit(request, answer)
                continue
            try:
                return self._response(header, blobs)
            except Exception as exc:  # noqa: BLE001 - the request ends with its error, the model goes on
                return self._error(failure_header(INTERNAL, INTERNAL.message(f"{type(exc).__name__}: {exc}")))

    def _response(self, header: dict[str, Any], blobs: list[bytes]) -> Any:
        if header.get("type") != "final":
            return self._error(header)
        pb = self.pb
        outputs = unpack_tensors(header.get("tensors"), blobs, [], MAX_ANSWER_BYTES, capsules=True)
        return pb.InferenceResponse(output_tensors=[  # a BF16 prefix arrives as a DLPack capsule
            pb.Tensor(name, value) if hasattr(value, "dtype") else pb.Tensor.from_dlpack(name, value)
            for name, value in outputs.items()])

    def _error(self, header: dict[str, Any]) -> Any:
        status, message = str(header.get("status", "INTERNAL")), str(header.get("message", ""))
        if header.get("reason") == "invalid_input":
            self.logger.log_warn(f"{self.model_name}: refused: {message}")
        code = getattr(self.pb.TritonError, status, self.pb.TritonError.INTERNAL)
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, code))
