"""Test and load harness: tiny checkpoints, request fuzzing, load generation, fault injection, soak.

Not part of the installed runtime: the tests, ``make soak`` and the benchmarks import it from
the repository root.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO / "model_repository"


def lightllm_client_module() -> ModuleType:
    """``client_examples/lightllm_client.py``, a standalone file (not a package), loaded as users run it."""
    folder = str(REPO / "client_examples")
    if folder not in sys.path:  # as when run as a script: its sibling modules import by name
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("lightllm_client", REPO / "client_examples" / "lightllm_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
