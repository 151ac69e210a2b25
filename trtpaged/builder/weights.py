"""The weights file (safetensors) and the byte offsets of its tensors.

The torch backend loads `weights.safetensors`; the ONNX graph's initializers
point into the same file (ONNX external data with offset/length), so the
weights exist once on disk.
"""

from __future__ import annotations

import errno
from pathlib import Path

import torch
from torch import nn


def save_weights(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Writes the model's persistent state (tied weights once) to safetensors; returns what was written."""
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    write_safetensors(state, path, {"format": "pt", "producer": "trtpaged"})
    return state


def write_safetensors(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file; its failure to write (a full disk: its own SafetensorError, which names no file) is
    an OSError naming `path`, as any other write of the build fails."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(state, str(path), metadata=metadata)
    except SafetensorError as exc:  # e.g. "Error while serializing: I/O error: No space left on device (os error 28)"
        if "I/O error" not in str(exc):
            raise
        raise OSError(errno.EIO, str(exc), str(path)) from None


def tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (byte offset from the file start, length) for every tensor of a safetensors file
    (its header checked against the file: trtpaged.engine_files.read_safetensors_header)."""
    from trtpaged.engine_files import read_safetensors_header

    return {name: (entry.start, entry.end - entry.start) for name, entry in read_safetensors_header(path).items()}
