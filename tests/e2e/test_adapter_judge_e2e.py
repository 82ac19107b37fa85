"""Adapters judged before they are read, through a real tritonserver of its own (neopp_dense with a
small ``lora_max_bytes``, its adapter folder a temporary one holding 20,000 more names): every
bad file is refused by name with the rule it broke, never with a path or the file's bytes, and
the model stays ready; FP8 factors draw what the same values in float32 draw; a refusal is
remembered by file stamp; a file rewritten in place while it loads costs that load only."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from tritonclient.utils import InferenceServerException

from neopp.launcher.door.bounds import DoorLimits
from neopp.launcher.door.server import DoorServer
from neopp.model.checkpoint import load_checkpoint
from neopp.ports import LOOPBACK
from testing import bad_adapters as bad
from testing.pictures import same_pixels
from testing.tiny_lora import write_adapter
from tests.e2e.small_repo import SmallServer, write_repo

MODEL = "neopp_dense"
TIMEOUT_S = 120
MAX_BYTES = 8 << 20
MANY = 20_000


@pytest.fixture(scope="module")
def shapes(tiny_dense: Path) -> dict[str, tuple[int, ...]]:
    _, tensors = load_checkpoint(tiny_dense)
    return {k: tuple(t.shape) for k, t in tensors.items() if k.endswith("_proj_mot_gen.weight") or
            (".mlp_mot_gen." in k and k.endswith("_proj.weight"))}


@pytest.fixture(scope="module")
def served(tiny_dense: Path, shapes, tmp_path_factory):
    """The server, its adapter folder and a door in this process (listing what the model offers)."""
    root = tmp_path_factory.mktemp("adapter_judge")
    folder = root / "adapters"
    bad.many_names(folder, MANY)
    q = [k for k in shapes if k.endswith(bad.Q_SUFFIX)]
    write_adapter(folder, "good", {k: torch.zeros(s) for k, s in shapes.items()}, q)
    repo = write_repo(root, {}, 2048)
    config = repo / MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace(
        "parameters [\n", f'parameters [\n  {{ key: "lora_max_bytes" value: {{ string_value: "{MAX_BYTES}" }} }},\n'))
    server = SmallServer(repo, tiny_dense, root / "tritonserver.log", {"NEOPP_LORA_DIR": str(folder)}).start()
    door = DoorServer(LOOPBACK, 0, server.server.grpc_url, (LOOPBACK, server.server.http_port), "judge",
                      DoorLimits(), metrics_address=(LOOPBACK, server.server.metrics_port)).start()
    try:
        yield server, folder, f"{LOOPBACK}:{door.server_address[1]}"
    finally:
        door.stop()
        assert server.stop() == [], "the server left processes behind"


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], np.object_)


def infer(server: SmallServer, **overrides):
    return server.grpc.infer(MODEL, server.tensors(**overrides), client_timeout=TIMEOUT_S)


def image(server: SmallServer, **overrides) -> bytes:
    return infer(server, **overrides).as_numpy("IMAGE")[0]


def refused(server: SmallServer, name: str) -> str:
    """The refusal of a request naming ``name``; the model stays ready and serves the base model."""
    with pytest.raises(InferenceServerException) as info:
        infer(server, LORA=(text(name), "BYTES"))
    assert "INVALID_ARG" in str(info.value.status()), info.value
    assert server.grpc.is_model_ready(MODEL) and image(server)
    return info.value.message()


def no_leak(message: str, folder: Path) -> None:
    assert str(folder) not in message and "/etc" not in message and "/dev" not in message, message


def test_fp8_factors_draw_what_the_same_values_in_float32_draw(served, shapes):
    server, folder, _ = served
    bad.fp8_pair_files(folder, shapes)
    seed = {"SEED": (np.array([5], np.int64), "INT64")}
    fp8 = image(server, LORA=(text("fp8"), "BYTES"), **seed)
    assert same_pixels(fp8, image(server, LORA=(text("fp8_as_f32"), "BYTES"), **seed))  # records name each adapter
    assert not same_pixels(fp8, image(server, **seed))


@pytest.mark.parametrize("write, message", [
    (lambda f, s: bad.rank0_alpha(f, s, "bad_rank0"), "has rank 0; a LoRA's rank is at least 1"),
    (lambda f, s: bad.with_alpha(f, s, "bad_nan_alpha", float("nan")), "holds alpha nan"),
    (lambda f, s: bad.nested_header(f, "bad_nested"), "its header nests deeper than 3 levels"),
    (lambda f, s: bad.write_file(f, "bad_passwd_copy", b"root:x:0:0:root:/root:/bin/bash\n" * 4),
     "its file is not a safetensors file (its header length is not within the file and 16 MiB)"),
])
def test_a_bad_file_is_refused_by_name_and_the_model_stays_ready(served, shapes, write, message):
    server, folder, _ = served
    name = write(folder, shapes).name[: -len(".safetensors")]
    got = refused(server, name)
    assert got.startswith(f"LORA: adapter '{name}' refused: ") and message in got, got
    no_leak(got, folder)
    assert str(struct.unpack("<Q", b"root:x:0")[0]) not in got


def test_links_to_a_system_file_or_a_device_are_not_adapters(served):
    server, folder, door = served
    (folder / "passwd.safetensors").symlink_to("/etc/passwd")
    (folder / "zero.safetensors").symlink_to("/dev/zero")
    for name in ("passwd", "zero"):
        got = refused(server, name)
        assert got.startswith(f"LORA: no adapter named '{name}' on this model; offered: "), got
        no_leak(got, folder)
    assert not {"passwd", "zero"} & set(listing(door, folder)["loras"])


def listing(door: str, folder: Path) -> dict:
    """The door's /v1/models entry of the model (what the model judged it takes from its folder)."""
    with urllib.request.urlopen(f"http://{door}/v1/models", timeout=60) as answer:
        return {e["id"]: e for e in json.load(answer)["data"]}[MODEL]["neopp"]


