#!/usr/bin/env bash
# dense_t2i_1k on 2 CFG ranks (torchrun); its images must match dense_t2i_1k.
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases dense_cfg_parallel_1k "$@"
