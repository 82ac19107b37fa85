"""Triton entry point of `neopp_dense_stream`; the logic lives in neopp.serving.stream_model."""

from pathlib import Path

from neopp.serving.stream_model import NeoPPStreamModel


class TritonPythonModel(NeoPPStreamModel):
    MODEL_DIR = Path(__file__).resolve().parent.parent
