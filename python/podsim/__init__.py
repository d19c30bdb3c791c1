"""podsim's Python side.

``import podsim.torch`` registers the ``podsim`` torch.distributed backend: under
``podsim run`` (or a ``kind = "torch"`` job) every rank is one emulated chip and its
collectives run on podsim's fabric, algorithms and virtual clock.
"""

import re as _re
from pathlib import Path as _Path


def _version() -> str:
    """The workspace's version (``Cargo.toml``, its one source): read from the checkout this
    package sits in, else from the installed wheel's metadata (maturin copies it there)."""
    manifest = _Path(__file__).resolve().parent.parent.parent / "Cargo.toml"
    try:
        found = _re.search(r'(?ms)^\[workspace\.package\].*?^version = "([^"]+)"',
                           manifest.read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("podsim")
    except PackageNotFoundError:
        return "unknown"


__version__ = _version()
