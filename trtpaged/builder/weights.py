"""The weights file (safetensors) and the byte offsets of its tensors.

The torch backend loads `weights.safetensors`; the ONNX graph's initializers
point into the same file (ONNX external data with offset/length), so the
weights exist once on disk.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save_weights(model: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """Writes the model's persistent state (tied weights once) to safetensors; returns what was written."""
    from safetensors.torch import save_file

    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt", "producer": "trtpaged"})
    return state


def tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (byte offset from the file start, length) for every tensor of a safetensors file
    (its header checked against the file: trtpaged.engine_files.read_safetensors_header)."""
    from trtpaged.engine_files import read_safetensors_header

    return {name: (entry.start, entry.end - entry.start) for name, entry in read_safetensors_header(path).items()}
