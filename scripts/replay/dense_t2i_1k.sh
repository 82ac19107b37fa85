#!/usr/bin/env bash
# Dense t2i 1024x1024, three explicitly seeded turns.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases dense_t2i_1k "$@"
