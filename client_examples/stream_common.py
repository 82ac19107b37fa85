"""What stream_grpc.py and stream_http.py add to the t2i flags: the streaming model, previews,
a progress bar."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from t2i_common import build_parser


def stream_parser(description: str, default_url: str, script: str) -> argparse.ArgumentParser:
    p = build_parser(description, default_url, script, " \\\n    --preview-every 5 --preview-dir outputs/previews")
    p.set_defaults(model="neopp_dense_stream")
    p.add_argument("--preview-every", type=int, default=0, metavar="N",
                   help="a JPEG preview every N steps (PREVIEW_EVERY; default 0: none)")
    p.add_argument("--preview-size", type=int, nargs=2, metavar=("H", "W"),
                   help="preview size (PREVIEW_SIZE; default: the image scaled to a longer side of 256)")
    p.add_argument("--preview-dir", type=Path, default=None,
                   help="save previews here as step_NNN.jpg (default: not saved)")
    return p


def show_progress(step: int, total: int, width: int = 30) -> None:
    """One line on stderr, redrawn in place: [#####.....] 5/10. Into a file or a pipe (a log), a
    plain line at the first step (it has started) and at each quarter instead, so a log holds no
    carriage-return frames."""
    done = width * step // max(total, 1)
    bar = f"[{'#' * done}{'.' * (width - done)}] {step}/{total}"
    if not sys.stderr.isatty():
        if step in (1, total) or 4 * step // max(total, 1) > 4 * (step - 1) // max(total, 1):
            sys.stderr.write(bar + "\n")
    else:
        sys.stderr.write("\r" + bar + ("\n" if step >= total else ""))
    sys.stderr.flush()


def save_preview(args: argparse.Namespace, step: int, jpeg: bytes) -> None:
    if args.preview_dir is not None:
        args.preview_dir.mkdir(parents=True, exist_ok=True)
        (args.preview_dir / f"step_{step:03d}.jpg").write_bytes(jpeg)
