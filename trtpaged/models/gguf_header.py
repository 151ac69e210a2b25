"""A GGUF file's header, read and checked against the file before transformers or gguf parses it.

Files are untrusted. transformers builds a model at the sizes a GGUF's metadata gives, and gguf's
`GGUFReader` trusts every count, dimension and offset (about 6 s in Python on SmolLM2's 49,152-token
vocabulary, and numpy or struct errors, or a tensor read from the wrong bytes, where they are wrong).
`read_layout` walks the header once (about 0.3 s on SmolLM2: strings are skipped, not decoded), checks
every length against the bytes left before it is read, and every tensor's dimensions, type, offset,
alignment and overlap against the file; anything else is a `GGUFHeaderError` naming the entry or tensor.

    "GGUF" | version u32 (2, 3) | tensor count u64 | entry count u64 | entries:
    key (u64 length, UTF-8) | value type u32 | value (scalars, strings: u64 length + bytes,
    arrays: element type u32, count u64, elements)      all little-endian
    then per tensor: name (u64 length, UTF-8) | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64,
    then the data from the first multiple of general.alignment (default 32), each tensor at its offset
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
MAX_KEY_BYTES = 1 << 16
UINT32 = 4
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_TENSOR_NAME_BYTES = 1 << 10
MAX_TENSOR_ELEMENTS = 1 << 40
DEFAULT_ALIGNMENT = 32
_INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}  # GGUF value types
_FLOAT_FORMATS = {6: "<f", 12: "<d"}  # GGUF value types
MAX_KEPT_STRING_BYTES = 256  # string entries up to this long are kept (names, rope scaling types), longer ones skipped
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


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
            self.skip_array()
        else:
            raise GGUFHeaderError(f"value type {kind}")

    def skip_array(self) -> int:
        """Skips an array value; returns its length."""
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
        return count


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of the header: its shape (ggml order, fastest dimension first) and bytes in the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What a GGUF header says, checked against the file."""

    architecture: str
    tensors: tuple[TensorInfo, ...]
    integers: dict  # metadata key -> value, for every scalar integer entry
    array_lengths: dict  # metadata key -> length, for every array entry
    data_start: int = 0  # the data section's offset in the file (tensor offsets count from it)
    floats: dict = field(default_factory=dict)  # metadata key -> value, for every scalar float entry
    strings: dict = field(default_factory=dict)  # metadata key -> value, for every short UTF-8 string entry

    @property
    def num_elements(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def block_indices(self) -> set[int]:
        """The N of every `blk.N.` tensor: the decoder layers the file holds weights for."""
        return {int(m.group(1)) for t in self.tensors if (m := _BLOCK_INDEX.match(t.name))}


def _type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (elements per block, bytes per block), from the gguf package."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(k): (int(v[0]), int(v[1])) for k, v in GGML_QUANT_SIZES.items()}


def type_name(ggml_type: int) -> str:
    """A ggml type number's name in the gguf package (Q4_K, BF16, ...), or the number where it has none."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


@functools.cache
def dequantizable_types() -> frozenset[int]:
    """The ggml types the gguf package de-quantizes. transformers' GGUF loader passes every tensor of a file through
    gguf's `dequantize`, so one tensor of another type (Q8_K, Q1_0, F64, the integer types) fails the whole load."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    readable = set()
    for ggml_type, (_, block_bytes) in _type_sizes().items():
        try:
            dequantize(np.zeros(block_bytes, np.uint8), GGMLQuantizationType(ggml_type))  # one zero block
        except NotImplementedError:
            continue
        readable.add(ggml_type)
    return frozenset(readable)


def read_layout(path: str | os.PathLike) -> GGUFLayout:
    """The whole header of a little-endian GGUF v2/v3 file, every entry checked against the file; GGUFHeaderError
    naming the entry or tensor for anything a loader could not take (or would read outside its tensor's bytes).
    Cached per file version (path, size, modification time)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as e:
        raise GGUFHeaderError(str(e)) from None
    return _read_layout(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_layout(path: str, size: int, mtime_ns: int) -> GGUFLayout:
    del mtime_ns  # part of the cache key only
    sizes = _type_sizes()
    try:
        with open(path, "rb") as f:
            r = _Reader(f, size)
            if r.take(4) != MAGIC:
                raise GGUFHeaderError("no GGUF magic (not a GGUF file)")
            version = r.u32()
            if version not in VERSIONS:
                swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
                hint = " (a big-endian file, which is not read)" if swapped in VERSIONS else ""
                raise GGUFHeaderError(f"version {version}{hint}; versions {', '.join(map(str, VERSIONS))} are read")
            num_tensors, num_entries = r.u64(), r.u64()
            if num_entries * 12 > r.left:  # each entry takes at least its key length and type
                raise GGUFHeaderError(f"metadata entry count {num_entries} runs past the end of the file")
            if num_tensors * 24 > r.left:  # each tensor entry takes at least a name length, n_dims, type, offset
                raise GGUFHeaderError(f"tensor count {num_tensors} runs past the end of the file")
            architecture, alignment, integers, array_lengths = None, DEFAULT_ALIGNMENT, {}, {}
            floats, strings = {}, {}
            for i in range(num_entries):
                length = r.u64()
                if length > MAX_KEY_BYTES:
                    raise GGUFHeaderError(f"metadata entry {i}: a key of {length} bytes")
                name, kind = r.take(length), r.u32()
                if name == b"general.architecture":
                    if kind != STRING:
                        raise GGUFHeaderError(f"general.architecture: value type {kind}, not a string")
                    architecture = r.take(r.u64()).decode()
                elif name == b"general.alignment":
                    if kind != UINT32:
                        raise GGUFHeaderError(f"general.alignment: value type {kind}, not a uint32")
                    alignment = r.u32()
                    if alignment < 1 or alignment & (alignment - 1):
                        raise GGUFHeaderError(f"general.alignment: {alignment} is not a power of two")
                elif kind == ARRAY:
                    array_lengths[name.decode()] = r.skip_array()
                elif kind in _INTEGER_FORMATS:
                    integers[name.decode()] = struct.unpack(_INTEGER_FORMATS[kind], r.take(SCALAR_BYTES[kind]))[0]
                elif kind in _FLOAT_FORMATS:
                    floats[name.decode()] = struct.unpack(_FLOAT_FORMATS[kind], r.take(SCALAR_BYTES[kind]))[0]
                elif kind == STRING:
                    length = r.u64()
                    key = name.decode()
                    if length <= MAX_KEPT_STRING_BYTES:
                        value = r.take(length)
                        try:  # the spec's strings are UTF-8; one that is not is skipped as a long one is, not refused
                            strings[key] = value.decode()
                        except UnicodeDecodeError:
                            pass
                    else:
                        r.skip(length)
                else:
                    r.skip_value(kind)
            if architecture is None:
                raise GGUFHeaderError("general.architecture: missing")
            tensors, names = [], set()
            for i in range(num_tensors):
                tensors.append(_tensor_info(r, i, sizes))
                if tensors[-1].name in names:
                    raise GGUFHeaderError(f"tensor {tensors[-1].name!r}: listed twice")
                names.add(tensors[-1].name)
            data_start = -(-(size - r.left) // alignment) * alignment
    except OSError as e:
        raise GGUFHeaderError(str(e)) from None
    except UnicodeDecodeError as e:
        raise GGUFHeaderError(f"a key or name is not UTF-8: {e}") from None
    _check_placement(tensors, alignment, size - data_start)
    return GGUFLayout(architecture, tuple(tensors), integers, array_lengths, data_start, floats, strings)


F32 = 0  # ggml's type number of float32


def read_f32_tensor(path: str | os.PathLike, layout: GGUFLayout, tensor: TensorInfo) -> list[float]:
    """The values of a float32 tensor of the file (its placement checked by `read_layout`); for small tensors."""
    if tensor.ggml_type != F32:
        raise GGUFHeaderError(f"tensor {tensor.name!r}: ggml type {tensor.ggml_type}, not float32")
    with open(path, "rb") as f:
        f.seek(layout.data_start + tensor.offset)
        data = f.read(tensor.nbytes)
    if len(data) != tensor.nbytes:
        raise GGUFHeaderError(f"tensor {tensor.name!r}: the file ends inside it")
    return list(struct.unpack(f"<{tensor.nbytes // 4}f", data))


def _tensor_info(r: _Reader, index: int, sizes: dict[int, tuple[int, int]]) -> TensorInfo:
    length = r.u64()
    if length > MAX_TENSOR_NAME_BYTES:
        raise GGUFHeaderError(f"tensor {index}: a name of {length} bytes")
    name = r.take(length).decode()
    n_dims = r.u32()
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFHeaderError(f"tensor {name!r}: {n_dims} dimensions (1 to {MAX_DIMS})")
    shape = tuple(r.u64() for _ in range(n_dims))
    elements = 1
    for d in shape:
        if d < 1:
            raise GGUFHeaderError(f"tensor {name!r}: shape {list(shape)} has an empty dimension")
        elements *= d
        if elements > MAX_TENSOR_ELEMENTS:
            raise GGUFHeaderError(f"tensor {name!r}: shape {list(shape)} exceeds {MAX_TENSOR_ELEMENTS} elements")
    ggml_type = r.u32()
    if ggml_type not in sizes:
        raise GGUFHeaderError(f"tensor {name!r}: ggml type {ggml_type} is not one the gguf package knows")
    block, block_bytes = sizes[ggml_type]
    if shape[0] % block:
        raise GGUFHeaderError(f"tensor {name!r}: its first dimension {shape[0]} is not a multiple of its type's "
                              f"block of {block}")  # fmt: skip
    return TensorInfo(name, shape, ggml_type, r.u64(), elements // block * block_bytes)


def _check_placement(tensors: list[TensorInfo], alignment: int, data_bytes: int) -> None:
    """Every tensor's bytes lie inside the data section, at an aligned offset, and no two overlap."""
    if data_bytes < 0 and tensors:
        raise GGUFHeaderError("the file ends before its data section")
    end, last = 0, None
    for t in sorted(tensors, key=lambda t: t.offset):
        if t.offset % alignment:
            raise GGUFHeaderError(f"tensor {t.name!r}: offset {t.offset} is not a multiple of the alignment "
                                  f"{alignment}")
        if t.offset + t.nbytes > data_bytes:
            raise GGUFHeaderError(f"tensor {t.name!r}: its {t.nbytes} bytes at offset {t.offset} run past the end of "
                                  f"the file (the data section holds {data_bytes} bytes)")  # fmt: skip
        if t.offset < end:
            raise GGUFHeaderError(f"tensor {t.name!r}: its bytes at offset {t.offset} overlap {last!r}'s")
        end, last = t.offset + t.nbytes, t.name
