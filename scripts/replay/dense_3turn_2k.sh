#!/usr/bin/env bash
# Dense 2048x2048 chat: seed 200, then the stream continues (SEEDS="200 201 202" to seed each).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.replay_cases dense_3turn_2k "$@"
