"""Static guards of docs/security.md: nothing in the project unpickles arbitrary data, and the
request path takes no code, module name or file path from a request."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("backend_src", "model_repository", "client_examples", "scripts", "tests", "bench")
UNPICKLERS = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
# Modules that see request data; none may open files, import or evaluate anything per request.
REQUEST_PATH = ("backend_src/neopp/serving/request_parsing.py", "backend_src/neopp/serving/triton_model.py",
                "backend_src/neopp/serving/session_model.py", "backend_src/neopp/serving/sessions.py")
BUILTINS_FORBIDDEN = {"eval", "exec", "compile", "__import__", "open"}  # as bare names (BLS has request.exec())
CALLS_FORBIDDEN = {"import_module", "load_kv_file", "system", "popen", "Popen", "safe_open", "load_checkpoint"}


def _sources() -> list[Path]:
    return sorted(p for d in SCANNED if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py")
                  if ".venv" not in p.parts)


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _dotted(node: ast.AST) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def unsafe_loads(source: str) -> list[str]:
    """Pickle-based loaders: unpickling modules, torch.load without weights_only=True, np.load(allow_pickle=True)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names = [a.name for a in node.names] + module
            found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in UNPICKLERS]
        if isinstance(node, ast.Call):
            name, kw = _dotted(node.func), {k.arg: k.value for k in node.keywords}
            if name.endswith("torch.load") or name == "load" and "weights_only" in kw:
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not ok:
                    found.append(f"line {node.lineno}: {name} without weights_only=True")
            if name.endswith("np.load") or name.endswith("numpy.load"):
                if isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True:
                    found.append(f"line {node.lineno}: {name}(allow_pickle=True)")
    return found


def test_no_unsafe_deserialisation_anywhere():
    problems = [f"{p.relative_to(ROOT)} {msg}" for p in _sources() for msg in unsafe_loads(p.read_text())]
    assert not problems, "\n".join(problems)


def test_request_path_takes_no_code_module_or_path():
    problems = []
    for rel in REQUEST_PATH:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if not isinstance(node, ast.Call):
                continue
            bare = isinstance(node.func, ast.Name)
            if (bare and node.func.id in BUILTINS_FORBIDDEN) or _call_name(node) in CALLS_FORBIDDEN:
                problems.append(f"{rel} line {node.lineno}: {_call_name(node)}()")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", ["import pickle", "from dill import loads", "torch.load(p)",
                                     "torch.load(p, weights_only=False)", "np.load(p, allow_pickle=True)"])
def test_the_guard_catches(snippet):
    assert unsafe_loads(snippet), snippet


def test_the_guard_accepts_safe_loads():
    assert not unsafe_loads("torch.load(p, map_location='cpu', weights_only=True)\nnp.load(p)")
