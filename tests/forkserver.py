"""A fork server for the multi-process tests: a process that has imported torch, transformers,
hf_contextpar and the tiny families' model classes, and forks a fresh rank for each launch.

Why: most of a test rank's start is imports (about 4.5 s of CPU per process on CI's 2 cores), and the
suite launches hundreds of ranks. A forked child starts with those modules loaded and is otherwise a
process of its own: its own pid, exit code, stdout and stderr, killed like any process, with nothing
run before it but imports. The server runs no torch op (no OpenMP pool may exist at fork), starts no
thread and joins no process group.

What a fork shares that separate starts would not, and what keeps the tests honest about it:
- Python's hash seed. Two servers run, with different seeds, and a launch alternates its ranks between
  them, so an order that depends on the seed (a set of strings iterated before a collective) still
  differs between ranks 0 and 1, as under torchrun.
- The random module's state: reseeded in every child.
- The environment read at import: a launch whose environment differs from the server's in any
  variable read at start-up (`_STARTUP`) is started the ordinary way (`tests/launch.py`).

Protocol: one Unix-socket connection per rank. The client sends one JSON line {argv, env, cwd, stdout,
stderr}; the server forks and answers {"pid": p}; when the child exits it answers {"rc": c} (negative:
killed by that signal, as Popen reports it) and closes. The server exits when its parent (pytest) does.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys

# environment variables read when an interpreter or these libraries start: a launch may only be forked
# from a server whose values equal its own
_STARTUP = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "HF_HUB", "HF_HOME", "TRANSFORMERS_", "CUDA_")


def startup_env(env: dict) -> dict:
    """The part of env that must match the server's for a fork to start as `python` would."""
    return {k: v for k, v in env.items() if k.startswith(_STARTUP)}


def _preload():
    """Import what every rank imports (no torch op, no thread)."""
    import hf_contextpar.eval  # noqa: F401
    import torch  # noqa: F401
    import transformers
    from transformers import AutoConfig

    import hf_contextpar  # noqa: F401
    from hf_contextpar.models import TINY_CONFIGS

    for spec in TINY_CONFIGS.values():  # the model classes of every tiny family (a lazy import each)
        try:
            config = AutoConfig.for_model(spec["model_type"])
            transformers.AutoModelForCausalLM._model_mapping[type(config)]
        except Exception:  # a class a family lacks is imported by the child, as before
            pass
    import transformers.generation  # noqa: F401


def _read_line(conn) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _reap(waiting: dict):
    """Answer the exit code of every child that has exited."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def serve(path: str) -> dict:
    """Fork a child for each request; returns the request in the child (the parent never returns)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    print("ready", flush=True)
    parent, waiting = os.getppid(), {}
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    while os.getppid() == parent:
        if sel.select(timeout=0.05):
            conn, _ = sock.accept()
            request = json.loads(_read_line(conn))
            pid = os.fork()
            if pid == 0:
                sel.close()
                sock.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                return request
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        _reap(waiting)
    sys.exit(0)


def _become(request: dict):
    """In the child: the environment, streams and argv of `python argv...`, then run it as __main__."""
    import random
    import runpy
    import types

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], 0), (2, request["stderr"], 0)):
        target = os.open(name, flags or os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    random.seed()
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[1], alter_argv=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__ = script, None
    sys.modules["__main__"] = main
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, main.__dict__)


if __name__ == "__main__":
    _preload()
    _become(serve(sys.argv[1]))
