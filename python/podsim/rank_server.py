"""A rank server that many podsim jobs share.

``python -m podsim.rank_server COMMAND [ARGS...]`` loads torch once, then runs COMMAND with
``PODSIM_RANK_SERVER`` naming the server: every torch job COMMAND starts (``podsim run``,
``podsim study``'s rows, a script's many runs) forks its ranks from this server instead of
starting one that loads torch again (5-7 s of CPU per job on a small machine). The server
ends when COMMAND does, with its exit status, and takes any rank still running with it.

``python -m podsim.rank_server`` alone prints ``PODSIM_RANK_SERVER=NAME`` once ready and
serves until its standard input ends (a test harness holds the other end of a pipe).

A job uses the server only if it runs the same interpreter with the same ``PYTHONPATH``;
anything else is refused, rank by rank, saying why (``podsim._prefork``).
"""

import os
import shutil
import signal
import sys
from typing import List, Optional

from . import _prefork


def main(argv: Optional[List[str]] = None) -> int:
    """Serves until COMMAND ends (its status returned) or, without one, until stdin ends."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if args and shutil.which(args[0]) is None:
        # Said before torch is loaded, not after.
        print(f"podsim rank server: cannot run {args[0]}: not found, or not executable",
              file=sys.stderr)
        return 127
    name = f"podsim-rank-server-{os.getpid()}-{os.urandom(6).hex()}"
    if not args:
        return _prefork.serve(name, announce=f"PODSIM_RANK_SERVER={name}", watch_stdin=True)
    # Ctrl-C reaches COMMAND too (one process group): it decides, and this server ends with
    # it. A handler, not SIG_IGN, which COMMAND would inherit.
    signal.signal(signal.SIGINT, lambda *_: None)
    return _prefork.serve(name, announce=None, command=args)


if __name__ == "__main__":
    sys.exit(main())
