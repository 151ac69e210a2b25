"""`serve --pin-threads` (server/thread_pinning.py): the engine thread and the event loop's thread share one core, the
kernels' OpenMP workers get the others, when asked or (auto) when the team fills every allowed core."""

from __future__ import annotations

import os
import sys
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
