"""Write the ``input``/``output`` blocks of every ``config.pbtxt`` from the contract's tables in code.

    python -m neopp.tools.contract_configs          # rewrite the blocks (make contract-configs)
    python -m neopp.tools.contract_configs --check  # list the files that differ, exit 1 if any

(``--repository`` names another model repository; default: ``model_repository`` here.)

Each model folder's kind comes from the class its ``model.py`` serves; its tables from
``neopp.serving.model_io``. Only the text between the two marker lines is written, so the rest
of a file (comments, instance groups, parameters, the per-layout files under ``configs/``) stays
as its author wrote it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..contract.inputs import TensorSpec
from ..serving.model_io import IO, tables_of

REPOSITORY = Path("model_repository")
BEGIN = "# ---- inputs and outputs: written from the code's tables by `make contract-configs`; do not edit ----"
END = "# ---- end of the written inputs and outputs ----"


def entry(name: str, spec: TensorSpec, output: bool) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    optional = " optional: true" if spec.optional and not output else ""
    return f'  {{ name: "{name}" data_type: {spec.data_type} dims: [ {dims} ]{optional} }}'


def block(tables: IO) -> str:
    inputs, outputs = tables
    parts = [BEGIN]
    for word, table, output in (("input", inputs, False), ("output", outputs, True)):
        rows = [entry(n, s, output) for n, s in table.items()]
        parts += [f"{word} [", ",\n".join(rows), "]"]
    return "\n".join([*parts, END])


def rewrite(text: str, tables: IO, where: Path) -> str:
    """``text`` with its marked block replaced (a file must carry the two markers once)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{where}: needs the marker lines once each:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN)
    return head + block(tables) + rest.split(END, 1)[1]


def config_files(repository: Path = REPOSITORY) -> list[tuple[Path, IO]]:
    """Every config of every model of ours: config.pbtxt and the layouts under configs/."""
    found = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir()):
        tables = tables_of(model_dir)
        if tables is not None:
            paths = [model_dir / "config.pbtxt", *sorted(model_dir.glob("configs/*.pbtxt"))]
            found += [(path, tables) for path in paths]
    return found


def stale(repository: Path = REPOSITORY) -> list[Path]:
    """The config files whose blocks differ from the tables."""
    return [path for path, tables in config_files(repository)
            if rewrite(path.read_text(), tables, path) != path.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only list the files that differ")
    parser.add_argument("--repository", type=Path, default=REPOSITORY, help="the model repository to write")
    args = parser.parse_args(argv)
    if args.check:
        differing = stale(args.repository)
        for path in differing:
            print(f"{path}: differs from the contract's tables; run make contract-configs")
        return 1 if differing else 0
    for path, tables in config_files(args.repository):
        text = path.read_text()
        new = rewrite(text, tables, path)
        if new != text:
            path.write_text(new)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
