"""What ``model_repository/neopp_t2i/1/model.py`` does: prompt in, image out, over BLS.

Each request goes to the prompt encoder (``encoder_model``, ``neopp_prompt_encoder``) with its
``PROMPT`` and ``NEGATIVE_PROMPT``, then to a generation model (``MODEL``, else
``default_model``) with the encoder's four outputs and the sampling inputs the client gave
(each passed on only when given, so the generation model's mode fills in the rest). A refusal
of either model reaches the client with that model's own message and status.

The generation model must serve the KV geometry of the encoder's checkpoint: a model whose
checkpoint differs (a MoE model next to a dense demo encoder, say) refuses ``COND_KV`` with its
usual geometry message.

Parameters (``config.pbtxt``): ``default_model``, ``allowed_models`` (comma-separated; the plain
generation models by default), ``encoder_model``.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, InputError, shown
from ..limits import text_value
from .error_status import status_of_message
from .parameters import read_parameters
from .session_model import GENERATION_MODELS

T2I_PARAMETERS = {"default_model": "neopp_dense", "allowed_models": ",".join(GENERATION_MODELS),
                  "encoder_model": "neopp_prompt_encoder"}
PROMPT_INPUTS = ("PROMPT", "NEGATIVE_PROMPT")
PASSED_INPUTS = ("SIZE", "SEED", "STEPS", "CFG_SCALE", "CFG_INTERVAL", "CFG_NORM", "TIMESTEP_SHIFT", "OUTPUT_FORMAT")
ENCODER_OUTPUTS = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")


def allowed_models(params: Mapping[str, str]) -> tuple[tuple[str, ...], str]:
    """The allowlist and the default model, checked once at load."""
    allowed = tuple(m.strip() for m in params["allowed_models"].split(",") if m.strip())
    default = params["default_model"].strip()
    if default not in allowed:
        raise ConfigError(f"parameter default_model: {default!r} is not in allowed_models {allowed}")
    return allowed, default


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
        self.allowed, self.default_model = allowed_models(params)
        self.encoder = params["encoder_model"].strip()
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
            encoded = self._call(self.encoder, [inputs[n] for n in PROMPT_INPUTS if n in inputs], ENCODER_OUTPUTS)
            if encoded.has_error():
                return self._forward_error(self.encoder, encoded.error())
            prefix = [pb.get_output_tensor_by_name(encoded, name) for name in ENCODER_OUTPUTS]
            result = self._call(model, prefix + [inputs[n] for n in PASSED_INPUTS if n in inputs], ("IMAGE",))
            if result.has_error():
                return self._forward_error(model, result.error())
            image = pb.get_output_tensor_by_name(result, "IMAGE").as_numpy()
        except InputError as exc:
            return pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG))
        except Exception as exc:  # noqa: BLE001 - the model must stay usable
            self.logger.log_error(f"{self.model_name}: internal error\n{traceback.format_exc()}")
            return pb.InferenceResponse(error=pb.TritonError(f"internal error: {type(exc).__name__}: {exc}",
                                                             pb.TritonError.INTERNAL))
        return pb.InferenceResponse(output_tensors=[pb.Tensor("IMAGE", image)])

    def _call(self, model: str, tensors: list[Any], outputs: tuple[str, ...]) -> Any:
        """One BLS request; the tensors are passed on without a copy here."""
        return self.pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=list(outputs)).exec()

    def _forward_error(self, model: str, error: Any) -> Any:
        """The called model's message with the status it meant (BLS reports every error as INTERNAL)."""
        message = error.message()
        self.logger.log_warn(f"{self.model_name}: {model} refused the request: {shown(message, 300)}")
        return self.pb.InferenceResponse(
            error=self.pb.TritonError(message, getattr(self.pb.TritonError, status_of_message(message))))
