#!/usr/bin/env bash
# Creates (once) and refreshes the Python environment the torch backend's tests use, outside the
# working tree, and prints its python. Reused across runs: the first run downloads torch from
# PyPI (the CUDA build, ~3 GB, which runs on CPU); later runs only point it at this tree's
# package (a .pth file).
#   PODSIM_VENV   where the environment lives (default: ~/.cache/podsim/torch-venv)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${PODSIM_VENV:-$HOME/.cache/podsim/torch-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install --quiet --disable-pip-version-check torch numpy >&2
fi
# podsim's package from this working tree, without building it: `pip install ./python` builds
# the podsim binary too (maturin, a release build), which the tests take from cargo instead.
"$py" -m pip uninstall --quiet --yes podsim >/dev/null 2>&1 || true
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$repo/python" > "$site/podsim-tree.pth"
echo "$py"
