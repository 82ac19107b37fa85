#!/usr/bin/env bash
# The embedded demo model on its sample prompt's KV at 256x256: runs on a CPU in seconds.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.replay_cases demo "$@"
