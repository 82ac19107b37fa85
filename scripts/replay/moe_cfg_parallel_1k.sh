#!/usr/bin/env bash
# moe_t2i_1k on 2 CFG ranks (torchrun).
# The case is a row of CASES in neopp/tools/replay_cases.py (--list shows them all).
exec "${PYTHON:-python3}" -m neopp.tools.replay_cases moe_cfg_parallel_1k "$@"
