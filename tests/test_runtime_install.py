"""The installed runtime stands alone: a fresh venv holding only the package and its declared
dependencies imports every module of it, and carries none of the test or benchmark harness nor the demo task.
The launcher's HTTP door (``neopp.launcher.door``) runs in the launcher only and needs the ``serve`` extra
(uvicorn, starlette, grpc): its modules are left out of the runtime venv's probe."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("torch", "numpy", "safetensors", "pillow")

PROBE = r"""
import importlib, json, pkgutil, sys
import neopp
names = sorted(m.name for m in pkgutil.walk_packages(neopp.__path__, "neopp."))
for name in names:
    if not name.startswith("neopp.launcher.door."):  # the serve extra's
        importlib.import_module(name)
foreign = sorted({m.split(".")[0] for m in sys.modules} & {"tritonclient", "pytriton", "matplotlib", "pytest"})
missing = [n for n in ("testing", "bench", "demo") if importlib.util.find_spec(n) is not None]
print(json.dumps({"modules": names, "file": neopp.__file__, "foreign": foreign, "harness": missing}))
"""


def runtime_pins() -> list[str]:
    """The pinned versions of the declared runtime dependencies (the same as the dev venv's)."""
    pins = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        name = re.split(r"[=<>\[ ]", line.strip(), maxsplit=1)[0].lower()
        if name in RUNTIME:
            pins.append(line.strip())
    assert len(pins) == len(RUNTIME), pins
    return pins


def test_fresh_runtime_venv_imports_every_module(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    src = tmp_path / "src"  # a clean copy: a checkout's build/ may hold modules that no longer exist
    shutil.copytree(
        ROOT / "backend_src", src / "backend_src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    shutil.copy2(ROOT / "pyproject.toml", src / "pyproject.toml")
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src), *runtime_pins()],
        check=True,
        timeout=900,
        cwd=tmp_path,
    )
    probe = subprocess.run([str(py), "-c", PROBE], timeout=300, cwd=tmp_path, capture_output=True, text=True)
    assert probe.returncode == 0, f"a runtime module does not import with only its dependencies:\n{probe.stderr}"
    report = json.loads(probe.stdout.strip().splitlines()[-1])
    assert str(env_dir) in report["file"], "the package was imported from the checkout, not the venv"
    assert report["foreign"] == [], f"runtime modules import {report['foreign']}"
    assert report["harness"] == [], f"installed alongside the runtime: {report['harness']}"
    assert {"neopp.sampling.pipeline", "neopp.serving.triton_model", "neopp.engines.rank_pool",
            "neopp.tools.replay_kv"} <= set(report["modules"])
    assert not any(m.startswith(("neopp.bench", "neopp.tiny_checkpoint")) for m in report["modules"])
