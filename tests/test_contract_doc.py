"""docs/contract.md's tables say what the code does: models, inputs, outputs, limits.

The tables are read as markdown (the row's first cells); each is compared with the table in
code that the configs are written from, so the public document cannot drift from the server.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from neopp.contract.inputs import INPUT_SPECS, OUTPUT_SPECS, STREAM_INPUT_SPECS, STREAM_OUTPUT_SPECS, TensorSpec
from neopp.limits import Limits
from neopp.modes import load_mode
from neopp.serving.model_io import generation_models

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "contract.md").read_text()
REPO = ROOT / "model_repository"


def table_after(heading: str, nth: int = 0) -> list[list[str]]:
    """The cells of the ``nth`` table after ``heading`` (header and rule rows dropped)."""
    text = DOC[DOC.index(heading):]
    tables = re.findall(r"((?:^\|.*\|\n)+)", text, re.MULTILINE)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in tables[nth].strip().splitlines()]
    return rows[2:]


def name(cell: str) -> str:
    return cell.strip("`")


def spec_of(row: list[str], optional: bool) -> TensorSpec:
    dims = tuple(int(d) for d in row[2].strip("`[]").split(","))
    return TensorSpec("TYPE_" + row[1], dims, optional)


def test_the_models_table_is_the_repository():
    rows = {name(r[0]): r for r in table_after("## Models")}
    plain = [m for m in rows if rows[m][1].endswith(".json`") and not m.endswith("_stream")]
    assert sorted(plain) == list(generation_models(REPO))
    assert set(rows) == {p.parent.name for p in REPO.glob("*/config.pbtxt")}
    for model, row in rows.items():
        if not row[1].endswith(".json`"):
            continue
        cfg = text_format.Parse((REPO / model / "config.pbtxt").read_text(), mc.ModelConfig())
        mode_file = cfg.parameters["mode_file"].string_value
        assert mode_file == f"configs/neopp/{name(row[1])}", model
        assert int(row[2]) == load_mode(ROOT / mode_file).world_size, model


def test_the_input_table_is_the_parser_s():
    rows = table_after("## Inputs of every generation model")
    assert {name(r[0]): spec_of(r, optional=r[3] != "yes") for r in rows} == INPUT_SPECS
    outputs = table_after("## Inputs of every generation model", 1)
    assert {name(r[0]): spec_of(r, optional=True) for r in outputs} == OUTPUT_SPECS


def test_the_streaming_tables_are_the_stream_parser_s():
    added = {name(r[0]): spec_of(r, optional=True) for r in table_after("## Streaming models")}
    assert added == {n: s for n, s in STREAM_INPUT_SPECS.items() if n not in INPUT_SPECS}
    outputs = {name(r[0]): spec_of(r, optional=True) for r in table_after("## Streaming models", 1)}
    assert outputs == STREAM_OUTPUT_SPECS


def test_the_limits_table_gives_the_code_s_defaults():
    rows = {name(r[0]): r for r in table_after("## Limits")}
    defaults = {f.name: f.default for f in dataclasses.fields(Limits)}
    assert set(rows) == set(defaults)
    for field, row in rows.items():
        assert int(row[1]) == defaults[field], field
