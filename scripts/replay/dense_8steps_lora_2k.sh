#!/usr/bin/env bash
# Dense 8-step LoRA 2048x2048, one turn, CFG off.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases dense_8steps_lora_2k "$@"
