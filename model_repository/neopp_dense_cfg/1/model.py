"""Triton entry point of `neopp_dense_cfg`; the logic lives in neopp.serving.triton_model."""

import sys
from pathlib import Path

_MODEL_DIR = Path(__file__).resolve().parent.parent
try:
    import neopp  # noqa: F401  (installed into the environment, editable or not)
except ImportError:  # repository mounted without installing the package
    sys.path.insert(0, str(_MODEL_DIR.parent.parent / "backend_src"))

from neopp.serving.triton_model import NeoPPTritonModel


class TritonPythonModel(NeoPPTritonModel):
    MODEL_DIR = _MODEL_DIR
