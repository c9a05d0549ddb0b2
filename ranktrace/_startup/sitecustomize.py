"""`ranktrace run`'s startup hook: this folder is put first on the PYTHONPATH of the command it
launches, so every Python process of the job imports this module at start-up (site.py does).
It arms ranktrace.telemetry.startup, which instruments the process when it imports torch, then
runs the `sitecustomize` this one shadows, if there is one further along the path.
"""

import os
import sys


def _arm() -> None:
    try:
        from ranktrace.telemetry.startup import arm
    except ImportError as error:  # the job runs another Python than ranktrace's
        print(f"ranktrace: not recording this process ({error}); launch it with the Python "
              "ranktrace is installed in", file=sys.stderr)  # fmt: skip
        return
    arm()


def _chain() -> None:
    """Run the next `sitecustomize` on sys.path after this folder (the one this shadows)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    later = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("RANKTRACE_RUN_DIR"):
    _arm()
_chain()
