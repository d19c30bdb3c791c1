#!/usr/bin/env bash
# External mode on one machine, by hand: a coordinator that waits, and workers that join it.
# The same commands, with real host names, run a job across machines.
#
#   bash scripts/cluster/local-external.sh configs/collectives.toml
#   PODSIM_TLS=tls bash scripts/cluster/local-external.sh ...   # mutual TLS (scripts/tls_certs.sh tls)
set -euo pipefail
CONFIG=${1:-configs/collectives.toml}
PODSIM=${PODSIM:-target/release/podsim}
WORKERS=$(sed -n 's/^workers *= *\([0-9]*\).*/\1/p' "$CONFIG" | head -n 1)
WORKERS=${WORKERS:-1}
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export PODSIM_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')

COORD_TLS=()
WORKER_TLS=()
if [ -n "${PODSIM_TLS:-}" ]; then
  COORD_TLS=(--set "launch.tls.ca=\"$PODSIM_TLS/ca.pem\""
             --set "launch.tls.cert=\"$PODSIM_TLS/node.pem\""
             --set "launch.tls.key=\"$PODSIM_TLS/node.key\""
             --set "launch.transport=\"tcp\"")
  WORKER_TLS=(--tls-ca "$PODSIM_TLS/ca.pem" --tls-cert "$PODSIM_TLS/node.pem"
              --tls-key "$PODSIM_TLS/node.key")
fi

"$PODSIM" coordinator "$CONFIG" --listen "127.0.0.1:$PORT" ${COORD_TLS[@]+"${COORD_TLS[@]}"} &
COORD=$!
trap 'kill $COORD 2>/dev/null || true' EXIT
for _ in $(seq "$WORKERS"); do
  "$PODSIM" worker --join "127.0.0.1:$PORT" ${WORKER_TLS[@]+"${WORKER_TLS[@]}"} &
done
wait "$COORD"
