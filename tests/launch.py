"""Start N processes of a script the way torchrun does (RANK, WORLD_SIZE, MASTER_*), on CPU/gloo."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")


def worker_path(name: str) -> str:
    """The script a test launches: tests/workers/NAME (what ranks run lives there, with what they import)."""
    path = os.path.join(WORKERS, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no worker script {path}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(n: int, rank: int, port: int, env: dict | None = None) -> dict:
    """The environment torchrun gives rank `rank` of n (one thread, offline), plus env."""
    return {
        **os.environ,
        **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank)),
        **dict(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n)),
        **dict(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"),
        **(env or {}),
    }


def launch(n: int, args: list[str], timeout: float = 600, env: dict | None = None, fresh: bool = False):
    """Run `python args...` as n ranks; returns a list of (returncode, stdout, stderr), one per rank.

    Ranks are forked from the session's fork servers (tests/forkserver.py: torch, transformers and
    hf_contextpar already imported) where the launch allows it, else started as new interpreters:
    always with `fresh` (a test of what a script's own start or import order does), or everywhere with
    HF_CONTEXTPAR_TEST_FORK=0."""
    port = free_port()
    envs = [rank_env(n, rank, port, env) for rank in range(n)]
    forked = None if fresh else _fork_launch(args, envs, timeout, os.getcwd())
    return forked if forked is not None else _spawn_launch(args, envs, timeout)


def python(args: list[str], *, env: dict | None = None, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    """`python args...` as one process (no torchrun environment), forked where it can be, as `launch`'s ranks."""
    env = dict(os.environ if env is None else env)
    forked = _fork_launch(args, [env], timeout, str(cwd or os.getcwd()))
    if forked is None:
        return subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
    return subprocess.CompletedProcess(args, *forked[0])


def torchrun(n: int, args: list[str], timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node n args...` as one result: the ranks' stdout and stderr joined in rank
    order, the first non-zero exit status (else 0). For tests of what the ranks do, not of torchrun's
    own start and teardown (tests/*/test_cli.py and tests/multi_process/test_exit.py launch the real torchrun)."""
    results = launch(n, args, timeout=timeout, env=env)
    rc = next((r for r, _, _ in results if r != 0), 0)
    return subprocess.CompletedProcess(args, rc, "".join(o for _, o, _ in results), "".join(e for _, _, e in results))


def _spawn_launch(args, envs, timeout):
    procs = [
        subprocess.Popen([sys.executable, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for e in envs
    ]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err += f"\n[launcher] killed after {timeout}s"
        results.append((p.returncode, out, err))
    return results


class _Server:
    """One fork server (tests/forkserver.py), started once per session, with its own hash seed."""

    def __init__(self, env: dict, where: str):
        self.path = os.path.join(where, "sock")
        server = os.path.join(os.path.dirname(__file__), "forkserver.py")
        self.proc = subprocess.Popen([sys.executable, server, self.path], env=env, stdout=subprocess.PIPE, text=True)
        self.env = env

    @property
    def ready(self) -> bool:
        """Waits for the server's imports (the servers start them side by side)."""
        if not hasattr(self, "_ready"):
            self._ready = self.proc.stdout.readline().strip() == "ready"
        return self._ready


_servers: list | None = None  # [] once a server failed to start: every later launch starts new interpreters


def _fork_servers() -> list | None:
    """The session's two fork servers (ranks alternate between them), or None where they cannot serve.

    They start from the session's environment, and start again if a start-up variable of it changes: importing
    lm_eval in-process sets HF_HUB_ENABLE_HF_TRANSFER, for one, which a new interpreter would start with."""
    global _servers
    from forkserver import startup_env

    base = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    base.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")  # as rank_env
    if _servers and _servers[0].startup != startup_env(base):
        _say_once(
            f"tests/launch.py: fork servers restarted ({sorted(_differences(_servers[0].startup, startup_env(base)))} changed)"
        )
        for old in _servers:
            old.proc.kill()
        _servers = None
    if _servers is None:
        import atexit
        import tempfile

        _servers = [_Server(base, tempfile.mkdtemp(prefix="hfcp-fork")) for _ in range(2)]
        atexit.register(lambda servers=_servers: [s.proc.kill() for s in servers])
        if not all(s.ready for s in _servers):
            print("tests/launch.py: a fork server did not start; ranks start as new interpreters", file=sys.stderr)
            _servers = []
        for s in _servers:
            s.startup = startup_env(s.env)
    return _servers or None


def _differences(a: dict, b: dict) -> set:
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


_said: set = set()


def _say_once(line: str):
    """A line on the terminal (past pytest's capture), once per session."""
    if line not in _said:
        _said.add(line)
        print(line, file=sys.__stderr__, flush=True)


class _Lines:
    """JSON lines from a fork server's connection (the pid, then the exit code), with a timeout."""

    def __init__(self, conn):
        self.conn, self.buf = conn, b""

    def next(self, timeout: float) -> dict:
        import json

        self.conn.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise ConnectionError("the fork server closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _fork_launch(args, envs, timeout, cwd):
    """Every rank forked from a fork server, or None where the launch must start new interpreters."""
    import json
    import signal
    import tempfile
    import time

    from forkserver import startup_env

    if os.environ.get("HF_CONTEXTPAR_TEST_FORK", "1") == "0" or (args[0].startswith("-") and args[0] != "-m"):
        return None
    servers = _fork_servers()
    if servers is None:
        return None
    differ = sorted({k for r, e in enumerate(envs) for k in _differences(startup_env(e), servers[r % 2].startup)})
    if differ:
        _say_once(f"tests/launch.py: new interpreters for a launch whose start-up environment differs ({differ})")
        return None
    where = tempfile.mkdtemp(prefix="hfcp-ranks")
    ranks = []
    for rank, e in enumerate(envs):
        out, err = (os.path.join(where, f"rank{rank}.{s}") for s in ("out", "err"))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(servers[rank % 2].path)
        conn.sendall(json.dumps(dict(argv=list(args), env=e, cwd=cwd, stdout=out, stderr=err)).encode() + b"\n")
        lines = _Lines(conn)
        ranks.append((lines.next(60)["pid"], lines, out, err))
    deadline, killed, codes = time.monotonic() + timeout, None, []
    for pid, lines, _, _ in ranks:
        try:
            codes.append(lines.next(max(0.1, deadline - time.monotonic()) if killed is None else 30)["rc"])
        except TimeoutError:
            killed = pid
            for other, *_ in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            codes.append(lines.next(30)["rc"])
    results = []
    for (pid, lines, out, err), rc in zip(ranks, codes):
        lines.conn.close()
        text_err = open(err).read() + (f"\n[launcher] killed after {timeout}s" if pid == killed else "")
        results.append((rc, open(out).read(), text_err))
    shutil.rmtree(where, ignore_errors=True)
    return results


_matrices: dict = {}


def matrix(worker: str, n: int, tmp_path_factory, args: tuple[str, ...] = ()) -> list[list[dict]]:
    """Every rank's records from `tests/workers/<worker> OUT *args` on n ranks, launched once per session and
    (worker, n, args)."""
    key = (worker, n, tuple(args))
    if key not in _matrices:
        _matrices[key] = run_matrix(n, worker_path(worker), tmp_path_factory.mktemp(f"{worker[:-3]}{n}"), args)
    return _matrices[key]


def selected(request, key: str, everything) -> tuple:
    """The worker's arguments for the values of parameter `key` that this session runs for the requesting
    test function at the same N (after -k, -m and the rotation, tests/conftest.py): () when that is all of
    `everything`, else the comma-separated subset in its order, so a matrix launch runs only those."""
    test, n = request.node.originalname, request.node.callspec.params["n"]
    wanted = {
        item.callspec.params[key]
        for item in request.session.items
        if getattr(item, "originalname", None) == test and item.callspec.params.get("n") == n
    }
    subset = [v for v in everything if v in wanted]
    return () if len(subset) == len(everything) else (",".join(subset),)


def run_matrix(n: int, worker: str, out_dir, args: tuple[str, ...] = ()) -> list[list[dict]]:
    """Launch `worker OUT *args` on n ranks and return every rank's OUT/rank{r}.json records."""
    import json

    procs = launch(n, [worker, str(out_dir), *args], timeout=1200)
    for rank, (rc, _, err) in enumerate(procs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-4000:]}"
    return [json.load(open(os.path.join(str(out_dir), f"rank{r}.json"))) for r in range(n)]
