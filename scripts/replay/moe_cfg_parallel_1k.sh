#!/usr/bin/env bash
# moe_t2i_1k on 2 CFG ranks (torchrun).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.replay_cases moe_cfg_parallel_1k "$@"
