"""Replacing a function of torch's everywhere a program could reach it.

podsim patches a few torch functions after torch is imported (at the rank's start, or when the
rank connects). Modules that imported such a function by name before then (torch's own, such
as `DeviceMesh`'s copy of `init_process_group`, and the program's, such as
`from torch.utils.checkpoint import checkpoint`) keep the original unless it is replaced in
them too; modules imported later import the replacement from its home.
"""

import sys

# What each replaced function was replaced with, for holders no module attribute reaches.
_replacements = {}


def everywhere(original, replacement, names):
    """Every loaded module whose attribute of one of `names` is `original` gets
    `replacement` there."""
    _replacements[original] = replacement
    for module in list(sys.modules.values()):
        for name in names:
            try:
                if getattr(module, name, None) is original:
                    setattr(module, name, replacement)
            except Exception:  # a lazy or odd module: it cannot hold torch's function
                continue


def current(function):
    """What stands for `function` now: its replacement, or itself. A holder no module
    attribute reaches (a class attribute set at import, such as a ``torch.compile`` of it)
    calls through this at each call."""
    return _replacements.get(function, function)
