"""OS-level thread names, so that `/proc/PID/task/*/comm`, `top -H` and `py-spy` tell the server's threads apart.

Python's `threading` names stay inside the interpreter. A thread named here also names the threads it
creates afterwards (Linux copies the name): the engine thread names its OpenMP workers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

ENGINE = "trtpaged-engine"  # the engine thread and the kernels' OpenMP workers it starts
HTTP = "trtpaged-http"  # uvicorn's event loop
TOKENIZER = "trtpaged-tok"  # the tokenizer lanes (server/tokenizer_worker.py)
_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Sets the calling thread's OS name (at most 15 bytes are kept); does nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