def test_a_large_folder_is_listed_and_refused_with_a_bounded_list(served, shapes):
    """A refusal quotes the folder's first 10 names and the count; /v1/models lists the first 100
    the model takes and their count, none of the 20,000 empty files among them."""
    server, folder, door = served
    total = sum(1 for p in os.scandir(folder) if p.is_file(follow_symlinks=False) and p.name.endswith(".safetensors")
                and len(p.name) <= 64 + len(".safetensors"))
    got = refused(server, "no_such_adapter")
    assert re.fullmatch(rf"LORA: no adapter named 'no_such_adapter' on this model; offered: (\S+, ){{9}}\S+ and "
                        rf"{total - 10} more", got), got
    weights, q = {k: torch.zeros(s) for k, s in shapes.items()}, [k for k in shapes if k.endswith(bad.Q_SUFFIX)]
    taken = [f"a{i:03d}" for i in range(105)]  # sorted before the empty files and every other adapter
    for name in taken:
        write_adapter(folder, name, weights, q)
    deadline = time.monotonic() + 90  # the model looks again every 5 s, the door reads it every 5 s
    while listing(door, folder)["loras_total"] < len(taken) and time.monotonic() < deadline:
        time.sleep(1)
    entry = listing(door, folder)
    assert entry["loras"] == taken[:100] and len(taken) < entry["loras_total"] < MANY


