#!/usr/bin/env bash
# Dense 2048x2048 chat: seed 200, then the stream continues (SEEDS="200 201 202" to seed each).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases dense_3turn_2k "$@"
