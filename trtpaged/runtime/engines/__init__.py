"""Backends behind the `Engine` protocol, and `auto` selection between them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from trtpaged.manifest import Manifest
from trtpaged.runtime.engines.base import Engine, StepBatch
from trtpaged.runtime.engines.kv_budget import resolve_num_blocks
from trtpaged.runtime.engines.torch_engine import TorchEngine

BACKENDS = ("auto", "torch", "tensorrt")

__all__ = ["BACKENDS", "Engine", "StepBatch", "TorchEngine", "default_device", "resolve_num_blocks", "select_backend", "load_engine"]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def tensorrt_usable(engine_dir: Path, manifest: Manifest) -> bool:
    """An engine.plan is there, TensorRT imports, a GPU is present and the plugin library is built."""
    return tensorrt_unusable_reason(engine_dir, manifest) is None


def tensorrt_unusable_reason(engine_dir: Path, manifest: Manifest) -> Optional[str]:
    """Why the TensorRT backend cannot run this engine dir here, or None when it can."""
    plan = manifest.plan_file
    if not plan or not (Path(engine_dir) / plan).is_file():
        return f"{engine_dir} has no engine.plan (built without TensorRT)"
    from trtpaged.builder.compile import unavailable_reason

    return unavailable_reason()


def select_backend(engine_dir: Path, manifest: Manifest, backend: str = "auto") -> str:
    """`auto` picks TensorRT when its engine and runtime are usable, torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "tensorrt" if tensorrt_usable(engine_dir, manifest) else "torch"
    return backend


def load_engine(
    engine_dir: Path, manifest: Manifest, num_blocks: int, backend: str = "auto",
    device: Optional[str] = None, num_host_blocks: int = 0,
) -> Engine:
    """Builds the selected backend over a pool of `num_blocks` blocks."""
    chosen = select_backend(engine_dir, manifest, backend)
    on_cuda = device is None or device.startswith("cuda")
    if chosen == "tensorrt" and backend == "auto" and not on_cuda:
        chosen = "torch"  # a CPU run asked for: the eager backend
    if chosen == "tensorrt":
        why_not = tensorrt_unusable_reason(engine_dir, manifest) if on_cuda else f"device {device!r} is not CUDA"
        if why_not is not None:
            raise ValueError(f"backend: 'tensorrt' cannot run here: {why_not}; use 'torch' or 'auto'")
        from trtpaged.runtime.engines.tensorrt_engine import TensorRTEngine

        return TensorRTEngine.from_engine_dir(engine_dir, num_blocks, device=device or "cuda",
                                              num_host_blocks=num_host_blocks)
    return TorchEngine.from_engine_dir(engine_dir, num_blocks, device=device or default_device(), num_host_blocks=num_host_blocks)
