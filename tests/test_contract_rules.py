"""The public rules have one home, ``neopp.contract``, and it stands on the standard library.

The door and the launcher, the ``neopp`` command and the stubs each import it; a second copy of a
rule in one of them is how a client came to be told two things. These tests read the package's
source: each rule's function or table is defined once, in the contract, and no other module
spells the rule itself. Each finder is first shown a planted copy, so it cannot pass by seeing
nothing.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from testing import REPO

PACKAGE = REPO / "backend_src" / "neopp"
CONTRACT = PACKAGE / "contract"


def sources(root: Path = PACKAGE) -> dict[str, ast.Module]:
    return {str(p.relative_to(root)): ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}


def defined(trees: dict[str, ast.Module], name: str) -> list[str]:
    """The files that define a function, class or module-level name ``name``."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else []
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if name in names:
                found.append(path)
    return sorted(set(found))


def spelling(trees: dict[str, ast.Module], pattern: str) -> list[str]:
    """The files with a string constant (an f-string's pieces too, not a docstring) matching ``pattern``."""
    rule = re.compile(pattern)
    found = set()
    for path, tree in trees.items():
        prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        if any(isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
               and rule.search(node.value) for node in ast.walk(tree)):
            found.add(path)
    return sorted(found)


def size_splits(trees: dict[str, ast.Module]) -> list[str]:
    """The files that cut a text at ``x`` (``.split("x")``, ``.partition("x")``): a size parser."""
    return sorted({path for path, tree in trees.items() for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr in ("split", "partition", "rsplit")
                   and any(isinstance(a, ast.Constant) and a.value in ("x", "X") for a in node.args)})


# (what the rule is, how a copy of it is found, the one file allowed to hold it)
RULES = [
    ("a size's spelling", lambda t: spelling(t, r"x\(?\[0-9\]"), ["contract/sizes.py"]),
    ("a size parsed by cutting at 'x'", size_splits, []),
    ("the adapter name rule", lambda t: spelling(t, re.escape("[A-Za-z0-9][A-Za-z0-9._-]")),
     ["contract/adapter_names.py"]),
    ("the adapter scale bound", lambda t: sorted(set(defined(t, "SCALE_MAX_ABS") + defined(t, "MAX_LORA_SCALE"))),
     ["contract/adapter_names.py"]),
    ("a model's own environment variable",
     lambda t: sorted(set(defined(t, "model_env_var") + spelling(t, r"NEOPP_(LORA_DIR|CHECKPOINT)_"))),
     ["contract/deployment.py"]),
    ("an error class and its status", lambda t: defined(t, "ErrorClass"), ["contract/statuses.py"]),
    ("gRPC status to HTTP status", lambda t: sorted(set(defined(t, "HTTP_OF_GRPC") + defined(t, "HTTP_STATUS"))),
     ["contract/statuses.py"]),
    ("the full queue's wording", lambda t: spelling(t, "Exceeds maximum queue size"), ["contract/statuses.py"]),
    ("the file formats by suffix", lambda t: spelling(t, r"^\.jpeg$"), ["contract/image_formats.py"]),
    ("the client lane rule", lambda t: defined(t, "lane_of"), ["contract/client_lanes.py"]),
]


@pytest.mark.parametrize(("rule", "find", "home"), RULES, ids=[r[0] for r in RULES])
def test_a_rule_is_written_once(rule, find, home):
    assert find(sources()) == home, f"{rule}: written outside {home or 'the contract'}"


PLANTED = '''
import re
SIZE = re.compile(r"^[0-9]{1,5}x[0-9]{1,5}$")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_LORA_SCALE = 8.0
HTTP_STATUS = {}
QUEUE = "Exceeds maximum queue size"
FORMATS = {".png": "png", ".jpeg": "jpeg"}
class ErrorClass: ...
def lane_of(x): ...
def model_env_var(p, m): return f"NEOPP_LORA_DIR_{m}"
def size(text): return text.lower().split("x")
'''


@pytest.mark.parametrize(("rule", "find", "home"), RULES, ids=[r[0] for r in RULES])
def test_each_finder_sees_a_planted_copy(rule, find, home):
    assert find({"door/copy.py": ast.parse(PLANTED)}) == ["door/copy.py"], rule


def test_the_contract_imports_only_the_standard_library_and_itself():
    for path, tree in sources(CONTRACT).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:  # a sibling in the contract
                    continue
                assert node.level == 0, f"{path}: imports from outside the contract"
                tops = [(node.module or "").split(".")[0]]
            else:
                continue
            foreign = [top for top in tops if top != "__future__" and top not in sys.stdlib_module_names]
            assert not foreign, f"contract/{path} imports {foreign}: the contract is standard library only"


def test_admission_carries_every_request_field_it_does_not_decide():
    """A request field the parser fills reaches the engine by its name: a new input needs its
    table row, its parse, the request's field and the rule that uses it, and no edit here."""
    import dataclasses

    from neopp.request import GenerationRequest
    from neopp.serving.admission import DECIDED_HERE, carried_fields
    from neopp.serving.request_parsing import ParsedRequest

    parsed_names = {f.name for f in dataclasses.fields(ParsedRequest)}
    for f in dataclasses.fields(GenerationRequest):
        assert f.name in DECIDED_HERE or f.name in parsed_names or f.default is not dataclasses.MISSING or \
            f.default_factory is not dataclasses.MISSING, f"{f.name}: neither parsed nor decided by admission"
    parsed = ParsedRequest(cond_kv="cond", index_offset_cond=7, lora="a", lora_scale=0.5, lane="l", image_kv="img",
                           sampling_params="sp")
    carried = carried_fields(parsed)
    names = ("cond_kv", "index_offset_cond", "lora", "lora_scale", "lane", "image_kv", "sampling_params")
    assert {k: carried[k] for k in names} == {"cond_kv": "cond", "index_offset_cond": 7, "lora": "a", "lora_scale": 0.5,
                                             "lane": "l", "image_kv": "img", "sampling_params": "sp"}
    assert not DECIDED_HERE & set(carried)


def import_time_env_reads(trees: dict[str, ast.Module]) -> list[str]:
    """The files whose module-level code (outside any function or class body) reads the environment."""
    found = set()
    for path, tree in trees.items():
        for statement in tree.body:
            if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            for node in ast.walk(statement):
                if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                        isinstance(node.value, ast.Name) and node.value.id == "os":
                    found.add(path)
    return sorted(found)


def test_no_module_reads_the_environment_when_imported():
    """Settings are read when a model loads (or a kernel first runs), from the environment of
    that moment: a module constant read at import would hide a later setting and a test's."""
    planted = ast.parse("import os\nTILE = int(os.environ.get('NEOPP_ROW_TILE', '128'))\n"
                        "def later():\n    return os.environ.get('X')\n")
    assert import_time_env_reads({"copy.py": planted}) == ["copy.py"]
    assert import_time_env_reads(sources()) == []
