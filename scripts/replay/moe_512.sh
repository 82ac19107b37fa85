#!/usr/bin/env bash
# MoE t2i 512x512, one turn (SIZE="2048 2048" for the 2K run).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases moe_512 "$@"
