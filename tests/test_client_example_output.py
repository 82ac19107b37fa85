"""The client examples' output: a default name never overwrites, a log gets no redrawn frames."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client_examples"))

from stream_common import show_progress  # noqa: E402
from t2i_common import free_default_path  # noqa: E402


def test_the_default_name_takes_the_next_free_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert free_default_path("png") == Path("outputs/out.png")
    Path("outputs").mkdir()
    Path("outputs/out.png").write_bytes(b"first")
    Path("outputs/out-2.png").write_bytes(b"second")
    assert free_default_path("png") == Path("outputs/out-3.png")
    assert free_default_path("jpg") == Path("outputs/out.jpg")


def test_progress_into_a_log_is_five_plain_lines(capsys):
    for step in range(1, 51):
        show_progress(step, 50)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line.split()[-1] for line in err.splitlines()] == ["1/50", "13/50", "25/50", "38/50", "50/50"]


@pytest.mark.parametrize("total", [1, 3])
def test_short_runs_still_end_with_the_full_bar(capsys, total):
    for step in range(1, total + 1):
        show_progress(step, total)
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{total}/{total}")
