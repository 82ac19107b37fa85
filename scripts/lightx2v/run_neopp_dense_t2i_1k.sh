#!/usr/bin/env bash
# LightX2V's run_neopp_dense_t2i_1k.sh: Dense t2i 1024x1024, seed 200, one process (configs/neopp/neopp_dense.json).
# Replays $KV_DIR's LightLLM dumps of turn ${TURN:-0}; offsets come from their names unless set.
# The launcher is a row of LAUNCHERS in neopp/tools/lightx2v_launchers.py (--list shows them all).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../lib/neopp_python.sh"
py="$(neopp_python "$here/../..")" || exit 2
exec "$py" -m neopp.tools.lightx2v_launchers run_neopp_dense_t2i_1k "$@"
