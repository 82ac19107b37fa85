"""One archive that brings the real tritonserver to a GPU machine without a network or a container.

    python -m deploy.gpu_bundle [--out build/gpu-bundle.tar.xz] [--python 3.12]      (make gpu-bundle)

It holds, laid out as NVIDIA's container lays out ``/opt/tritonserver`` (so the launcher takes it
with ``NEOPP_TRITONSERVER_ROOT``):

* ``tritonserver/bin/tritonserver`` and ``tritonserver/lib/``: the server of the pinned
  ``nvidia-pytriton`` wheel and every shared library it and its Python backend link that the wheel
  carries (found by following the binaries' DT_NEEDED entries, not by copying the whole folder);
* ``tritonserver/backends/python/``: the Python backend and the stub built for ``--python``;
* ``tritonserver/bin/perf_analyzer`` with the two libraries a bare machine lacks (libb64 and the
  CUDA 12 runtime);
* ``site/``: the client and serving packages for ``--python`` (tritonclient, grpcio, protobuf,
  rapidjson, Pillow, safetensors, numpy 1.x, packaging, at the versions installed here),
  installed by pip for that interpreter and platform, to put first on ``PYTHONPATH`` there (the
  machine's own torch is used);
* ``MANIFEST.json``: what went in, the versions, and each file's size and sha256.

The system's C and C++ runtimes, OpenSSL, zlib and ``libpython3.X.so`` come from the machine.
Built here from what ``make setup`` installed, plus pip's downloads from the package index.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neopp.launcher.triton_install import TritonInstall

# What the machine must have itself: the loader, the C/C++ runtimes, OpenSSL, zlib, libpython.
SYSTEM_LIBS = re.compile(r"^(ld-linux.*|lib(c|m|dl|rt|pthread|resolv|gcc_s|stdc\+\+|z|ssl|crypto|python3\.\d+)\.so.*)$")
# Installed at the versions this environment runs and tests (tritonclient's is pinned in requirements.txt).
# numpy: the Python backend's stub of this server release reads arrays as numpy 1.x lays them out.
# tokenizers: the prompt encoder reads a checkpoint's tokenizer.json with it (its hub client is not needed).
SITE_PACKAGES = ("tritonclient", "grpcio", "protobuf", "python-rapidjson", "pillow", "safetensors", "numpy",
                 "packaging", "tokenizers")


def needed(binary: Path) -> list[str]:
    """The shared libraries ``binary`` names (its DT_NEEDED entries), read with binutils' readelf."""
    try:
        out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise SystemExit("readelf not found: install binutils") from None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


def library_closure(roots: list[Path], search: list[Path]) -> tuple[list[Path], list[str]]:
    """Every library the roots load, transitively, found in ``search``; and the system ones left out."""
    found: dict[str, Path] = {}
    system: set[str] = set()
    todo = list(roots)
    while todo:
        for name in needed(todo.pop()):
            if name in found or name in system:
                continue
            if SYSTEM_LIBS.match(name):
                system.add(name)
                continue
            path = next((d / name for d in search if (d / name).is_file()), None)
            if path is None:
                raise SystemExit(f"{name} (needed by the bundle's binaries) is not in {', '.join(map(str, search))}")
            found[name] = path
            todo.append(path)
    return sorted(found.values()), sorted(system)


def server_files(install: TritonInstall, python: str) -> tuple[dict[str, Path], list[str]]:
    """Bundle path -> source path for the server, the Python backend and the stub of ``python``;
    and the system libraries they need from the machine."""
    from bench.perf_analyzer import cuda_runtime_lib_dir  # building needs this checkout's environment;
    from neopp.launcher.triton_install import SYSTEM_LIB_DIRS, venv_bin  # unpacking: only the stdlib

    root = install.server_bin.parent.parent
    stub = root / "python_backend_stubs" / python / "triton_python_backend_stub"
    if not stub.is_file():
        raise SystemExit(f"the nvidia-pytriton wheel has no Python backend stub for Python {python} ({stub})")
    perf = venv_bin() / "perf_analyzer"
    files = {
        "tritonserver/bin/tritonserver": install.server_bin,
        "tritonserver/bin/perf_analyzer": perf,
        "tritonserver/backends/python/libtriton_python.so": install.python_backend / "libtriton_python.so",
        "tritonserver/backends/python/triton_python_backend_utils.py":
            install.python_backend / "triton_python_backend_utils.py",
        "tritonserver/backends/python/triton_python_backend_stub": stub,
    }
    search = [install.libs, *(d for d in [cuda_runtime_lib_dir()] if d), *map(Path, SYSTEM_LIB_DIRS)]
    libs, system = library_closure([files[k] for k in files if not k.endswith(".py")], search)
    files.update({f"tritonserver/lib/{lib.name}": lib for lib in libs})
    return files, system


def site_requirements() -> list[str]:
    """``name==version`` of each site package as installed here."""
    return [f"{name}=={metadata.version(name)}" for name in SITE_PACKAGES]


def install_site(target: Path, python: str) -> None:
    """pip installs the client and serving packages for ``python`` on x86-64 Linux into ``target``."""
    cmd = [sys.executable, "-m", "pip", "install", "-qq", "--target", str(target), "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--platform", "manylinux2014_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "--no-deps",
           *site_requirements()]
    subprocess.run(cmd, check=True)
    shutil.rmtree(target / "bin", ignore_errors=True)  # tritonclient's copies of perf_analyzer: bundled once
    for cache in target.rglob("__pycache__"):
        shutil.rmtree(cache)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(out: Path, python: str, with_site: bool = True, compression: str = "xz") -> Path:
    """Write the archive (``compression``: xz for carrying, gz for a quick local check)."""
    from neopp.launcher.triton_install import find_install

    install = find_install()
    with tempfile.TemporaryDirectory(prefix="neopp_bundle_") as tmp:
        top = Path(tmp) / "neopp-gpu-bundle"
        carried, system = server_files(install, python)
        for rel, src in carried.items():
            dst = top / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        if with_site:
            install_site(top / "site", python)
        files = sorted(p for p in top.rglob("*") if p.is_file())
        manifest = {"python": python, "tritonserver": "2.51.0 (nvidia-pytriton 0.7.0)",
                    "site_packages": site_requirements() if with_site else [],
                    "system_libraries": system,
                    "files": {str(p.relative_to(top)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
                              for p in files}}
        (top / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        mode = {"xz": "w:xz", "gz": "w:gz"}[compression]
        options = {"preset": 9} if compression == "xz" else {"compresslevel": 1}
        with tarfile.open(partial, mode, **options) as tar:
            tar.add(top, arcname=top.name)
        os.replace(partial, out)
    return out


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack into ``dest`` (the archive's own folder inside); returns the tritonserver root."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "neopp-gpu-bundle" / "tritonserver"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("build/gpu-bundle.tar.xz"))
    p.add_argument("--python", default="3.12", help="the GPU machine's Python major.minor")
    p.add_argument("--no-site", action="store_true", help="leave out the Python packages")
    p.add_argument("--compression", choices=("xz", "gz"), default="xz")
    p.add_argument("--unpack", type=Path, help="unpack this archive into --out (a folder) instead of building")
    a = p.parse_args(argv)
    if a.unpack:
        print(unpack(a.unpack, a.out))
        return 0
    out = build(a.out, a.python, not a.no_site, a.compression)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
