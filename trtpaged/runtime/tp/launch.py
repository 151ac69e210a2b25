"""Local worker processes (ranks 1..N-1 on this machine): start, watch, stop.

Each worker is `python -m trtpaged.runtime.tp.worker` in its own session (a
Ctrl-C reaches rank 0 only, which then stops them) that exits when its parent
disappears. On CPU the machine's cores are divided between the ranks
(OMP_NUM_THREADS per worker, unless set). A worker that fails writes its one
line of why to an error file of its own, which rank 0's report of its exit
quotes. The file has no name (an unlinked temporary file the worker inherits
as a descriptor, `--error-fd`): it goes with the last process holding it, so
nothing is left behind even when this process is killed before `stop()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Optional

from trtpaged.runtime.tp.rendezvous import Rendezvous


def threads_per_rank(world_size: int) -> int:
    """CPU threads each rank uses so that the ranks together use the cores once."""
    return max(1, (os.cpu_count() or 1) // world_size)


class WorkerSet:
    """The worker processes this process started."""

    def __init__(self, procs: dict[int, subprocess.Popen], errors: Optional[dict[int, IO[bytes]]] = None) -> None:
        self.procs = procs  # rank -> process
        self.errors = errors or {}  # rank -> its error file (unlinked), closed by stop()
        self._errors_lock = threading.Lock()  # a health check may read them while another thread stops the workers

    @classmethod
    def start(cls, engine_dir: Path, rz: Rendezvous, port: int, devices: dict[int, str]) -> "WorkerSet":
        """Starts ranks 1..world_size-1 against rank 0's store at 127.0.0.1:port."""
        env = dict(os.environ)
        if all(d == "cpu" for d in devices.values()):
            env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(rz.world_size)))
        for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(var, None)  # a local launch passes its own
        started = cls({}, {})
        try:
            for rank in range(1, rz.world_size):
                started.errors[rank] = tempfile.TemporaryFile(prefix="trtpaged-tp-")
                fd = started.errors[rank].fileno()
                cmd = [sys.executable, "-m", "trtpaged.runtime.tp.worker", str(engine_dir), "--rank", str(rank),
                       "--world-size", str(rz.world_size), "--master-addr", "127.0.0.1", "--master-port", str(port),
                       "--device", devices[rank], "--timeout", str(rz.timeout_s), "--parent-pid", str(os.getpid()),
                       "--error-fd", str(fd)]
                started.procs[rank] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                                       pass_fds=(fd,))
        except BaseException:  # a worker that cannot start (no memory, no descriptor): those started go too
            started.stop(grace_s=0.0)
            raise
        return started

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def failure(self) -> Optional[str]:
        """'rank R (pid P) exited with code C: why' for every worker that has exited (why: the line it wrote to its
        error file, if any), or None. Where each exited only because a collective timed out, the workers still alive
        come first, with their state: one of them did not answer (a stopped or hung rank makes every other rank's
        collective time out, and naming those exits blamed the healthy ranks)."""
        exited = [(r, p) for r, p in self.procs.items() if p.poll() is not None]
        dead = [f"rank {r} (pid {p.pid}) exited with {_how(p.returncode)}{self._why(r)}" for r, p in exited]
        alive = [(r, p) for r, p in self.procs.items() if p.poll() is None]
        if dead and alive and all(_TIMED_OUT in self._why(r).lower() for r, _ in exited):
            return f"no answer from {self.alive()}: the other ranks' collectives timed out waiting; " + "; ".join(dead)
        return "; ".join(dead) or None

    def alive(self) -> str:
        """'rank R (pid P, state)' for each worker still running, stopped ones first (state: process_state)."""
        found = [(r, p.pid, process_state(p.pid)) for r, p in self.procs.items() if p.poll() is None]
        found.sort(key=lambda x: (not x[2].startswith("stopped"), x[0]))
        return ", ".join(f"rank {r} (pid {pid}, {state})" for r, pid, state in found)

    def _why(self, rank: int) -> str:
        with self._errors_lock:
            f = self.errors.get(rank)
            if f is None:
                return ""
            try:
                line = os.pread(f.fileno(), MAX_ERROR_BYTES, 0).decode("utf-8", "replace").strip()
            except OSError:
                return ""
        return f": {line}" if line else ""

    def stop(self, grace_s: float = 10.0) -> None:
        """Waits up to grace_s for the workers to exit (after STOP), then terminates and kills what is left."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with self._errors_lock:
            for f in self.errors.values():
                f.close()
            self.errors = {}


MAX_ERROR_BYTES = 1000  # of a worker's error file that a report quotes (it writes one line)
_TIMED_OUT = "timed out"  # in a worker's error line (lowercased) where its collective timed out (gloo's words)
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped by a tracer",
           "Z": "exited"}


def process_state(pid: int) -> str:
    """A process's scheduler state in words, from /proc/PID/stat ("unknown" without it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return _STATES.get(state, state)


def _how(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
