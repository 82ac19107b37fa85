"""The ``neopp`` command line: ``generate``, ``edit``, ``models``, ``status``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ..contract.inputs import CFG_NORMS, MAX_EDIT_IMAGES
from . import info
from .client import DEFAULT_URL, CliError, Server
from .generate import Ask, Bar, check_size, generate, named_number
from .redraw import picture_record, redraw_ask

EPILOG = (f"The server is --url, else NEOPP_URL, else {DEFAULT_URL} (what `make serve` prints; "
          "`make serve HTTP_PORT=9000` is http://127.0.0.1:9000). An API key is read from NEOPP_API_KEY.")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="neopp", description="Draw with a running NeoPP server.", epilog=EPILOG)
    top.add_argument("--url", help=f"the server's HTTP address (default: NEOPP_URL or {DEFAULT_URL})")
    top.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for an answer (default 600)")
    sub = top.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="draw a prompt into image files", epilog=EPILOG)
    gen.add_argument("prompt", nargs="?", help="what to draw (with --from: the record's prompt when left out)")
    _drawing(gen, "outputs/neopp.png")
    edit = sub.add_parser("edit", help="edit pictures as a prompt says, into image files (a checkpoint that "
                                       "can edit: SenseNova-U1)", epilog=EPILOG)
    edit.add_argument("images", nargs="+", type=Path, metavar="IMAGE",
                      help=f"a picture to edit (PNG, JPEG or WebP; up to {MAX_EDIT_IMAGES}, which the prompt names "
                           "Image-1, Image-2 ... in this order)")
    edit.add_argument("prompt", help="what to change")
    _drawing(edit, "outputs/neopp-edit.png")
    edit.add_argument("--image-guidance", type=float, metavar="SCALE",
                      help="how closely the result keeps to the pictures (the official img_cfg_scale; 1: no image "
                           "guidance; default: the model's)")
    for name, what in (("models", "the models that draw, their sizes and step limits"),
                       ("status", "per model: ready, in flight, queued, latency, errors, restarts")):
        cmd = sub.add_parser(name, help=what, epilog=EPILOG)
        cmd.add_argument("--json", action="store_true", help="the server's JSON as it is")
    return top


def _drawing(gen: argparse.ArgumentParser, default_out: str) -> None:
    """The options every drawing command takes: where to write, and the generation's settings."""
    gen.add_argument("-o", "--out", type=Path, default=Path(default_out),
                     help=f"the file to write (.png, .jpg, .webp; n > 1: out-1.png, out-2.png ...; "
                          f"default {default_out})")
    gen.add_argument("--size", type=check_size, help="WIDTHxHEIGHT, e.g. 256x256 (default: the model's)")
    gen.add_argument("--steps", type=int, help="denoising steps (default: the model's)")
    gen.add_argument("--seed", type=int, help="the noise seed (default: random, printed)")
    gen.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: the model's)")
    gen.add_argument("--negative-prompt", "--negative", dest="negative_prompt", help="what the picture should not show")
    gen.add_argument("--model", help="the generation model (neopp models lists them; default neopp_dense)")
    gen.add_argument("-n", type=int, default=1, help="how many pictures (seeds seed, seed+1, ...)")
    gen.add_argument("--lora", type=named_number("lora", "SCALE"), metavar="NAME[:SCALE]",
                     help="an adapter the model offers (neopp models lists them), at SCALE (default its own)")
    gen.add_argument("--cache", type=named_number("cache", "THRESHOLD"), metavar="METHOD[:THRESHOLD]",
                     help="the step cache, e.g. taylorseer (default: none)")
    gen.add_argument("--cfg-norm", choices=CFG_NORMS,
                     help="how the guided velocity is held to the conditional one's norm (default: the model's)")
    gen.add_argument("--shift", type=positive_number, metavar="SHIFT",
                     help="the schedule's time shift, a positive number (default: the model's)")
    gen.add_argument("--think", type=int, nargs="?", const=0, metavar="MAX_TOKENS",
                     help="think mode (U1 checkpoints): the model reasons before drawing, at most MAX_TOKENS "
                          "tokens (default: the server's, 1024); the reasoning is printed")
    gen.add_argument("--from", dest="from_file", type=Path, metavar="PICTURE",
                     help="draw again with the settings a picture this server made records in its file; options "
                          "given here replace the record's")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def positive_number(text: str) -> float:
    """A finite number above 0, or argparse's own one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; 0 on success, 1 when the server refused or failed, 2 for a usage error."""
    ns = parser().parse_args(argv)
    try:
        server = Server.from_url(ns.url, ns.timeout)
        if ns.command in ("generate", "edit"):
            ask = Ask(ns.prompt or "", ns.out, ns.model, ns.size, ns.steps, ns.seed, ns.guidance, ns.negative_prompt,
                      ns.n, ns.lora, ns.cache, ns.think, tuple(getattr(ns, "images", ())),
                      getattr(ns, "image_guidance", None), ns.cfg_norm, ns.shift)
            if ns.from_file is not None:
                ask = redraw_ask(ns, picture_record(ns.from_file), ask)
            elif not ask.prompt:
                raise CliError(f"{ns.command}: the prompt is required (or --from PICTURE)", 2)
            generate(server, ask, Bar(None if ns.quiet else sys.stderr))
            return 0
        return getattr(info, ns.command)(server, as_json=ns.json)
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
