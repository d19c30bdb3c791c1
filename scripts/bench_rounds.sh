#!/usr/bin/env bash
# podsim beside torch (gloo all-reduce, DDP) in the same rounds, on a machine that has only the
# suite's torch venv (no Open MPI, no JAX): the podsim, gloo and DDP lines of
# ../shared/peers/side_by_side.sh, writing the same JSON lines, so that
#   python3 ../shared/peers/side_by_side.py OUT
# prints the medians and ratios.
# Usage: scripts/bench_rounds.sh [ROUNDS=3] [OUT=/tmp/podsim-rounds]
set -euo pipefail
R=${1:-3}
OUT=${2:-/tmp/podsim-rounds}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$HERE/../shared/peers
PODSIM=$HERE/target/release/podsim
VENV=${PODSIM_VENV:-$HOME/.cache/podsim/torch-venv}
[ -x "$PODSIM" ] || { echo "build first: cargo build --release" >&2; exit 2; }
[ -x "$VENV/bin/torchrun" ] || { echo "no torch venv at $VENV (scripts/python_env.sh makes it)" >&2; exit 2; }
mkdir -p "$OUT"
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
port=29700
for rep in $(seq 1 "$R"); do
  export PEERS_RUN_ID="rep$rep"
  timeout -k 5 300 "$PODSIM" bench --topology 8 --sizes 1MiB,16MiB,64MiB --iters 20 --warmup 3 --json \
    | sed "s/^{/{\"lib\":\"podsim-inprocess\",\"run\":\"rep$rep\",/" >>"$OUT/podsim.jsonl"
  timeout -k 5 300 "$PODSIM" bench --topology 8 --workers 4 --sizes 1MiB,16MiB,64MiB --iters 10 \
    --warmup 2 --json 2>/dev/null | sed "s/^{/{\"lib\":\"podsim-workers4\",\"run\":\"rep$rep\",/" >>"$OUT/podsim.jsonl"
  # The same over TCP (records, as between hosts), the transport gloo's numbers are over.
  timeout -k 5 300 "$PODSIM" bench --topology 8 --workers 4 --sizes 1MiB,16MiB,64MiB --iters 10 \
    --warmup 2 --transport tcp --json 2>/dev/null \
    | sed "s/^{/{\"lib\":\"podsim-workers4-tcp\",\"run\":\"rep$rep\",/" >>"$OUT/podsim.jsonl"
  port=$((port + 1))
  (cd "$PEERS" && timeout -k 5 300 "$VENV/bin/torchrun" --nnodes 1 --nproc_per_node 4 \
    --master_addr 127.0.0.1 --master_port $port torch_gloo_allreduce.py --ops allreduce \
    --sizes 1048576,16777216,67108864 --out "$OUT/peers.jsonl" >/dev/null 2>&1)
  d=$(mktemp -d)
  (cd "$HERE" && timeout -k 5 300 "$PODSIM" launch configs/ddp_mlp_bench.toml --set job.steps=60 \
    --out "$d" >/dev/null 2>&1)
  python3 -c "import json; r=json.load(open('$d/report.json')); print(json.dumps({'lib':'podsim-ddp','run':'rep$rep','world':2,'steps_per_s':r['training']['steps_per_s']}))" >>"$OUT/podsim.jsonl"
  rm -rf "$d"
  port=$((port + 1))
  (cd "$PEERS" && timeout -k 5 300 "$VENV/bin/torchrun" --nnodes 1 --nproc_per_node 2 \
    --master_addr 127.0.0.1 --master_port $port torch_ddp_mlp.py --out "$OUT/peers.jsonl" >/dev/null 2>&1)
  echo "round $rep done" >&2
done
