#!/usr/bin/env bash
# MoE t2i 1024x1024, one turn.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases moe_t2i_1k "$@"
