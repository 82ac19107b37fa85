# Sourced by the replay launchers so they run without an activated venv.
# neopp_python ROOT prints the first interpreter that has the neopp package: $PYTHON when set (the
# caller's explicit choice), then ROOT/.venv/bin/python (the checkout's own, made by `make setup`),
# then python3; else it explains and fails.
neopp_python() {
  local root py
  root="$(cd "$1" && pwd)" || return 1
  for py in "${PYTHON:-}" "$root/.venv/bin/python" python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("neopp") is None)' 2>/dev/null; then
      echo "$py"
      return 0
    fi
  done
  echo "error: no Python with the neopp package (tried PYTHON=${PYTHON:-unset}, $root/.venv/bin/python," \
       "python3); run 'make setup' in $root or set PYTHON to an interpreter that has neopp installed" >&2
  return 1
}

# Relative default paths of the replay cases (checkpoints, KV folders, mode files) are the
# checkout's, whatever directory the launcher runs from.
export NEOPP_BASE_DIR="${NEOPP_BASE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
