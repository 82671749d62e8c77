"""A server under test, started as a user starts it: `torchrun --nproc_per_node n -m hf_contextpar serve` in a
subprocess (the real launcher), on loopback, on a free port it prints; stopped with SIGINT as a user stops it.
`ranks=True` starts the ranks as a multi-node user does, one process each with torchrun's environment and no
launcher watching them: what the server itself does when a rank dies, with nobody tearing the others down."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import openai
from launch import free_port, rank_env

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class Server:
    """`torchrun --nproc_per_node n -m hf_contextpar serve --port 0 ...` in a subprocess; its URL from its banner."""

    def __init__(self, n: int, *extra: str, ranks: bool = False, timeout: float = 30):
        serve = ["-m", "hf_contextpar", "serve", "--port", "0", "--timeout", str(timeout), *extra]
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if ranks:
            port = free_port()
            self.ranks = [
                subprocess.Popen([sys.executable, *serve], env=rank_env(n, r, port, ENV), **out) for r in range(n)
            ]
            self.proc = self.ranks[0]
        else:
            launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(free_port())]
            self.proc = subprocess.Popen([sys.executable, *launcher, *serve], env={**os.environ, **ENV}, **out)
            self.ranks = None
        self.lines: list[str] = []
        ready = threading.Event()

        def read(proc):
            for line in proc.stdout:
                self.lines.append(line)
                if "serving " in line:
                    ready.set()

        for proc in self.ranks or [self.proc]:
            threading.Thread(target=read, args=(proc,), daemon=True).start()
        if not ready.wait(120):
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines[-40:]))
        self.url = re.search(r"(http://\S+/v1)", next(x for x in self.lines if "serving " in x))[1]
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def request(self, path: str, body=None, headers=None, with_headers: bool = False) -> tuple:
        """(status, JSON body[, response headers]) of a GET (no body) or a POST of `body` (bytes as they are,
        else JSON)."""
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        head = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url[:-3] + path, data=data, headers=head)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                got = r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            got = e.code, json.loads(e.read()), dict(e.headers)
        return got if with_headers else got[:2]

    def workers(self) -> list[tuple[int, str]]:
        """(pid, command line) of the ranks still running, in rank order."""
        if self.ranks is not None:
            return [(p.pid, " ".join(p.args)) for p in self.ranks if p.poll() is None]
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                pids = sorted(int(p) for p in f.read().split())
        except OSError:
            return []
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    out.append((pid, f.read().replace("\0", " ")))
            except OSError:
                pass
        return out

    def stop(self, timeout: float = 60) -> int:
        """SIGINT to the launcher (or to rank 0, whose word stops the others); every process waited for."""
        procs = self.ranks or [self.proc]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired as e:
                for p in procs:
                    p.kill()
                    p.wait()
                raise AssertionError(
                    f"the server did not exit within {timeout} s:\n" + "".join(self.lines[-40:])
                ) from e
        return self.proc.returncode
