"""`serve --pin-threads` (server/thread_pinning.py): the engine thread and the event loop's thread share one core, the
kernels' OpenMP workers get the others, when asked or (auto) when the team fills every allowed core."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from click.testing import CliRunner

from trtpaged.cli import main
from trtpaged.server import ServerOptions, start_server
from trtpaged.server.thread_pinning import Pinning, engine_workers, plan

linux_affinity = pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                                    reason="thread affinity by thread id needs Linux and two allowed cores")


def test_plan_by_mode_cores_and_team():
    four = {2, 3, 5, 7}
    assert plan("on", four, 1) == Pinning(frozenset({2}), frozenset({3, 5, 7}))
    assert plan("auto", four, 4) == plan("auto", four, 6) == plan("on", four, 1)
    assert plan("auto", four, 3) is None  # a core is left for the front end
    assert plan("off", four, 4) is None and plan("on", {0}, 1) is None and plan("auto", {0}, 1) is None
    with pytest.raises(ValueError, match="pin_threads"):
        plan("always", four, 4)


def test_bad_mode_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="pin_threads: must be one of auto, on, off"):
        ServerOptions(pin_threads="sometimes")
    result = CliRunner().invoke(main, ["serve", "/nonexistent", "--pin-threads", "sometimes"])
    assert result.exit_code == 2 and "--pin-threads" in result.output


def _affinity(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


@linux_affinity
def test_server_pins_engine_and_event_loop_together_and_workers_apart(tiny_engine_dir):
    allowed = set(os.sched_getaffinity(0))
    first = min(allowed)
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(pin_threads="on"))
    try:
        engine_tid = handle.loop.thread_id
        assert handle.pinning == Pinning(frozenset({first}), frozenset(allowed - {first}))
        assert _affinity(engine_tid) == _affinity(handle._thread.native_id) == {first}
        for tid in engine_workers(engine_tid):
            assert _affinity(tid) == allowed - {first}, tid
        assert _affinity(threading.get_native_id()) == allowed  # the caller's own thread is left alone
        for lane in handle.tokens.lanes:  # the front end's lanes (a grammar compile, a long prompt) may use every core
            assert all(_affinity(t.native_id) == allowed for t in lane._threads), lane.name
    finally:
        handle.shutdown()
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(pin_threads="off"))
    try:
        assert handle.pinning is None
        assert _affinity(handle.loop.thread_id) == _affinity(handle._thread.native_id) == allowed
    finally:
        handle.shutdown()


TEAM_GROWS_AGAIN = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    import torch
    from trtpaged.runtime import cpu_share
    from trtpaged.server import ServerOptions, start_server
    from trtpaged.server.thread_pinning import engine_workers

    # the budget's readings: a third core, and other processes busy on one core while `foreign` says so
    feed = {"foreign": 0.0, "ticks": 0.0, "at": time.monotonic()}
    def machine_ticks():
        now = time.monotonic()
        feed["ticks"] += feed["foreign"] * (now - feed["at"]) * os.sysconf("SC_CLK_TCK")
        feed["at"] = now
        return cpu_share.own_ticks() + int(feed["ticks"])
    cpu_share._shared = cpu_share.ThreadBudget(frozenset({0, 1, 2}), machine_ticks=machine_ticks)
    torch.set_num_threads(3)
    handle = start_server(sys.argv[1], port=0, device="cpu", options=ServerOptions(pin_threads="on"))
    try:
        model = json.loads(urllib.request.urlopen(handle.url + "/v1/models", timeout=30).read())["data"][0]["id"]

        def decode_for(seconds):
            teams, end = set(), time.monotonic() + seconds
            while time.monotonic() < end:
                body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 16}).encode()
                request = urllib.request.Request(handle.url + "/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                urllib.request.urlopen(request, timeout=30).read()
                teams.add(cpu_share._shared.threads)
            return teams
        teams = [decode_for(1.5)]
        feed["foreign"] = 1.0
        teams.append(decode_for(2.0))
        feed["foreign"] = 0.0
        teams.append(decode_for(2.0))
        workers = {tid: sorted(os.sched_getaffinity(tid)) for tid in engine_workers(handle.loop.thread_id)}
        print(json.dumps({"teams": [sorted(t) for t in teams], "pinning": sorted(handle.pinning.workers),
                          "workers": workers}))
    finally:
        handle.shutdown()
""")


@linux_affinity
def test_workers_a_grown_team_starts_are_pinned_apart_too(tiny_int4_engine_dir):
    """The CPU thread budget takes a thread from the team and gives it back: libgomp ended a worker and starts a new
    one from the engine thread, on the engine's core; it goes to the workers' cores like the others."""
    allowed = sorted(os.sched_getaffinity(0))[:2]
    child = subprocess.run([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {allowed})\n" + TEAM_GROWS_AGAIN,
                            str(tiny_int4_engine_dir)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "TRTPAGED_CPU_THREADS": "auto"})
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert 2 in result["teams"][1] and result["teams"][2][-1] == 3, result["teams"]  # down, then up again
    assert len(result["workers"]) >= 2
    assert all(cores == result["pinning"] for cores in result["workers"].values()), result
