"""``python -m neopp.launcher``: the launcher's command line.

    python -m neopp.launcher serve --model-repository model_repository [-- tritonserver args]
    python -m neopp.launcher prepare-backend
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .admin import AdminKeyError
from .serve_options import add_arguments
from .supervisor import serve
from .triton_install import DEFAULT_BACKEND_DIR, TritonLaunchError, prepare_backend_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neopp.launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run tritonserver in the foreground, behind the HTTP door, kept up")
    add_arguments(s, "model_repository", str(Path("build") / "admin.key"), f"default {DEFAULT_BACKEND_DIR}")
    b = sub.add_parser("prepare-backend", help="only assemble the backend directory and print it")
    b.add_argument("--backend-dir", default=None)
    ns = parser.parse_args(argv)
    try:
        if ns.cmd == "serve":
            return serve(ns)
        print(prepare_backend_dir(ns.backend_dir))  # prepare-backend
        return 0
    except (TritonLaunchError, AdminKeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
