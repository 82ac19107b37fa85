"""Triton entry point of `neopp_prompt_encoder`; the logic lives in neopp.serving.prompt_encoder_model."""

from pathlib import Path

from neopp.serving.prompt_encoder_model import PromptEncoderTritonModel


class TritonPythonModel(PromptEncoderTritonModel):
    MODEL_DIR = Path(__file__).resolve().parent.parent
