"""Backends behind the `Engine` protocol, and `auto` selection between them."""

from __future__ import annotations

import importlib.util
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
    """An engine.plan is there, TensorRT imports and a GPU is present."""
    plan = manifest.plan_file
    return bool(
        plan
        and (engine_dir / plan).is_file()
        and importlib.util.find_spec("tensorrt") is not None
        and torch.cuda.is_available()
    )


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
    if chosen == "tensorrt":
        if backend == "auto":  # the TensorRT runtime is a later issue: fall back quietly
            chosen = "torch"
        else:
            raise ValueError("backend: 'tensorrt' is not implemented by this runtime yet; use 'torch' or 'auto'")
    return TorchEngine.from_engine_dir(engine_dir, num_blocks, device=device or default_device(), num_host_blocks=num_host_blocks)
