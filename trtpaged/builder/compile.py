"""The TensorRT compile stage (engine.plan).

The compile itself arrives with the TensorRT plugin; until then this module
answers whether TensorRT is present and why the stage is skipped, so that the
builder can refuse `backend: tensorrt` before any work and `auto` can say what
it skipped. The stage slots in after verification (see pipeline.py).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

PLAN_FILE = "engine.plan"


def tensorrt_installed() -> bool:
    """True when the `tensorrt` Python package can be imported (not imported here)."""
    return importlib.util.find_spec("tensorrt") is not None


def unavailable_reason() -> Optional[str]:
    """Why no engine.plan can be built on this machine, or None when it can."""
    if not tensorrt_installed():
        return "TensorRT is not installed (pip install 'trtpaged[tensorrt]' on a machine with an NVIDIA GPU)"
    return "the TensorRT plugin and compile stage are not implemented in this trtpaged version yet"


def compile_engine(*args, **kwargs) -> None:
    """Compiles model.onnx + the plugin into engine.plan (not implemented yet)."""
    raise NotImplementedError(unavailable_reason())
