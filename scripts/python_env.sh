#!/usr/bin/env bash
# Creates (once) and refreshes the Python environment the torch backend's tests use, outside the
# working tree, and prints its python. Reused across runs: the first run downloads torch from
# PyPI (the CUDA build, ~3 GB, which runs on CPU). podsim's package is not installed into it:
# the caller puts this tree's python/ on PYTHONPATH, so two working trees can share the
# environment without one's tests importing the other's package.
#   PODSIM_VENV   where the environment lives (default: ~/.cache/podsim/torch-venv)
set -euo pipefail
venv="${PODSIM_VENV:-$HOME/.cache/podsim/torch-venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
py="$venv/bin/python"
# Found without being imported (importing torch alone takes seconds); an installation that is
# there but broken fails the tests that import it, saying why.
if ! "$py" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('numpy')))" 2>/dev/null; then
    "$py" -m pip install --quiet --disable-pip-version-check torch numpy >&2
fi
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# An installed podsim (`pip install ./python`, or a .pth an older version of this script wrote)
# would shadow the tree's package: removed (pip is asked only when one is there).
if compgen -G "$site/podsim-*.dist-info" >/dev/null; then
    "$py" -m pip uninstall --quiet --yes podsim >/dev/null 2>&1 || true
fi
rm -f "$site/podsim-tree.pth"
echo "$py"
