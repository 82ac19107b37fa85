# Shared by the replay launchers: builds the command from the variables each launcher sets.
# Every variable can also be given in the environment (e.g. CKPT=... KV_DIR=... ./dense_t2i_1k.sh).
# TURNS: one "OFFSET_COND OFFSET_UNCOND SEED" per turn ("none" = no uncond / continue the stream);
# turn i reads $KV_DIR/turn<i>_cond.pt and, unless its uncond offset is none, turn<i>_uncond.pt.

replay_turns() {
  local args=() i=0 oc ou seed uncond
  for spec in "${TURNS[@]}"; do
    read -r oc ou seed <<<"$spec"
    uncond="$KV_DIR/turn${i}_uncond.pt"
    [ "$ou" = none ] && uncond=none
    args+=(--turn "$KV_DIR/turn${i}_cond.pt,$uncond,$oc,$ou,$seed")
    i=$((i + 1))
  done
  local sampling=(--cfg-scale "$CFG_SCALE" --cfg-interval $CFG_INTERVAL --cfg-norm "$CFG_NORM"
                  --timestep-shift "$SHIFT")
  [ -n "${STEPS:-}" ] && sampling+=(--steps "$STEPS")
  [ "${CFG:-on}" = off ] && sampling+=(--no-cfg)
  local launcher=(replay_kv_multiturn)
  [ "${NPROC:-1}" -gt 1 ] && launcher=(torchrun --standalone --nproc_per_node="$NPROC" -m neopp.tools.replay_kv_multiturn)
  set -x
  "${launcher[@]}" --checkpoint "$CKPT" --mode "$MODE" --task "$TASK" --size $SIZE "${sampling[@]}" \
    --output-dir "$OUT_DIR" --output-prefix "$PREFIX" "${args[@]}"
}
