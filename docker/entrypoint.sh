#!/bin/sh
# Entry point of the NeoPP container: the launcher behind `make serve`, listening on every
# interface of the container (publish the ports on the host's loopback, as compose.yaml does).
#   NEOPP_MODELS       models to load, space-separated (default: neopp_dense neopp_session)
#   NEOPP_CHECKPOINT   checkpoint folder (default /models/neopp); NEOPP_LORA_DIR for the 8-step model
#   NEOPP_CONFIG       a GPU layout of model_repository/*/configs/ (e.g. h200x8); unset: config.pbtxt
#   NEOPP_ADMIN_KEY    operator key; else $NEOPP_STATE_DIR/admin.key, created 0600 at first start
#   NEOPP_API_KEY      the /v1 key (the server listens beyond loopback); else $NEOPP_STATE_DIR/api.key, as above
#   NEOPP_STOP_TIMEOUT_S  at a stop, seconds running requests get to finish (default: the launcher's)
#   NEOPP_GRPC_FRONT   on (default): the public gRPC port is the launcher's gRPC front; off: Triton's own
#                      (behind a router, so that a dead server refuses the connection and is passed by)
#   NEOPP_HOME (/opt/neopp), NEOPP_STATE_DIR (/var/lib/neopp), NEOPP_HOST (0.0.0.0), NEOPP_HTTP_PORT /
#   _GRPC_PORT / _METRICS_PORT (8000-8002), NEOPP_PYTHON (python3): for use outside the image
# Arguments are passed to tritonserver. Nothing here writes outside $NEOPP_STATE_DIR (the root filesystem
# may be read-only), and no key is ever put on a command line by this script: the launcher reads them.
set -eu
home=${NEOPP_HOME:-/opt/neopp}
state=${NEOPP_STATE_DIR:-/var/lib/neopp}
set -- --model-control-mode=explicit ${NEOPP_CONFIG:+--model-config-name=$NEOPP_CONFIG} "$@"
for model in ${NEOPP_MODELS:-neopp_dense neopp_session}; do
  set -- "$@" "--load-model=$model"
done
mkdir -p "$state"
cd "$home"
exec "${NEOPP_PYTHON:-python3}" -m neopp.launcher serve --model-repository "$home/model_repository" \
  --host "${NEOPP_HOST:-0.0.0.0}" --http-port "${NEOPP_HTTP_PORT:-8000}" --grpc-port "${NEOPP_GRPC_PORT:-8001}" \
  --metrics-port "${NEOPP_METRICS_PORT:-8002}" --admin-key-file "$state/admin.key" --api-key-file "$state/api.key" \
  --alive-file "$state/alive" $([ "${NEOPP_GRPC_FRONT:-on}" = off ] && echo --no-grpc-front) \
  ${NEOPP_STOP_TIMEOUT_S:+--stop-timeout-s "$NEOPP_STOP_TIMEOUT_S"} -- "$@"
