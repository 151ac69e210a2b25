"""Ctrl-C and SIGTERM during a build: a KeyboardInterrupt that cannot be lost, and a commit it cannot split.

CPython runs a Python signal handler on the main thread between two bytecodes, wherever those are. When
they are inside a finalizer (a `__del__` run by the garbage collector, a weakref callback), the
KeyboardInterrupt the handler raises is printed as "Exception ignored" and dropped, and the build would go
on to write its engine dir. So the handler also records the signal; `raise_if_interrupted` (at the end of
every build stage and before the engine dir is renamed into place) raises it again, and a dropped one is
not printed.

The rename that puts the engine dir in place, and the removal of a failed build's temp dir, run `held`:
a signal then is recorded, not raised, so neither stops half-way (an old engine dir moved aside but the
new one not yet in its place).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Callable, Iterator


class BuildInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a build."""


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.received: int | None = None  # the signal that arrived, while installed
        self.holding = False


_state = _State()


def _on_signal(signum: int, frame: object) -> None:
    _state.received = signum
    if not _state.holding:
        raise BuildInterrupted(f"signal {signum}")


def _drop_our_interrupts(previous_hook: Callable[[Any], object]) -> Callable[[Any], None]:
    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, BuildInterrupted):
            previous_hook(unraisable)
    return hook


@contextlib.contextmanager
def signals_interrupt_the_build() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM raise BuildInterrupted (a KeyboardInterrupt), and one that a
    finalizer swallowed is raised again at the next `raise_if_interrupted`. Main thread only (elsewhere the
    block runs with the handlers as they are); the previous handlers are restored after, also when a signal
    arrives while they are being installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Read before any is replaced: a signal may arrive (and our handler raise) between the install and a store.
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    _state.installed, _state.received, _state.holding = True, None, False
    try:
        sys.unraisablehook = _drop_our_interrupts(previous_hook)
        for s in previous:
            signal.signal(s, _on_signal)
        yield
    finally:
        for s, handler in previous.items():
            # None: a handler set outside Python, which Python cannot put back; the default then, not ours
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        sys.unraisablehook = previous_hook
        _state.installed, _state.received, _state.holding = False, None, False


def raise_if_interrupted() -> None:
    """Raises BuildInterrupted if a signal arrived in `signals_interrupt_the_build` and was not raised, or was
    raised where it got swallowed; a no-op outside that block or while `held`."""
    if _state.installed and _state.received is not None and not _state.holding:
        raise BuildInterrupted(f"signal {_state.received}")


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Signals arriving in the block are recorded, not raised: for work that must not stop half-way. A signal
    recorded here is raised by the next `raise_if_interrupted` after the block."""
    before = _state.holding
    _state.holding = True
    try:
        yield
    finally:
        _state.holding = before


def hold_from_here() -> None:
    """The build is complete: signals from now on until `signals_interrupt_the_build` ends are recorded and
    dropped, so the build ends as the complete build it is. A no-op outside that block."""
    if _state.installed:
        _state.holding = True
