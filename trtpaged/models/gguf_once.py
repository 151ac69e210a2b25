"""One parse of a GGUF file per transformers load.

transformers (5.x) reads a GGUF's metadata three times in one `load_hf`: for
the config, for the tokenizer and for the weights. Each time it builds a new
`gguf.GGUFReader` and converts every metadata value, including SmolLM2's
49k-entry vocabulary and merges. While mapping the weights it also builds
gguf's tensor-name map once per module (397 times for SmolLM2). All of that is
pure Python: SmolLM2's load stage took 43 s of a 99 s build on a 2-core machine,
and the three metadata reads were 59 s of a 71 s profiled load.

Inside `parsed_once()`:
- a file's reader is built once;
- the metadata-only result of `load_gguf_checkpoint` is computed once, and each
  caller gets its own deep copy, since callers edit what they get;
- the tensor-name map is built once per (architecture, layer count).

The weights, config and tokenizer are the ones transformers makes without it.
If transformers or gguf lacks one of these names, nothing is patched.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
from typing import Any, Iterator

_PATCH_LOCK = threading.Lock()  # the patched names are module globals: one load at a time inside the patch


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, transformers' GGUF loading parses each file's metadata once."""
    try:
        import gguf
        import transformers.modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:
        yield
        return
    targets = [(gguf, "GGUFReader"), (gguf, "get_tensor_name_map"), (hf_gguf, "load_gguf_checkpoint")]
    if not all(hasattr(module, name) for module, name in targets):
        yield
        return
    with _PATCH_LOCK:
        originals = [getattr(module, name) for module, name in targets]
        replacements = _replacements(*originals)
        for (module, name), replacement in zip(targets, replacements):
            setattr(module, name, replacement)
        try:
            yield
        finally:
            for (module, name), original in zip(targets, originals):
                setattr(module, name, original)


def _replacements(reader_class: Any, name_map: Any, load_checkpoint: Any) -> list[Any]:
    readers: dict[str, Any] = {}
    metadata: dict[str, Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        if mode != "r":  # a writable map is the caller's own
            return reader_class(path, mode)
        key = os.path.realpath(os.fspath(path))
        if key not in readers:
            readers[key] = reader_class(path)
        return readers[key]

    def checkpoint_once(path: Any, return_tensors: bool = False, **options: Any) -> Any:
        if return_tensors or any(value is not None for value in options.values()):  # the weights: not shared
            return load_checkpoint(path, return_tensors=return_tensors, **options)
        key = os.path.realpath(os.fspath(path))
        if key not in metadata:
            metadata[key] = load_checkpoint(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    return [shared_reader, functools.cache(name_map), checkpoint_once]
