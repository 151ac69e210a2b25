"""Renamed settings: the old spellings, still read for one release (deprecated), in one table.

Each setting has one name in model.yaml, on the command line, in the manifest and in the Python API:
`kv_cache_dtype` (`--kv-cache-dtype`) and `num_kv_blocks` (`--num-kv-blocks`). Input written with an old
spelling (a command line, a model.yaml, an engine dir built before the rename) is read as the new name with
a FutureWarning; giving both spellings is an error. The C side keeps the same table for what it reads
(plugins/src/runtime/engine_dir.cpp: the manifest; plugins/src/tensorrt/fields.cpp: plugin fields of older
engine.plan files).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

# old spelling -> the setting's one name
RENAMED_KEYS = {"kv_dtype": "kv_cache_dtype", "num_blocks": "num_kv_blocks"}
RENAMED_OPTIONS = {"--kv-dtype": "--kv-cache-dtype", "--kv-blocks": "--num-kv-blocks",
                   "--num-blocks": "--num-kv-blocks"}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning,
                  stacklevel=3)


def renamed_keys(data: Mapping[str, Any], prefix: str = "",
                 fail: Optional[Callable[[str, str], Exception]] = None) -> dict[str, Any]:
    """`data` with each deprecated key (RENAMED_KEYS) under its new name, a FutureWarning per renamed key.

    Both spellings of one setting raise `fail(field, message)` (ValueError when no `fail` is given);
    `prefix` ("kv_cache.") names the fields in messages."""
    out = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old not in out:
            continue
        if new in out:
            message = f"set twice: {prefix}{old} is the deprecated spelling of {prefix}{new}; keep {prefix}{new}"
            raise (fail or (lambda _field, m: ValueError(m)))(prefix + new, message)
        _deprecated(prefix + old, prefix + new)
        out[new] = out.pop(old)
    return out


def renamed_options(args: Sequence[str]) -> list[str]:
    """Command-line `args` with each deprecated option (RENAMED_OPTIONS, as `--opt V` or `--opt=V`) spelled
    the new way, a FutureWarning per renamed option."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":  # the rest are arguments, not options
            return out + list(args[i:])
        name, eq, value = arg.partition("=")
        new = RENAMED_OPTIONS.get(name)
        if new is not None:
            _deprecated(name, new)
            arg = new + eq + value
        out.append(arg)
    return out
