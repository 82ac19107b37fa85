"""Triton entry point of `neopp_moe`; the logic lives in neopp.serving.triton_model."""

from pathlib import Path

from neopp.serving.triton_model import NeoPPTritonModel


class TritonPythonModel(NeoPPTritonModel):
    MODEL_DIR = Path(__file__).resolve().parent.parent
