"""A benchmark's child processes (its `trtpaged serve`, its redis-server) end with it however it ends, and SIGTERM
runs its cleanup: real processes, killed by real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = """
import sys, tempfile, time
from trtpaged.bench.child_process import exit_on_sigterm, popen_tied
exit_on_sigterm()
child = popen_tied(["sleep", "120"])
scratch = tempfile.mkdtemp(dir=sys.argv[1])
try:
    print(child.pid, scratch, flush=True)
    time.sleep(120)
finally:
    child.terminate()
    import shutil
    shutil.rmtree(scratch)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _start(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pid, scratch = parent.stdout.readline().split()
    return parent, int(pid), scratch


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return False
        time.sleep(0.05)
    return True


def test_a_child_ends_when_its_parent_is_killed(tmp_path):
    parent, child, _ = _start(tmp_path)
    assert _alive(child)
    parent.kill()  # SIGKILL: no cleanup code runs in the parent
    parent.wait(10)
    assert _gone_within(child, 10)


def test_sigterm_runs_the_parents_cleanup(tmp_path):
    parent, child, scratch = _start(tmp_path)
    assert os.path.isdir(scratch)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(10) == 143
    assert not os.path.exists(scratch)  # the finally block ran
    assert _gone_within(child, 10)
