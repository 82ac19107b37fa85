"""What ``model_repository/neopp_t2i/1/model.py`` does: prompt in, image out, over BLS.

Each request goes to the prompt encoder (``encoder_model``, ``neopp_prompt_encoder``) with its
``PROMPT``, ``NEGATIVE_PROMPT``, ``IMAGES`` (an edit) and think inputs, then to a generation model
(``MODEL``, else ``default_model``) with the encoder's prefixes and offsets (an edit's image-only
branch included) and the sampling inputs the client gave
(each passed on only when given, so the generation model's mode fills in the rest). A refusal
of either model reaches the client with that model's own message and status.

The generation model must serve the KV geometry of the encoder's checkpoint: a model whose
checkpoint differs (a MoE model next to a dense demo encoder, say) refuses ``COND_KV`` with its
usual geometry message.

Parameters (``config.pbtxt``): ``default_model``, ``allowed_models`` (comma-separated; the plain
generation models by default), ``encoder_model``, ``default_size`` (``HxW`` sent when the client
gives no ``SIZE``; unset: no SIZE is sent and the generation model draws its own default, the
size its checkpoint names, e.g. the demo's 256x256).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..contract.inputs import EDIT_OUTPUTS, ENCODER_OUTPUTS
from ..contract.sizes import height_width
from ..contract.statuses import MISCONFIGURED
from ..errors import ConfigError, GenerationCancelled, InputError, shown
from ..limits import text_value
from .error_status import error_response, forwarded_error
from .lanes import forwarded_lane
from .model_io import T2I_PASSED_INPUTS as PASSED_INPUTS
from .parameters import model_allowlist, read_parameters
from .prompt_parsing import ENCODER_INPUTS, PromptRequest, parse_prompts

T2I_PARAMETERS = {"default_model": "neopp_dense", "allowed_models": "",
                  "encoder_model": "neopp_prompt_encoder", "default_size": ""}


def default_size(text: str) -> np.ndarray | None:
    """``HxW`` (the SIZE sent when the client gives none), checked once at load; empty: send none."""
    if not text.strip():
        return None
    try:
        height, width = height_width(text)
    except ValueError as exc:
        raise ConfigError(f"parameter default_size: {exc}: it must be HxW, e.g. 256x256") from exc
    if height <= 0 or width <= 0 or height % 32 or width % 32:
        raise ConfigError(f"parameter default_size: {text!r} must be positive multiples of 32")
    return np.array([height, width], dtype=np.int64)


def chosen_model(value: Any, allowed: tuple[str, ...], default: str) -> str:
    """``MODEL`` (a STRING [1] numpy array, or None when absent) checked against the allowlist."""
    if value is None:
        return default
    if value.shape != (1,):
        raise InputError(f"MODEL: shape must be [1], got {list(value.shape)}")
    model = text_value("MODEL", value.reshape(-1)[0])
    if model not in allowed:
        raise InputError(f"MODEL: {shown(model)} is not a generation model this server offers; "
                         f"expected one of {list(allowed)}")
    return model


class T2ITritonModel:
    """Triton Python-backend model ``neopp_t2i`` (BLS: encoder, then a generation model)."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb, self.logger = pb_utils, pb_utils.Logger
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "neopp_t2i"))
        params = read_parameters(config, T2I_PARAMETERS)
        self.allowed, self.default_model = model_allowlist(params, args["model_repository"])
        self.encoder = params["encoder_model"].strip()
        self.default_size = default_size(params["default_size"])
        self.logger.log_info(f"{self.model_name}: encoder {self.encoder}, default model {self.default_model}, "
                             f"allowed {list(self.allowed)}")

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._serve(request) for request in requests]

    def finalize(self) -> None:
        pass

    def _serve(self, request: Any) -> Any:
        pb = self.pb
        inputs = {tensor.name(): tensor for tensor in request.inputs()}
        try:
            model = chosen_model(inputs["MODEL"].as_numpy() if "MODEL" in inputs else None,
                                 self.allowed, self.default_model)
            # Checked here too, so an oversized prompt is refused before it is copied to the encoder.
            prompts = parse_prompts({n: inputs[n].as_numpy() for n in ENCODER_INPUTS if n in inputs})
            lane = forwarded_lane(request)
            self._check_cancelled(request)
            branches = (*ENCODER_OUTPUTS, *(EDIT_OUTPUTS if "IMAGES" in inputs else ()))
            encoded = self._call(self.encoder, [inputs[n] for n in ENCODER_INPUTS if n in inputs],
                                 (*branches, "THINK_TEXT"))
            if encoded.has_error():
                return self._forward_error(self.encoder, encoded.error())
            prefix = [pb.get_output_tensor_by_name(encoded, name) for name in branches]
            passed = [inputs[n] for n in PASSED_INPUTS if n in inputs] + self._recorded(prompts)
            if "SIZE" not in inputs and self.default_size is not None:
                passed.append(pb.Tensor("SIZE", self.default_size))
            self._check_cancelled(request)
            result = self._call(model, prefix + passed, ("IMAGE",), lane)
            if result.has_error():
                return self._forward_error(model, result.error())
            image = pb.get_output_tensor_by_name(result, "IMAGE").as_numpy()
            reasoning = pb.get_output_tensor_by_name(encoded, "THINK_TEXT").as_numpy()
        except Exception as exc:  # noqa: BLE001 - every failure is answered; the model stays usable
            return error_response(pb, exc, self.logger, self.model_name)
        return pb.InferenceResponse(output_tensors=[pb.Tensor("IMAGE", image), pb.Tensor("THINK_TEXT", reasoning)])

    def _call(self, model: str, tensors: list[Any], outputs: tuple[str, ...],
              parameters: dict[str, str] | None = None) -> Any:
        """One BLS request; the tensors are passed on without a copy here."""
        return self.pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=list(outputs),
                                        parameters=parameters or {}).exec()

    def _recorded(self, prompts: PromptRequest) -> list[Any]:
        """The picture's record: the prompts (kept where the generation model allows) and think mode."""
        texts = {"RECORD_PROMPT": prompts.prompt, "RECORD_NEGATIVE_PROMPT": prompts.negative_prompt or None}
        think = np.array([prompts.think_max_tokens if prompts.think else 0], dtype=np.int64)
        return [*(self.pb.Tensor(name, np.array([text.encode()], dtype=np.object_))
                  for name, text in texts.items() if text is not None),
                self.pb.Tensor("RECORD_THINK", think)]

    @staticmethod
    def _check_cancelled(request: Any) -> None:
        """Before each call: a generation already running is not stopped from here."""
        if request.is_cancelled():
            raise GenerationCancelled("before the encoder or the generation model ran")

    def _forward_error(self, model: str, error: Any) -> Any:
        """The called model's message with the status it meant (BLS reports every error as INTERNAL).

        The client never sends the prefix tensors: a refusal that names one is a deployment fault
        (the generation model does not serve the encoder checkpoint's geometry), not a bad request."""
        message = error.message()
        self.logger.log_warn(f"{self.model_name}: {model} refused the request: {shown(message, 300)}")
        if model != self.encoder and any(name in message for name in (*ENCODER_OUTPUTS, *EDIT_OUTPUTS)):
            message = MISCONFIGURED.message(f"{model} does not take {self.encoder}'s prefix "
                                            f"(checkpoints of another geometry?): {message}")
            return forwarded_error(self.pb, message, MISCONFIGURED.status)
        return forwarded_error(self.pb, message)
