"""Argument types and the error exit shared by the command-line tools.

Bad input is refused while the arguments are parsed (argparse prints usage and exits 2), before a
model loads or a process group forms; what can only fail later (a file, the library refusing a
model) ends in one line and exit status 2 (`exits_cleanly`), never a traceback from deep inside.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

from .errors import ContextParallelError


def _int(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1, "at least 1")


def nonnegative_int(text: str) -> int:
    return _int(text, 0, "0 or more")


def percent(text: str) -> int:
    value = _int(text, 0, "0..100")
    if value > 100:
        raise argparse.ArgumentTypeError(f"must be 0..100 (a percentage), got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """'1024,2048' -> [1024, 2048], every value at least 1."""
    values = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated integers, got nothing")
    return values


def fractions(text: str) -> list[float]:
    """'0.1,1' -> [0.1, 1.0], each in (0, 1] (a share of the context)."""
    values = []
    for x in (x.strip() for x in text.split(",") if x.strip()):
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers, got {x!r}") from None
        if not 0 < v <= 1:
            raise argparse.ArgumentTypeError(f"each value must be in (0, 1], got {v}")
        values.append(v)
    if not values:
        raise argparse.ArgumentTypeError("expected comma-separated numbers, got nothing")
    return values


def writable_file(path: str) -> str:
    """A file path whose folder exists (or can be made) and is writable: checked before the work."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror} ({e.filename})") from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}")
    return path


def writable_dir(path: str) -> str:
    """An output folder, made now if need be, so a bad path fails before the work, not after it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make the folder {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write in {path}")
    return path


def exits_cleanly(func):
    """Run a tool's entry point; the errors a user can cause end in one line and exit status 2."""

    @functools.wraps(func)
    def run(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (ContextParallelError, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            rank = os.environ.get("RANK")
            where = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
            what = type(e).__name__ if not isinstance(e, ContextParallelError) else "error"
            print(f"{where}{what}: {e}", file=sys.stderr, flush=True)
            sys.exit(2)

    return run


def csa_setting(args):
    """The approximate mode --csa asks for (None: exact); a bad setting exits with its message."""
    if getattr(args, "csa", None) is None:
        if getattr(args, "topology", None):
            raise SystemExit("error: --topology is a setting of --csa (the approximate mode); add --csa KEEP.")
        return None
    from .sparse import CSA

    try:
        return CSA.parse(args.csa, args.topology, args.observe)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"error: {e}") from None


def add_csa_arguments(p, required: bool = False) -> None:
    """--csa / --topology / --observe: the approximate mode's settings (`csa_setting` reads them)."""
    p.add_argument(
        "--csa",
        metavar="KEEP",
        required=required,
        help="APPROXIMATE: CSPS's sparse attention, keeping this fraction of the tokens of other ranks on the node "
        "(level 2; each farther level half as many), one fraction per level (comma-separated), or the settings "
        "file `python -m hf_contextpar.eval csa-config` wrote" + ("" if required else " (default: exact)"),
    )
    p.add_argument("--topology", help="with --csa: AxB (A nodes of B ranks; default: from the launcher)")
    p.add_argument("--observe", type=positive_int, default=64, help="with --csa: query rows that rank the keys")
