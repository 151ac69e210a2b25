"""Runners (backends) behind the `ModelRunner` protocol, and `auto` selection between them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from trtpaged.manifest import BACKENDS, Manifest
from trtpaged.runtime.runners.base import ModelRunner, StepBatch
from trtpaged.kv_budget import resolve_num_kv_blocks
from trtpaged.runtime.runners.torch_runner import TorchRunner


__all__ = ["BACKENDS", "ModelRunner", "StepBatch", "TorchRunner", "available_devices", "default_device", "load_runner",
           "resolve_device", "resolve_num_kv_blocks", "select_backend"]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def available_devices() -> list[str]:
    """Devices this machine can run the torch runner on: cpu, and cuda:N for each visible GPU."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def resolve_device(device: Optional[str]) -> str:
    """`device`, checked against what this machine has (None: cuda when present, else cpu).

    Raises a one-line ValueError naming the device and what is available, before anything loads.
    """
    if device is None:
        return default_device()
    available = available_devices()
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: {device!r} is not a device name; available here: {', '.join(available)}") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError(f"device: {device!r} asked for, but no CUDA GPU is visible to PyTorch; "
                             f"available here: {', '.join(available)}")  # fmt: skip
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device: {device!r} does not exist; available here: {', '.join(available)}")
        return device
    raise ValueError(f"device: {device!r} is not supported (cpu or cuda); available here: {', '.join(available)}")


def tensorrt_usable(engine_dir: Path, manifest: Manifest) -> bool:
    """An engine.plan is there, TensorRT imports, a GPU is present and the plugin library is built."""
    return tensorrt_unusable_reason(engine_dir, manifest) is None


def tensorrt_unusable_reason(engine_dir: Path, manifest: Manifest) -> Optional[str]:
    """Why the TensorRT backend cannot run this engine dir here, or None when it can."""
    plan = manifest.plan_file
    if not plan or not (Path(engine_dir) / plan).is_file():
        return f"{engine_dir} has no engine.plan (built without TensorRT)"
    from trtpaged.tensorrt_env import unavailable_reason

    return unavailable_reason()


def select_backend(engine_dir: Path, manifest: Manifest, backend: str = "auto") -> str:
    """`auto` picks TensorRT when its engine and runtime are usable, torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "tensorrt" if tensorrt_usable(engine_dir, manifest) else "torch"
    return backend


def load_runner(
    engine_dir: Path, manifest: Manifest, num_kv_blocks: int, backend: str = "auto",
    device: Optional[str] = None, num_host_blocks: int = 0, tensor_parallel: int = 1,
) -> ModelRunner:
    """Builds the selected backend's runner over a pool of `num_kv_blocks` blocks.

    tensor_parallel > 1 (it must equal the engine's): rank 0 of a tensor-parallel run on the torch backend,
    the other ranks started as local processes, or joining through torchrun's variables when WORLD_SIZE is set.
    """
    if tensor_parallel != manifest.tensor_parallel:
        raise ValueError(f"tensor_parallel: got {tensor_parallel}; {engine_dir} was built for tensor_parallel "
                         f"{manifest.tensor_parallel} (its weights are split into that many shards)")
    if tensor_parallel > 1:
        if backend == "tensorrt":
            raise ValueError("backend: 'tensorrt' with tensor_parallel > 1 is not supported by the runtime yet; "
                             "use 'torch' or 'auto'")
        from trtpaged.runtime.tp import Rendezvous, start_tensor_parallel

        return start_tensor_parallel(engine_dir, manifest, num_kv_blocks, device or default_device(), num_host_blocks,
                                     Rendezvous.from_env())
    chosen = select_backend(engine_dir, manifest, backend)
    on_cuda = device is None or device.startswith("cuda")
    if chosen == "tensorrt" and backend == "auto" and not on_cuda:
        chosen = "torch"  # a CPU run asked for: the eager backend
    if chosen == "tensorrt":
        why_not = tensorrt_unusable_reason(engine_dir, manifest) if on_cuda else f"device {device!r} is not CUDA"
        if why_not is not None:
            raise ValueError(f"backend: 'tensorrt' cannot run here: {why_not}; use 'torch' or 'auto'")
        from trtpaged.runtime.runners.tensorrt_runner import TensorRTRunner

        return TensorRTRunner.from_engine_dir(engine_dir, num_kv_blocks, device=device or "cuda",
                                              num_host_blocks=num_host_blocks)
    return TorchRunner.from_engine_dir(engine_dir, num_kv_blocks, device=device or default_device(),
                                       num_host_blocks=num_host_blocks)
