"""The storeys hold: no import circle anywhere in the tree, and the layer check catches a breach.

`make lint` runs `lint-imports` with the contracts in pyproject.toml (docs/architecture.md's
table). Here the same check runs on a copy of the package with one import that climbs a storey
planted in it, and must fail naming that import: a check that cannot fail protects nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from testing import REPO

TREE = ("neopp", "testing", "bench", "demo", "client_examples", "deploy", "tests")


def import_circles(packages: tuple[str, ...]) -> list[list[str]]:
    """Groups of modules that import each other round in a circle (strongly connected, > 1 module)."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative: the tree is deep
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))

    for module in edges:
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_round_a_circle():
    assert import_circles(TREE) == []


def test_a_planted_circle_is_found(tmp_path, monkeypatch):
    """The circle finder itself, on a package written here: a -> b -> c -> a, and d outside it."""
    package = tmp_path / "circle_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, imports in {"a": "b", "b": "c", "c": "a", "d": "a"}.items():
        (package / f"{name}.py").write_text(f"from circle_probe import {imports}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_circles(("circle_probe",)) == [["circle_probe.a", "circle_probe.b", "circle_probe.c"]]


def lint_imports(package_root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(package_root))
    lint = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=package_root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_layer_check_fails_on_an_import_that_climbs_a_storey(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(REPO / "backend_src" / "neopp", copy / "neopp", ignore=shutil.ignore_patterns("__pycache__"))
    assert lint_imports(copy).returncode == 0, "the copy as it is keeps every contract"
    layers = copy / "neopp" / "model" / "layers.py"
    layers.write_text(layers.read_text() + "\nfrom ..engines import scheduler  # noqa: E402,F401 - planted\n")
    result = lint_imports(copy)
    assert result.returncode != 0
    assert "neopp.model.layers -> neopp.engines.scheduler" in result.stdout, result.stdout[-2000:]


# Words a package shares with the clients' own: a served model's name is Triton's and OpenAI's
# "model", and a message's words are "text" in every API the project answers.
CLIENT_WORDS = frozenset({"model", "text"})


def fields_named_like_packages(root: Path) -> list[str]:
    """Class fields (annotated names in a class body) that share a name with a package of ``root``:
    ``req.sampling`` read beside ``neopp.sampling`` made one word mean a value and a storey."""
    import ast

    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found += [f"{path.relative_to(root)}: {node.name}.{s.target.id}" for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and s.target.id in packages - CLIENT_WORDS]
    return found


def test_no_field_shares_its_name_with_a_package(tmp_path):
    planted = tmp_path / "pkg"
    (planted / "sampling").mkdir(parents=True)
    (planted / "sampling" / "__init__.py").write_text("")
    (planted / "request.py").write_text("class Request:\n    sampling: dict\n    height: int\n")
    assert fields_named_like_packages(planted) == ["request.py: Request.sampling"]
    assert fields_named_like_packages(REPO / "backend_src" / "neopp") == []
