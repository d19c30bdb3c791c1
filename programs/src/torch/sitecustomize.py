# Written by podsim for the ranks of one job (programs/src/torch/boot.rs): loads podsim's
# torch.distributed backend and its interceptions (podsim._intercept) before the program
# runs, in the rank itself; the processes a rank starts inherit PODSIM_BOOTED and skip it.
import os
import sys


def _podsim_boot():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # The environment's own sitecustomize, if it has one, still runs.
    mine = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        if mine is not None:
            sys.modules["sitecustomize"] = mine
    if os.environ.get("PODSIM_BOOTED"):
        return
    os.environ["PODSIM_BOOTED"] = "1"
    try:
        import podsim._intercept as intercept
    except ImportError as e:
        sys.stderr.write(
            f"podsim: this Python ({sys.executable}) cannot load podsim's torch backend: {e}. "
            "Install it into this environment (pip install ./python), or run a Python that "
            "has it (the command after `podsim run --`, or $PODSIM_PYTHON for a config's "
            "program.py).\n"
        )
        sys.stderr.flush()
        os._exit(2)
    intercept.boot()


_podsim_boot()
