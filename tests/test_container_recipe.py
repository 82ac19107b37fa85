"""The container recipe stays what the README says and what the development machines run: the
same pinned runtime versions, the Triton release the clients match, loopback-only ports."""

from __future__ import annotations

import re

from testing import REPO

DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
COMPOSE = (REPO / "docker" / "compose.yaml").read_text()
# NVIDIA's container release for each tritonserver version the clients may pin.
CONTAINER_OF_SERVER = {"2.51.0": "24.10"}


def pins(text: str) -> dict[str, str]:
    return {name.lower(): version for name, version in re.findall(r"([A-Za-z][\w-]*)(?:\[[\w,]+\])?==([\w.]+)", text)}


def test_runtime_pins_equal_the_requirements() -> None:
    required, image = pins((REPO / "requirements.txt").read_text()), pins(DOCKERFILE)
    assert set(image) == {"torch", "numpy", "safetensors", "pillow", "tokenizers", "gguf", "tritonclient", "starlette",
                          "uvicorn", "h11", "c2pa-python", "cryptography"}
    assert all(image[name] == required[name] for name in image), (image, required)


def test_base_image_is_the_release_of_the_client_version() -> None:
    (tag,) = re.findall(r"^FROM nvcr\.io/nvidia/tritonserver:(\S+)-py3$", DOCKERFILE, re.MULTILINE)
    assert tag == CONTAINER_OF_SERVER[pins((REPO / "requirements.txt").read_text())["tritonclient"]]


def test_entry_point_is_the_launcher_with_its_defaults() -> None:
    script = (REPO / "docker" / "entrypoint.sh").read_text()
    assert "-m neopp.launcher serve" in script and "--admin-key-file" in script
    assert 'ENTRYPOINT ["/usr/local/bin/neopp-serve"]' in DOCKERFILE
    assert "NEOPP_TRITONSERVER_ROOT=/opt/tritonserver" in DOCKERFILE


def test_compose_publishes_on_loopback_and_mounts_read_only() -> None:
    ports = re.findall(r'^\s+- "([^"]+)"$', COMPOSE, re.MULTILINE)
    assert ports and all(p.startswith("127.0.0.1:") for p in ports)
    assert ":/models/neopp:ro" in COMPOSE


def test_readme_uses_this_recipe() -> None:
    readme = (REPO / "README.md").read_text()
    assert "docker compose -f docker/compose.yaml up --build" in readme
    assert "docker run" not in readme or "neopp-triton:0.1.0" in readme
    # No install at container start: the container's paragraphs install nothing (outside the container
    # the README may say how to get CUDA torch into the venv), nor does its entry point.
    guide = (REPO / "docs" / "deployment.md").read_text()
    container = guide.split("## NVIDIA's Triton container", 1)[1].split("\n## ", 1)[0]
    assert "docker compose -f docker/compose.yaml up --build" in container and "pip install" not in container
    assert "pip install" not in (REPO / "docker" / "entrypoint.sh").read_text()


def test_the_server_runs_as_an_unprivileged_user() -> None:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.MULTILINE)
    uid, gid = users[-1].split(":")
    assert int(uid) >= 1000 and int(gid) >= 1000  # numeric, so Kubernetes can check runAsNonRoot
    assert f"--uid {uid} " in DOCKERFILE and "--home-dir /var/lib/neopp" in DOCKERFILE
    assert "NEOPP_STATE_DIR=/var/lib/neopp" in DOCKERFILE


def test_the_entry_point_keeps_every_file_it_writes_in_the_state_dir() -> None:
    script = (REPO / "docker" / "entrypoint.sh").read_text()
    assert '--admin-key-file "$state/admin.key"' in script and '--api-key-file "$state/api.key"' in script
    assert "$NEOPP_ADMIN_KEY" not in script and "$NEOPP_API_KEY" not in script  # never on a command line


def test_compose_drops_every_privilege() -> None:
    assert "read_only: true" in COMPOSE and "- ALL" in COMPOSE and "no-new-privileges:true" in COMPOSE
    assert re.search(r"tmpfs:\n\s+- /tmp\n", COMPOSE) and "neopp-state:/var/lib/neopp" in COMPOSE
