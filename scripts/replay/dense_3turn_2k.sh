#!/usr/bin/env bash
# Dense 2048x2048, three turns of one chat: seed 200, then the stream continues (SEEDS="200 201 202" for the explicitly seeded variant).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CKPT=${CKPT:-checkpoints/neopp}
MODE=${MODE:-configs/neopp/neopp_dense.json}
KV_DIR=${KV_DIR:-replay_kv/dense_3turn_2k}
OUT_DIR=${OUT_DIR:-outputs/replay}
PREFIX=${PREFIX:-dense_3turn_2k}
TASK=${TASK:-t2i}
SIZE=${SIZE:-2048 2048}
CFG_SCALE=${CFG_SCALE:-4.0}
CFG_INTERVAL=${CFG_INTERVAL:--1 2}
CFG_NORM=${CFG_NORM:-none}
SHIFT=${SHIFT:-3.0}
read -r -a S <<<"${SEEDS:-200 none none}"
TURNS=("298 9 ${S[0]}" "366 12 ${S[1]}" "441 15 ${S[2]}")
source "$HERE/_common.sh"
replay_turns
