"""``neopp generate`` and ``neopp edit``: a prompt (and pictures) in, picture files out, with a
progress bar while it draws.

One picture streams through ``/v1/images/generations`` (an edit: ``/v1/images/edits``, a form
with the pictures) with a preview and per-step progress (the model's streamed twin); a model
without one, or ``n`` above 1, streams each finished picture instead. Files are named after
``-o``: ``out.png``, or ``out-1.png`` ... for ``n`` > 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..contract.image_formats import FORMAT_OF_SUFFIX
from ..contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES
from ..contract.sizes import is_openai_size
from .client import CliError, Form, Server, checked, error_message, events

PATH = "/v1/images/generations"
EDIT_PATH = "/v1/images/edits"
MAX_ERROR = 1 << 20  # an error answer is a short JSON document


@dataclass(frozen=True)
class Ask:
    """What the person asked for, as the command line says it."""

    prompt: str
    out: Path
    model: str | None = None
    size: str | None = None
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    n: int = 1
    lora: tuple[str, float | None] | None = None  # an adapter's name and its scale
    cache: tuple[str, float | None] | None = None  # a step-cache method and its threshold
    think: int | None = None  # think mode: its token cap (0: the server's default); None: off
    images: tuple[Path, ...] = ()  # an edit's pictures, in the order the prompt names them
    image_guidance: float | None = None  # an edit's guidance towards its pictures
    cfg_norm: str | None = None  # the guidance's renormalisation
    shift: float | None = None  # the schedule's time shift
    cfg_interval: tuple[float, float] | None = None  # the times guidance runs at (a redraw's record gives it)

    @property
    def path(self) -> str:
        return EDIT_PATH if self.images else PATH

    def request(self, previews: bool) -> dict[str, Any] | Form:
        """A generation's JSON body, or an edit's form: the same fields and the pictures as files."""
        doc = self.body(previews)
        if not self.images:
            return doc
        return Form(doc, [("image[]", path.name, data) for path, data in zip(self.images, pictures(self.images))])

    def body(self, previews: bool) -> dict[str, Any]:
        """The streamed generations request (OpenAI's parameters plus NeoPP's ``seed``, steps,
        guidance...); with ``previews``, per-step progress and one preview too."""
        doc: dict[str, Any] = {"prompt": self.prompt, "n": self.n, "output_format": output_format(self.out),
                               "stream": True}
        optional = {"model": self.model, "size": self.size, "num_inference_steps": self.steps, "seed": self.seed,
                    "guidance_scale": self.guidance, "negative_prompt": self.negative_prompt}
        if self.lora is not None:
            optional.update(lora=self.lora[0], lora_scale=self.lora[1])
        if self.cache is not None:
            optional.update(cache=self.cache[0], cache_threshold=self.cache[1])
        if self.think is not None:
            optional.update(think=True, think_max_tokens=self.think or None)
        if self.image_guidance is not None:
            optional.update(image_guidance_scale=self.image_guidance)
        optional.update(cfg_norm=self.cfg_norm, timestep_shift=self.shift,
                        cfg_interval=list(self.cfg_interval) if self.cfg_interval else None)
        doc.update({k: v for k, v in optional.items() if v is not None})
        if previews:
            doc.update(partial_images=1, progress=True)
        return doc


def output_format(out: Path) -> str:
    """The image format the file name asks for; a name without one we write is a usage error."""
    fmt = FORMAT_OF_SUFFIX.get(out.suffix.lower())
    if fmt is None:
        raise CliError(f"-o {out}: the file must end in one of {', '.join(sorted(FORMAT_OF_SUFFIX))}", 2)
    return fmt


def pictures(files: tuple[Path, ...]) -> list[bytes]:
    """The pictures' bytes, as many and as large as an edit takes; a file that cannot be read is
    a usage error naming it (the server decodes and checks the pictures themselves)."""
    if len(files) > MAX_EDIT_IMAGES:
        raise CliError(f"at most {MAX_EDIT_IMAGES} pictures per edit, got {len(files)}", 2)
    out = []
    for path in files:
        try:
            size = path.stat().st_size
            if size > MAX_EDIT_IMAGE_BYTES:
                raise CliError(f"{path}: {size} bytes, over the {MAX_EDIT_IMAGE_BYTES} one picture may hold", 2)
            out.append(path.read_bytes())
        except OSError as exc:
            raise CliError(f"{path}: cannot read the picture ({exc.strerror or exc})", 2) from None
    return out


def check_size(text: str) -> str:
    """``WIDTHxHEIGHT`` or ``auto``, as the server takes it (it checks the range itself)."""
    if text != "auto" and not is_openai_size(text):  # argparse's own error: one usage line, exit 2
        raise argparse.ArgumentTypeError(f"must be WIDTHxHEIGHT (e.g. 256x256) or auto, got {text!r}")
    return text


def named_number(flag: str, number: str) -> Any:
    """The type of ``--flag NAME[:NUMBER]``: (name, number or None); the server checks the name."""
    def parse(text: str) -> tuple[str, float | None]:
        name, colon, value = text.partition(":")
        if not name or (colon and not value):
            raise argparse.ArgumentTypeError(f"must be NAME or NAME:{number}, got {text!r}")
        try:
            return name, float(value) if colon else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"{number} must be a number, got {value!r}") from None
    parse.__name__ = flag  # argparse names the type in its messages
    return parse


def paths(out: Path, n: int) -> list[Path]:
    """``out`` for one picture; ``out-1.ext`` ... ``out-n.ext`` for several."""
    if n == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(1, n + 1)]


class Bar:
    """A one-line progress bar on a terminal; elsewhere (logs, pipes) a line at each tenth of the
    way, not one per step; nothing when quiet."""

    WIDTH = 30

    def __init__(self, stream: TextIO | None) -> None:
        self.stream, self.open, self.tenth = stream, False, -1
        self.tty = bool(stream is not None and stream.isatty())

    def show(self, done: int, total: int, what: str) -> None:
        if self.stream is None or total <= 0:
            return
        tenth = 10 * min(done, total) // total
        if not self.tty and tenth == self.tenth:
            return
        self.tenth = tenth
        filled = self.WIDTH * min(done, total) // total
        text = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {what} {done}/{total}"
        if self.tty:
            self.stream.write("\r" + text)
            self.open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.open and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


def generate(server: Server, ask: Ask, bar: Bar, out: TextIO = sys.stdout) -> list[Path]:
    """Draw (or edit), write the files, say where they are; the written paths."""
    previews, path = ask.n == 1, ask.path
    resp = server.open("POST", path, ask.request(previews), accept="text/event-stream")
    if resp.status == 400 and previews:
        with resp:
            raw = resp.read(MAX_ERROR)
        doc = _json_or_none(raw)
        if _param(doc) != "partial_images":
            raise CliError(f"{path}: 400 {error_message(doc, raw)}")
        # no streamed twin: stream the finished picture only
        resp = server.open("POST", path, ask.request(False), accept="text/event-stream")
    if not 200 <= resp.status < 300:
        checked(resp, path)
    written = _receive(resp, ask, bar)
    bar.end()
    for path, (seed, size, reasoning) in written.items():
        if reasoning is not None:
            out.write(f"think: {reasoning}\n")
        out.write(f"wrote {path} ({size}, seed {seed})\n")
    out.write(f"drawn by {server.url}\n")  # which server answered: --url, NEOPP_URL or the default
    return list(written)


def _receive(resp, ask: Ask, bar: Bar) -> dict[Path, tuple[Any, Any, str | None]]:
    """The stream's pictures written to their files, in order; progress shown as it comes."""
    targets, written = paths(ask.out, ask.n), {}
    with resp:
        for event in events(resp):
            kind = event.get("type")
            if kind == "neopp.progress":
                bar.show(event["step"], event["total_steps"], "step")
            elif kind == "image_generation.completed":
                path = targets[len(written)]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(base64.b64decode(event["b64_json"]))
                written[path] = (event.get("seed"), event.get("size"), event.get("think"))
                if ask.n > 1:
                    bar.show(len(written), ask.n, "picture")
            elif kind == "error":
                bar.end()
                raise CliError(error_message(event))
    if len(written) < ask.n:
        bar.end()
        raise CliError(f"the server ended the stream after {len(written)} of {ask.n} pictures")
    return written


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _param(doc: Any) -> Any:
    return doc["error"].get("param") if isinstance(doc, dict) and isinstance(doc.get("error"), dict) else None
