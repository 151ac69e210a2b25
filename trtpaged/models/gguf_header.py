"""One string from a GGUF file's metadata, read from the header without parsing the rest of it.

The gguf package's `GGUFReader` parses every metadata field and tensor entry in Python: about 6 s on
SmolLM2's GGUF (its 49,152-token vocabulary), once per reader. The pre-flight check needs only
`general.architecture`, which GGUF writers put among the first entries, so this reads entries in order
until it finds the key and stops there (about a millisecond). Files are untrusted: every length is
checked against the bytes left before it is read, and anything unexpected is a `GGUFHeaderError`, after
which the caller falls back to `GGUFReader`.

    "GGUF" | version u32 (2, 3) | tensor count u64 | entry count u64 | entries:
    key (u64 length, UTF-8) | value type u32 | value (scalars, strings: u64 length + bytes,
    arrays: element type u32, count u64, elements)      all little-endian
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Optional

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
MAX_KEY_BYTES = 1 << 16


class GGUFHeaderError(ValueError):
    """The header is not one this reader follows (or not a GGUF file at all)."""


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.left = size

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.left:
            raise GGUFHeaderError(f"a length of {n} bytes runs past the end of the file")
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFHeaderError("the file ended early")
        self.left -= n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or n > self.left:
            raise GGUFHeaderError(f"a length of {n} bytes runs past the end of the file")
        self.f.seek(n, os.SEEK_CUR)
        self.left -= n

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def skip_value(self, kind: int) -> None:
        if kind in SCALAR_BYTES:
            self.skip(SCALAR_BYTES[kind])
        elif kind == STRING:
            self.skip(self.u64())
        elif kind == ARRAY:
            element, count = self.u32(), self.u64()
            if element in SCALAR_BYTES:
                self.skip(count * SCALAR_BYTES[element])
            elif element == STRING:
                if count * 8 > self.left:  # each string takes at least its length field
                    raise GGUFHeaderError(f"an array of {count} strings runs past the end of the file")
                for _ in range(count):
                    self.skip(self.u64())
            else:
                raise GGUFHeaderError(f"array element type {element}")
        else:
            raise GGUFHeaderError(f"value type {kind}")


def read_string_field(path: str | os.PathLike, key: str, max_entries: int = 64) -> Optional[str]:
    """The string value of metadata `key`, looked for among the first `max_entries` entries of a little-endian
    GGUF v2/v3 file; None when it is not among them or not a string; GGUFHeaderError for anything else."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            r = _Reader(f, size)
            if r.take(4) != MAGIC:
                raise GGUFHeaderError("no GGUF magic")
            version = r.u32()
            if version not in VERSIONS:
                raise GGUFHeaderError(f"version {version}")
            r.u64()  # tensor count
            entries = r.u64()
            for _ in range(min(entries, max_entries)):
                length = r.u64()
                if length > MAX_KEY_BYTES:
                    raise GGUFHeaderError(f"a key of {length} bytes")
                name, kind = r.take(length), r.u32()
                if name == key.encode():
                    return r.take(r.u64()).decode() if kind == STRING else None
                r.skip_value(kind)
    except OSError as e:
        raise GGUFHeaderError(str(e)) from None
    except UnicodeDecodeError as e:
        raise GGUFHeaderError(f"not UTF-8: {e}") from None
    return None
