"""Run a module (or a script: a path ending in .py) as `python -m MODULE ARGS...` would, then report, from an atexit hook that runs after
every hook the module registered (hooks run last-registered first), which gloo threads are still
alive when the interpreter starts finalizing: none may be (see hf_contextpar.comm.group)."""

import atexit
import glob
import runpy
import sys


def _thread_name(path):
    """A thread may exit between listing /proc/self/task and reading its name: it is then not alive."""
    try:
        with open(path) as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _report():
    threads = sorted(_thread_name(p) for p in glob.glob("/proc/self/task/*/comm"))
    print(f"gloo threads at exit: {[t for t in threads if 'gloo' in t]}", file=sys.stderr, flush=True)


atexit.register(_report)
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
if module.endswith(".py"):
    runpy.run_path(module, run_name="__main__")
else:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
