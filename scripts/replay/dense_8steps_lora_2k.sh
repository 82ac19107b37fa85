#!/usr/bin/env bash
# Dense 8-step LoRA 2048x2048, one turn, CFG off.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.replay_cases dense_8steps_lora_2k "$@"
