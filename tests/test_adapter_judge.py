"""The adapter judge: a safetensors header parsed strictly and judged before any factor is read,
refusals that name the adapter and never a path or the file's bytes, refusals remembered by file
stamp, listings of regular files only, bounded, under the one name rule; and the in-process
engine loading an adapter off its step thread."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time

import numpy as np
import pytest
import torch

from neopp.contract.adapter_names import MAX_NAME_CHARS, Listing, adapter_file, is_name, list_adapters
from neopp.engines.batch_engine import BatchingEngine
from neopp.errors import ConfigError, InputError
from neopp.launcher.door.openai_images import MAX_LORA_NAME
from neopp.limits import MAX_TEXT_BYTES
from neopp.model.adapter_store import AdapterDirectory
from neopp.model.adapters import tower_linears
from neopp.model.safetensors_header import nests_within, parse_header
from neopp.sampling.pipeline import NeoPPPipeline
from testing import bad_adapters as bad
from testing.stream_requests import make
from testing.tiny_checkpoint import write_sample_kv, write_tiny_checkpoint
from testing.tiny_lora import write_adapter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    pipe = NeoPPPipeline.from_pretrained(write_tiny_checkpoint(root / "dense", "dense", seed=3), device="cpu",
                                         dtype=torch.float32)
    shapes = {k: tuple(lin.weight.shape) for k, lin in tower_linears(pipe.transformer).items()}
    return pipe, shapes, root


def refusal(pipe, folder, name) -> str:
    pipe.use_adapter_dir(folder)
    with pytest.raises(InputError) as info:
        pipe.adapters.get(name)
    return str(info.value)


# ---- the header, plainly written cases ------------------------------------------------------
def header(doc: dict, data_bytes: int = 0):
    return parse_header(json.dumps(doc).encode(), 8, data_bytes)


def test_a_plain_header_parses_with_its_metadata():
    got = header({"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                  "b": {"dtype": "BF16", "shape": [], "data_offsets": [24, 26]}}, 26)
    assert got.metadata == {"k": "v"} and got.entries["a"].shape == (2, 3) and got.entries["b"].numel == 1


@pytest.mark.parametrize("doc, data_bytes, message", [
    ({"a": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}, 4, "dtype 'I32'; a LoRA's tensors are floats"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4, "span 4 bytes; shape [2] of F32 takes 8"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "leave a gap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, "cover 4 bytes of data; the file holds 8"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 4, "overlap"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "non-negative integers"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, 4, "exactly dtype, shape"),
    ({"__metadata__": {"k": 1}}, 0, "__metadata__ must map names to strings"),
    ([], 0, "not a JSON object"),
])
def test_a_header_breaking_a_rule_is_refused_naming_it(doc, data_bytes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        header(doc, data_bytes)


@pytest.mark.parametrize("raw, message", [
    (b'{"a": 1, "a": 2}', "names one key twice"),
    (b'{"a": NaN}', "holds NaN"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 3 levels"),
    (b'{"a": "\xff"}', "not JSON text"),
])
def test_hostile_json_is_refused_without_recursion(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_header(raw, 8, 0)


def test_nesting_is_counted_outside_strings():
    assert nests_within(b'{"a": "[[[[{{{{", "b": [[1]], "c": {"d": [2]}}', 3)
    assert not nests_within(b'{"a": [[[1]]]}', 3) and not nests_within(b'{"a": [[1]}', 3)  # too deep; unbalanced
    assert nests_within(b'{"a\\"[[[": 1}', 1)


@pytest.mark.parametrize("content", [b"", b"\x01\x00", struct.pack("<Q", 1 << 40) + b"{}",
                                     open("/etc/passwd", "rb").read()[:4096] if os.path.exists("/etc/passwd")
                                     else b"root:x:0:0:root:/root:/bin/bash\n" * 8])
def test_a_file_that_is_not_safetensors_is_refused_without_its_bytes(tiny, tmp_path, content):
    pipe, _, _ = tiny
    bad.write_file(tmp_path, "notst", content)
    text = refusal(pipe, tmp_path, "notst")
    assert text.startswith("LORA: adapter 'notst' refused: its file is not a safetensors file"), text
    assert str(tmp_path) not in text and "root" not in text
    if len(content) >= 8:
        assert str(struct.unpack("<Q", content[:8])[0]) not in text


# ---- the pairs, judged before their factors are read ----------------------------------------
def test_fp8_factors_are_upcast_exactly(tiny, tmp_path):
    pipe, shapes, _ = tiny
    bad.fp8_pair_files(tmp_path, shapes)
    pipe.use_adapter_dir(tmp_path)
    fp8, f32 = pipe.adapters.get("fp8"), pipe.adapters.get("fp8_as_f32")
    (a,), (b,) = fp8.factors.values(), f32.factors.values()
    assert torch.equal(a.up, b.up) and torch.equal(a.down, b.down) and a.factor == b.factor == 1.0


@pytest.mark.parametrize("write, message", [
    (lambda f, s: bad.rank0_alpha(f, s, "x"), "has rank 0; a LoRA's rank is at least 1"),
    (lambda f, s: bad.with_alpha(f, s, "x", float("nan")), "holds alpha nan; it must be a finite number"),
    (lambda f, s: bad.with_alpha(f, s, "x", float("inf")), "holds alpha inf"),
    (lambda f, s: bad.with_alpha(f, s, "x", 1e9), "holds alpha 1000000000.0"),
    (lambda f, s: bad.nested_header(f, "x"), "its header nests deeper than 3 levels"),
])
def test_a_bad_pair_is_refused_by_name(tiny, tmp_path, write, message):
    pipe, shapes, _ = tiny
    write(tmp_path, shapes)
    text = refusal(pipe, tmp_path, "x")
    assert text.startswith("LORA: adapter 'x' refused: ") and message in text, text
    assert str(tmp_path) not in text


def test_a_foreign_key_is_shown_escaped_and_short(tiny, tmp_path):
    pipe, _, _ = tiny
    key = "\x1b[31m" + "k" * 500 + ".lora_up.weight"
    bad.write_file(tmp_path, "foreign", bad.raw_safetensors({key: torch.zeros(2, 2)}))
    text = refusal(pipe, tmp_path, "foreign")
    assert "\x1b" not in text and "\\x1b[31m" in text and "k" * 100 not in text and "..." in text


def test_a_file_over_the_bound_is_refused_from_its_size_before_its_header(tiny, tmp_path):
    pipe, _, _ = tiny
    bad.sparse_file(tmp_path, "huge", 64 << 30)  # its header length reads 0: the size rule speaks first
    pipe.use_adapter_dir(tmp_path, max_bytes=1 << 20)
    began = time.monotonic()
    with pytest.raises(InputError, match=r"^LORA: adapter 'huge' refused: its file of 68719476736 bytes is over "
                                         r"the bound of 1048576 \(parameter lora_max_bytes\)"):
        pipe.adapters.get("huge")
    assert time.monotonic() - began < 5


def test_a_refusal_is_remembered_by_file_stamp(tiny, tmp_path):
    """The NaN alpha fixed in place with its stamp kept is still refused (not read again); once its
    modification time moves, it is judged again and loads."""
    pipe, shapes, _ = tiny
    path = bad.with_alpha(tmp_path, shapes, "x", float("nan"))
    good = bad.with_alpha(tmp_path / "good", shapes, "x", 2.0).read_bytes()
    pipe.use_adapter_dir(tmp_path)
    for _ in range(2):
        with pytest.raises(InputError, match="alpha nan"):
            pipe.adapters.get("x")
    bad.rewrite_keeping_stamp(path, good)
    with pytest.raises(InputError, match="alpha nan"):
        pipe.adapters.get("x")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert next(iter(pipe.adapters.get("x").factors.values())).factor == 1.0


def test_a_file_changed_while_it_is_read_is_refused_then_read_again(tiny, tmp_path):
    pipe, shapes, _ = tiny
    path = write_adapter(tmp_path, "moving", shapes_as_weights(shapes), [k for k in shapes if k.endswith(bad.Q_SUFFIX)])
    content = path.read_bytes()
    pipe.use_adapter_dir(tmp_path)
    inner = pipe.adapters._load

    def cut_then_load(*args):
        os.truncate(path, len(content) // 2)  # cut underneath after the judge's stat
        return inner(*args)

    pipe.adapters._load = cut_then_load
    with pytest.raises(InputError, match="^LORA: adapter 'moving' refused: "):
        pipe.adapters.get("moving")
    pipe.adapters._load = inner
    path.write_bytes(content)
    assert pipe.adapters.get("moving").name == "moving"


def shapes_as_weights(shapes):
    return {k: torch.zeros(s) for k, s in shapes.items()}


# ---- names and listings ---------------------------------------------------------------------
def test_one_name_length_everywhere():
    assert MAX_NAME_CHARS == MAX_TEXT_BYTES == MAX_LORA_NAME
    assert is_name("a" * MAX_NAME_CHARS) and not is_name("a" * (MAX_NAME_CHARS + 1))


def test_listings_hold_regular_files_and_links_inside_only(tmp_path):
    folder = tmp_path / "ad"
    bad.write_file(folder, "real", b"x")
    (folder / "alias.safetensors").symlink_to(folder / "real.safetensors")
    (folder / "passwd.safetensors").symlink_to("/etc/passwd")
    (folder / "zero.safetensors").symlink_to("/dev/zero")
    (folder / "dangling.safetensors").symlink_to(folder / "nothing")
    os.mkfifo(folder / "fifo.safetensors")
    (folder / "dir.safetensors").mkdir()
    bad.write_file(tmp_path, "outside", b"x")
    (folder / "out.safetensors").symlink_to(tmp_path / "outside.safetensors")
    bad.write_file(folder, "b" * (MAX_NAME_CHARS + 1), b"x")
    assert list_adapters(folder) == Listing(("alias", "real"), 2)
    for name in ("passwd", "zero", "fifo", "dir", "out", "dangling"):
        assert adapter_file(folder, name) is None
    assert adapter_file(folder, "alias") == (folder / "real.safetensors").resolve()


def test_a_large_folder_is_listed_and_refused_with_a_bounded_list(tmp_path):
    bad.many_names(tmp_path, 20_000)
    listing = list_adapters(tmp_path)
    assert listing.total == 20_000 and len(listing.names) == 100 and listing.names[0] == "n00000"
    with pytest.raises(InputError) as info:
        AdapterDirectory(tmp_path).path("zz")
    text = str(info.value)
    assert text.endswith("offered: n00000, n00001, n00002, n00003, n00004, n00005, n00006, n00007, n00008, "
                         "n00009 and 19990 more") and len(text) < 300


# ---- the in-process engine loads adapters off its step thread --------------------------------
def test_the_batching_engine_loads_an_adapter_on_its_loader_thread(tiny, tmp_path):
    pipe, shapes, root = tiny
    write_adapter(tmp_path, "a", shapes_as_weights(shapes), [k for k in shapes if k.endswith(bad.Q_SUFFIX)])
    bad.rank0_alpha(tmp_path, shapes, "broken")
    pipe.use_adapter_dir(tmp_path)
    threads = []
    load, judge = pipe.adapters._load, pipe.adapters.directory.recommended
    pipe.adapters._load = lambda *args: threads.append(("load", threading.current_thread().name)) or load(*args)
    pipe.adapters.directory.recommended = lambda name: threads.append(("judge", threading.current_thread().name)) \
        or judge(name)
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=7, uncond_tokens=3, seed=1)
    engine = BatchingEngine(pipe)
    try:
        req = make([kv], 0, 64, 64, 1, 1)
        req.lora = "a"
        assert np.asarray(engine.generate(req)).shape == (64, 64, 3)
        req = make([kv], 0, 64, 64, 1, 1)
        req.lora = "broken"
        with pytest.raises(InputError, match="^LORA: adapter 'broken' refused: .*rank 0"):
            engine.generate(req)
        loader = "neopp-adapter-loader"
        assert threads == [("judge", loader), ("load", loader), ("judge", loader)]  # the step thread read nothing
        assert np.asarray(engine.generate(make([kv], 0, 64, 64, 1, 1))).shape == (64, 64, 3)  # still serving
    finally:
        engine.close()
        pipe.use_adapter_dir(None)


def test_requests_waiting_for_their_adapter_end_cancelled_when_the_engine_closes(tiny, tmp_path):
    pipe, shapes, root = tiny
    write_adapter(tmp_path, "a", shapes_as_weights(shapes), [k for k in shapes if k.endswith(bad.Q_SUFFIX)])
    pipe.use_adapter_dir(tmp_path)
    inner, entered, release, loads = pipe.adapters._load, threading.Event(), threading.Event(), []

    def held_load(*args):
        loads.append(args[0])
        entered.set()
        assert release.wait(30)
        return inner(*args)

    pipe.adapters._load = held_load
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=7, uncond_tokens=3, seed=1)
    engine, ends = BatchingEngine(pipe), {}

    def submit(job: str, cancelled=lambda: False) -> None:
        req = make([kv], 0, 64, 64, 1, 1)
        req.lora = "a"
        engine.submit(req, lambda ev: ends.setdefault(job, ev) if ev.last else None, cancelled)

    try:
        submit("first")
        assert entered.wait(30)  # the first load holds the loader
        submit("cancelled", cancelled=lambda: True)
        submit("behind")
        closing = threading.Thread(target=engine.close)
        closing.start()
        time.sleep(0.2)  # most often close now waits on the held load; either way every request ends
        release.set()
        closing.join(30)
        assert not closing.is_alive()
    finally:
        release.set()
        pipe.use_adapter_dir(None)
    assert loads == ["a"] and set(ends) == {"first", "cancelled", "behind"}  # one last event each, one read
    assert type(ends["cancelled"].error).__name__ == "GenerationCancelled"
    # the others end cancelled, or drew when they reached the batch before the engine closed
    assert all(ev.error is None or type(ev.error).__name__ == "GenerationCancelled" for ev in ends.values()), ends


def test_an_unexpected_failure_while_reading_refuses_the_adapter_by_name(tiny, tmp_path):
    pipe, shapes, _ = tiny
    write_adapter(tmp_path, "odd", shapes_as_weights(shapes), [k for k in shapes if k.endswith(bad.Q_SUFFIX)])
    pipe.use_adapter_dir(tmp_path)
    pipe.adapters._load = lambda *args: 1 / 0
    with pytest.raises(InputError, match=r"^LORA: adapter 'odd' refused: its file cannot be read "
                                         r"\(ZeroDivisionError\)$"):
        pipe.adapters.get("odd")
    pipe.use_adapter_dir(None)


def test_the_step_loop_serves_other_requests_while_an_adapter_loads(tiny, tmp_path):
    """The load is held until the base request has drawn: were it on the step thread, the base
    request could not finish (its generate would time out instead)."""
    pipe, shapes, root = tiny
    write_adapter(tmp_path, "slow", shapes_as_weights(shapes), [k for k in shapes if k.endswith(bad.Q_SUFFIX)])
    pipe.use_adapter_dir(tmp_path)
    inner, release = pipe.adapters._load, threading.Event()
    pipe.adapters._load = lambda *args: release.wait(60) and inner(*args)
    kv = write_sample_kv(root / "kv", "dense", cond_tokens=7, uncond_tokens=3, seed=1)
    engine = BatchingEngine(pipe)
    engine.wait_s = 60
    try:
        waiting = make([kv], 0, 64, 64, 2, 1)
        waiting.lora = "slow"
        ends = []
        engine.submit(waiting, lambda ev: ends.append(ev) if ev.last else None, lambda: False)
        assert np.asarray(engine.generate(make([kv], 0, 64, 64, 2, 2))).shape == (64, 64, 3) and not ends
        release.set()
        deadline = time.monotonic() + 60
        while not ends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ends and ends[0].error is None
    finally:
        release.set()
        engine.close()
        pipe.use_adapter_dir(None)
