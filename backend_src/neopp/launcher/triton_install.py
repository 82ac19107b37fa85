"""Where the tritonserver files are, and the environment the server starts in.

Two layouts: the ``nvidia-pytriton`` wheel's (``make serve`` on machines without NVIDIA's
container; the Python backend then needs a backend directory with the stub for this
interpreter, assembled by ``prepare_backend_dir``) and NVIDIA's container's, under
``$NEOPP_TRITONSERVER_ROOT`` (``/opt/tritonserver``).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Relative to the working directory (the checkout for `make serve`), never to the installed package.
DEFAULT_BACKEND_DIR = Path("build") / "triton_backends"
# glibc settings that return freed request buffers to the system (the reason: tritonserver.py)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_TOP_PAD_": "0",
              "MALLOC_ARENA_MAX": "1"}


# The loader's default folders: an interpreter whose LIBDIR is one of them needs no LD_LIBRARY_PATH entry.
SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                   "/lib/aarch64-linux-gnu", "/usr/lib/aarch64-linux-gnu")
# A tritonserver installed as in NVIDIA's container (bin/, lib/, backends/python/) instead of the wheel.
SYSTEM_ROOT_ENV = "NEOPP_TRITONSERVER_ROOT"


class TritonLaunchError(RuntimeError):
    """The server could not be found, prepared, started or made ready."""


@dataclass(frozen=True)
class TritonInstall:
    """Where the wheel's server files live in the running environment."""

    site_packages: Path
    server_bin: Path
    python_backend: Path  # folder with libtriton_python.so + triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for this interpreter's major.minor
    libs: Path  # <site-packages>/nvidia_pytriton.libs


def python_tag() -> str:
    """``major.minor`` of the running interpreter: selects the matching stub."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def site_packages_candidates() -> list[Path]:
    """purelib/platlib first, then every sys.path entry (covers user installs)."""
    paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path]
    return [Path(p) for p in dict.fromkeys(paths) if p and Path(p).is_dir()]


def system_install(root: Path) -> TritonInstall:
    """tritonserver installed under ``root`` as in NVIDIA's container (/opt/tritonserver)."""
    python_backend = root / "backends" / "python"
    install = TritonInstall(site_packages=root, server_bin=root / "bin" / "tritonserver",
                            python_backend=python_backend, stub=python_backend / "triton_python_backend_stub",
                            libs=root / "lib")
    for path in (install.server_bin, python_backend / "libtriton_python.so", install.stub):
        if not path.exists():
            raise TritonLaunchError(f"${SYSTEM_ROOT_ENV}={root}: no {path}")
    return install


def find_install() -> TritonInstall:
    """Locate tritonserver: under ``$NEOPP_TRITONSERVER_ROOT`` if set, else the wheel's files."""
    if os.environ.get(SYSTEM_ROOT_ENV):
        return system_install(Path(os.environ[SYSTEM_ROOT_ENV]))
    for sp in site_packages_candidates():
        root = sp / "pytriton" / "tritonserver"
        if not (root / "bin" / "tritonserver").is_file():
            continue
        stub = root / "python_backend_stubs" / python_tag() / "triton_python_backend_stub"
        install = TritonInstall(site_packages=sp, server_bin=root / "bin" / "tritonserver",
                                python_backend=root / "backends" / "python", stub=stub,
                                libs=sp / "nvidia_pytriton.libs")
        for path in (install.python_backend / "libtriton_python.so", stub, install.libs):
            if not path.exists():
                raise TritonLaunchError(f"nvidia-pytriton install at {sp} lacks {path}")
        return install
    raise TritonLaunchError(f"tritonserver not found: install nvidia-pytriton==0.7.0 into {sys.prefix}")


def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy keeping the mode; skip when size and mtime already match (cheap reruns)."""
    if dst.exists():
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and int(s.st_mtime) == int(d.st_mtime):
            return
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")  # concurrent preparers do not collide
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def prepare_backend_dir(dest: Path | str | None = None, install: TritonInstall | None = None) -> Path:
    """Assemble ``<dest>/python/`` so the Python backend finds a stub for this interpreter."""
    install = install or find_install()
    dest = Path(dest) if dest is not None else DEFAULT_BACKEND_DIR
    py_dir = dest / "python"
    py_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy_if_changed(install.python_backend / name, py_dir / name)
    _copy_if_changed(install.stub, py_dir / "triton_python_backend_stub")
    return dest


def venv_bin() -> Path:
    """The bin folder of the running interpreter's environment (venv or not)."""
    return Path(sys.prefix) / "bin"


def prepend_path(value: str | None, *first: str) -> str:
    parts = [p for p in first if p] + [p for p in (value or "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def server_env(install: TritonInstall | None = None, base: dict[str, str] | None = None,
               malloc_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: interpreter LIBDIR before the wheel's libs, venv bin first,
    and ``malloc_env`` (default MALLOC_ENV) unless ``base`` sets those variables itself."""
    install = install or find_install()
    env = dict(os.environ if base is None else base)
    for name, value in (MALLOC_ENV if malloc_env is None else malloc_env).items():
        env.setdefault(name, value)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    if libdir.rstrip("/") in SYSTEM_LIB_DIRS:  # found there anyway; first on the path it would shadow
        libdir = ""  # the libraries torch brings with it (a system cuDNN or NCCL over pip's)
    env["LD_LIBRARY_PATH"] = prepend_path(env.get("LD_LIBRARY_PATH"), libdir, str(install.libs))
    env["PATH"] = prepend_path(env.get("PATH"), str(venv_bin()))
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env.pop("PYTHONHOME", None)
    return env