def test_names_longer_than_64_are_neither_listed_nor_served(served, shapes):
    server, folder, door = served
    weights, q = {k: torch.zeros(s) for k, s in shapes.items()}, [k for k in shapes if k.endswith(bad.Q_SUFFIX)]
    longest, longer = "L" * 64, "L" * 65
    for name in (longest, longer):
        write_adapter(folder, name, weights, q)
    assert image(server, LORA=(text(longest), "BYTES"))
    with pytest.raises(InferenceServerException, match="LORA: at most 64 bytes"):
        infer(server, LORA=(text(longer), "BYTES"))
    names = listing(door, folder)["loras"]
    assert longer not in names and all(len(n) <= 64 for n in names)
    body = json.dumps({"prompt": "x", "model": MODEL, "lora": longer}).encode()
    ask = urllib.request.Request(f"http://{door}/v1/images/generations", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(ask, timeout=60)
    assert info.value.code == 400 and "at most 64 characters" in info.value.read().decode()


def sparse_adapter(folder: Path, shapes, name: str, rank: int) -> Path:
    """A valid header announcing rank-``rank`` factors of the q target, the file as long as they
    say and sparse: reading it would take that much memory."""
    base, out_f, in_f = bad.q_target(shapes)
    up, down = out_f * rank * 4, rank * in_f * 4
    head = json.dumps({base + ".lora_up.weight": {"dtype": "F32", "shape": [out_f, rank], "data_offsets": [0, up]},
                       base + ".lora_down.weight": {"dtype": "F32", "shape": [rank, in_f],
                                                    "data_offsets": [up, up + down]}}).encode()
    path = bad.write_file(folder, name, struct.pack("<Q", len(head)) + head)
    os.truncate(path, 8 + len(head) + up + down)
    return path


def test_a_file_over_lora_max_bytes_is_refused_from_its_size_every_time(served, shapes):
    server, folder, _ = served
    path = sparse_adapter(folder, shapes, "huge", 1 << 26)  # 64 GiB of factors
    for _ in range(3):
        began = time.monotonic()
        got = refused(server, "huge")
        assert time.monotonic() - began < 30
        assert got == f"LORA: adapter 'huge' refused: its file of {path.stat().st_size} bytes is over the bound " \
                      f"of {MAX_BYTES} (parameter lora_max_bytes)", got


def test_a_refusal_is_remembered_until_the_file_changes(served, shapes):
    """Fixed in place with its stamp kept, the NaN-alpha file is still refused: it is not read
    again per request. Once its modification time moves it is judged again and serves."""
    server, folder, _ = served
    path = bad.with_alpha(folder, shapes, "remembered", float("nan"))
    good = bad.with_alpha(folder / "fixed", shapes, "remembered", 2.0).read_bytes()
    assert "holds alpha nan" in refused(server, "remembered")
    bad.rewrite_keeping_stamp(path, good)
    assert "holds alpha nan" in refused(server, "remembered")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert image(server, LORA=(text("remembered"), "BYTES"))


# Cuts the file to its first half and writes it whole again, as fast as it can, for the seconds given.
# SIGTERM ends it after a whole rewrite, so the file it leaves is the adapter.
REWRITER = """
import os, signal, sys, time
path, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
data, count, asked = open(path, "rb").read(), 0, []
fd = os.open(path, os.O_WRONLY)
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
while not asked and time.monotonic() < end:
    os.ftruncate(fd, len(data) // 2)
    os.pwrite(fd, data, 0)
    count += 1
print(count, flush=True)
"""


def six_megabytes(folder: Path, shapes, name: str) -> Path:
    """An adapter of the q target with a rank that makes its file 6 MB (long enough to read that a
    rewrite lands inside a read)."""
    base, out_f, in_f = bad.q_target(shapes)
    gen = torch.Generator().manual_seed(0)
    rank = (6 << 20) // (4 * (out_f + in_f))
    return bad.write_file(folder, name, bad.raw_safetensors(bad.pair(
        base, torch.randn(out_f, rank, generator=gen) * 1e-3, torch.randn(rank, in_f, generator=gen) * 1e-3)))


def start_rewriter(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", REWRITER, str(path), "600"], stdout=subprocess.PIPE, text=True)


def stop_rewriter(writer: subprocess.Popen) -> int:
    """Stops the writer this test started (after its current rewrite); how many rewrites it made."""
    if writer.returncode is None:
        writer.terminate()
        return int(writer.communicate(timeout=30)[0] or 0)
    return 0


def test_rewriting_an_adapter_in_place_while_it_loads_costs_only_that_load(served, shapes):
    """A 6 MB adapter cut and written again without pause (by a process of its own) while requests
    load it: each request gets an image or a refusal naming the adapter; the engine lives, and
    serves the adapter once the writer stops."""
    server, folder, _ = served
    path = six_megabytes(folder, shapes, "moving")
    writer = start_rewriter(path)
    drew = 0
    try:
        for _ in range(20):
            try:
                drew += bool(image(server, LORA=(text("moving"), "BYTES")))
            except InferenceServerException as exc:
                assert "INVALID_ARG" in str(exc.status()) and "LORA: adapter 'moving' refused: " in exc.message(), exc
    finally:
        rewrites = stop_rewriter(writer)
    print(f"{rewrites} rewrites; {drew} of 20 requests drew")
    assert server.grpc.is_server_ready() and server.grpc.is_model_ready(MODEL)
    assert image(server, LORA=(text("moving"), "BYTES")) and image(server)


def test_the_ranks_of_a_parallel_mode_agree_on_an_adapter_rewritten_while_they_read_it(triton, shapes):
    """On the suite's server, neopp_dense_cfg_seq (4 ranks) under the same writer: every request ends
    with an image or a refusal naming the adapter (never a collective timeout: the ranks that read
    it agree), and the model serves it once the writer stops."""
    from tests.e2e.conftest import ensure_8steps_lora
    from tests.e2e.test_lora_e2e import infer as shared_infer

    model, name = "neopp_dense_cfg_seq", "e2e_moving_ranks"
    path = six_megabytes(ensure_8steps_lora().parent, shapes, name)
    writer = start_rewriter(path)
    try:
        for _ in range(10):
            began = time.monotonic()
            try:
                shared_infer(triton, model, LORA=text(name))
            except InferenceServerException as exc:
                assert "INVALID_ARG" in str(exc.status()) and f"LORA: adapter '{name}' refused: " in exc.message(), exc
            assert time.monotonic() - began < 60  # far below the collective timeout a disagreement would wait out
        assert stop_rewriter(writer) > 0 and triton.grpc.is_model_ready(model)
        assert triton.image(shared_infer(triton, model, LORA=text(name))).size == (64, 64)
    finally:
        stop_rewriter(writer)
        path.unlink()
