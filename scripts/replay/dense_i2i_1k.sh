#!/usr/bin/env bash
# Dense i2i 1024x1024, one turn; OFFSET_COND/OFFSET_UNCOND as LightLLM logged them.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases dense_i2i_1k "$@"
