"""`run_with_deadline` (trtpaged/deadline.py): Python code past its time is stopped inside it, code within its
time returns its result, and a stop never lands in the caller after the call returned."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from trtpaged.deadline import DeadlineExceeded, run_with_deadline


def _spin(seconds: float) -> int:
    """A pure-Python loop for `seconds` (as a template's loop); the number of rounds it ran."""
    end, rounds = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        rounds += 1
    return rounds


def test_code_past_its_deadline_is_stopped_and_code_within_it_returns():
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        run_with_deadline(lambda: _spin(30.0), 0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    assert run_with_deadline(lambda: 6 * 7, 5.0) == 42
    with pytest.raises(ValueError, match="seconds must be > 0"):
        run_with_deadline(lambda: None, 0)


def test_a_stop_at_the_moment_of_return_never_reaches_the_caller():
    """Calls that end around their deadline (some stopped, some not): a stop is raised only while the function
    runs, never once it returned (a stop pending at the return is cleared, not raised in run_with_deadline or
    later), and afterwards the thread runs Python code for longer than any deadline with no stray stop arriving."""
    outcomes = {"returned": 0, "stopped": 0}
    for i in range(200):
        started = []

        def spin() -> None:
            started.append(True)
            _spin(0.002)

        try:
            run_with_deadline(spin, 0.001 + 0.00002 * i)
            outcomes["returned"] += 1
        except DeadlineExceeded as exc:
            # where it was raised: inside the function's own frames once it started (before it, on a loaded
            # machine, the deadline may pass already), never after it returned
            raised_in = traceback.extract_tb(exc.__traceback__)[-1].name
            assert not started or raised_in in ("spin", "_spin"), f"stopped in {raised_in} after spin returned"
            outcomes["stopped"] += 1
    assert _spin(0.3) > 0  # a stray stop would be raised here
    assert sum(outcomes.values()) == 200  # how many of each depends on the machine's load


def test_each_thread_is_stopped_alone():
    """Two threads under their own deadlines: the one past its time is stopped, the other's result stands."""
    results: dict[str, object] = {}

    def run(name: str, seconds: float, limit: float) -> None:
        try:
            results[name] = run_with_deadline(lambda: _spin(seconds), limit) > 0
        except DeadlineExceeded:
            results[name] = "stopped"

    threads = [threading.Thread(target=run, args=("long", 30.0, 0.3)),
               threading.Thread(target=run, args=("short", 0.5, 10.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"long": "stopped", "short": True}
