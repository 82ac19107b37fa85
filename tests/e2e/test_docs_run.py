"""Every command and code block of the README and docs/ runs as written, or says it is a sketch.

A fenced block names its language: ``bash`` and ``python`` blocks run here, against a server
started as ``make serve`` starts it (the demo model, the door in front, an operator key), from a
folder that looks like the checkout; only the addresses are this server's (``localhost:8000``,
``8001``, ``8002`` become its free ports, and every client finds it through ``NEOPP_URL`` alone: the
``neopp`` command, and the client examples, the gRPC ones through the door's ``/neopp/addresses``). What a block
writes goes under ``outputs/`` (ignored by git) or ``build/``, never beside the checkout's own
files. A block that cannot run here (a real checkpoint, a GPU machine, a container) says
``sketch`` after its language; data and output are ``json``/``text``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from testing import REPO
from testing.launched import Launched, launch

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "client_examples" / "README.md"]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RUNS = ("bash", "python")
KNOWN = {*RUNS, "json", "text"}
MODELS = ("neopp_dense", "neopp_dense_8steps", "neopp_dense_stream", "neopp_prompt_encoder", "neopp_t2i",
          "neopp_session")
DEMO = REPO / "demo" / "checkpoints"
LINKED = ("backend_src", "client_examples", "configs", "demo", "model_repository", "scripts", ".venv", "Makefile",
          "pyproject.toml", "requirements.txt")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    sketch: bool
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        doc = path.read_text()
        for m in FENCE.finditer(doc):
            words = m.group(1).split()
            found.append(Block(path, doc[:m.start()].count("\n") + 1, words[0] if words else "",
                               "sketch" in words[1:], m.group(2)))
    return found


BLOCKS = blocks()
RUNNABLE = [b for b in BLOCKS if b.language in RUNS and not b.sketch]


def test_every_block_names_its_language():
    unnamed = [f"{b.id} ({b.language or 'no language'})" for b in BLOCKS if b.language not in KNOWN]
    assert not unnamed, f"name the language of these blocks ({sorted(KNOWN)}, 'sketch' if it cannot run): {unnamed}"
    assert len(RUNNABLE) >= 10, "the docs' runnable examples are most of them"


@dataclass
class Site:
    """The served checkout-like folder and the server's addresses."""

    root: Path
    launched: Launched
    env: dict[str, str]

    def rewrite(self, text: str) -> str:
        ports = {"8000": self.launched.http_port, "8001": self.launched.grpc_port, "8002": self.launched.metrics_port}
        return re.sub(r"localhost:(800[012])\b", lambda m: f"127.0.0.1:{ports[m.group(1)]}", text)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    root = tmp_path_factory.mktemp("checkout")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / "build").mkdir()
    env = {"NEOPP_CHECKPOINT": str(DEMO / "dense"), "NEOPP_LORA_DIR": str(DEMO / "lora"),
           "NEOPP_CHECKPOINT_NEOPP_MOE": str(DEMO / "moe")}
    launched = launch(root / "launcher.log", env, MODELS, launcher_args=["--admin-key-file",
                                                                         str(root / "build" / "admin.key")])
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{launched.grpc_port}")
        deadline = time.monotonic() + 300
        while not all(_ready(client, m) for m in MODELS):
            assert launched.proc.poll() is None, launched.text()[-3000:]
            assert time.monotonic() < deadline, launched.text()[-3000:]
            time.sleep(0.5)
        client.close()
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("NEOPP_")}
        run_env.update(NEOPP_URL=f"http://127.0.0.1:{launched.http_port}", PYTHONUNBUFFERED="1",
                       PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # as activated
        yield Site(root, launched, run_env)
    finally:
        assert launched.stop() == 0, launched.text()[-3000:]
        assert not launched.leftovers(), "the launcher left processes behind"


def _ready(client: grpcclient.InferenceServerClient, model: str) -> bool:
    try:
        return client.is_model_ready(model)
    except Exception:  # noqa: BLE001 - the server is still starting
        return False


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_the_block_runs_as_written(site: Site, block: Block):
    text = site.rewrite(block.text)
    before = {p.name for p in site.root.iterdir()}
    cmd = ["bash", "-e", "-o", "pipefail", "-c", text] if block.language == "bash" else [sys.executable, "-c", text]
    done = subprocess.run(cmd, cwd=site.root, env=site.env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.id} failed:\n{text}\n--- stdout\n{done.stdout[-3000:]}\n" \
                                 f"--- stderr\n{done.stderr[-3000:]}"
    strays = sorted({p.name for p in site.root.iterdir()} - before - {"outputs", "build"})
    assert not strays, f"{block.id} wrote {strays} into the checkout: write under outputs/ (ignored by git)"
