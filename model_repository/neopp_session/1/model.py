"""Triton entry point of `neopp_session`; the logic lives in neopp.serving.session_model."""

import sys
from pathlib import Path

_MODEL_DIR = Path(__file__).resolve().parent.parent
try:
    import neopp  # noqa: F401  (installed into the environment, editable or not)
except ImportError:  # repository mounted without installing the package
    sys.path.insert(0, str(_MODEL_DIR.parent.parent / "backend_src"))

from neopp.serving.session_model import SessionTritonModel


class TritonPythonModel(SessionTritonModel):
    pass
