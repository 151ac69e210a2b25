"""A local redis-server process on a loopback port (the benchmarks' and tests' shared store)."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Optional

from trtpaged.bench.child_process import popen_tied


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """Starts `redis-server` (no persistence, optional memory bound, LRU by default) and waits until it accepts
    connections."""

    def __init__(self, port: Optional[int] = None, maxmemory: Optional[str] = None, start_timeout_s: float = 10.0,
                 policy: str = "allkeys-lru"):  # fmt: skip
        self.port = port or free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if maxmemory:
            args += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
        self.proc = popen_tied(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        """SIGKILL (a crash, as the tests want it), then reaps the process."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
