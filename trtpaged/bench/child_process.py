"""Child processes a benchmark starts (a `trtpaged serve`, a redis-server) that end with it, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any, Sequence

# Runs in the child before its command: Linux's PR_SET_PDEATHSIG (kept across exec) sends it SIGTERM once the
# benchmark's process exits, even by SIGKILL; a parent already gone by then ends it at once. A Popen preexec_fn
# would do the same without this exec, but is unsafe in a process with threads (the benchmark runs OpenMP).
_TIE = """import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
if os.getppid() != parent:
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def popen_tied(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, the child getting SIGTERM when this process exits (Linux): a benchmark
    killed by SIGTERM or SIGKILL left its server running for ever, holding a model's memory and a port. Call it
    from the main thread: Linux sends the signal when the thread that started the child ends."""
    return subprocess.Popen([sys.executable, "-c", _TIE, str(os.getpid()), *args], **kwargs)


def exit_on_sigterm() -> None:
    """SIGTERM ends this process as an exception would (SystemExit, status 143), so that a benchmark's `finally`
    blocks run: its children are stopped, its temporary directories removed (the default action skipped them)."""
    def leave(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
