#!/usr/bin/env bash
# MoE t2i 512x512, one turn (SIZE="2048 2048" for the 2K run).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.replay_cases moe_512 "$@"
