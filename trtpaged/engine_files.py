"""An engine dir's files checked against its manifest: engine dirs are untrusted input.

`verify_engine_dir` runs before anything of an engine dir is loaded (`LLM`, `serve`, `generate`,
`inspect`, each tensor-parallel worker). It checks that every file the manifest names exists inside
the dir and is listed with a hash, that no other file sits in the tokenizer dir, and each weights file's
safetensors header against the file's size (offsets inside the file, no gaps or overlaps): the fast checks.
The sha256 of every file is then compared with the manifest's: in full the first time, after which a
verified-stamp is kept outside the engine dir (`$TRTPAGED_CACHE_DIR`, default `~/.cache/trtpaged`,
`verified/`), keyed by the dir's real path and each file's size, mtime, ctime and inode, so that later
loads of an unchanged dir skip the hashing. Any change to a file (which moves its ctime) or to the manifest
makes the next load hash again. `full=True` (`inspect --verify`) always hashes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trtpaged.manifest import MANIFEST_NAME, EngineDirError, Manifest, engine_path

# safetensors' own reader refuses headers above 100 MB; trtpaged's are a few KiB per layer
MAX_HEADER_BYTES = 100 << 20
# every whole-byte dtype of the format: an HF checkpoint's extra tensor of any of them is one transformers ignores
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                           "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                           "C64": 8}
STAMP_VERSION = 1


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype, shape and byte range (from the file start)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class VerifyResult:
    """How the engine dir's hashes were checked: "sha256" (every file hashed) or "stamp" (unchanged since)."""

    method: str
    files: int
    bytes: int


def read_safetensors_header(path: Path, field: str = "weights_file") -> dict[str, TensorEntry]:
    """The tensors of a safetensors file, checked against the file's size; raises EngineDirError.

    The header length must fit the file and MAX_HEADER_BYTES, the header must be a JSON object of
    known dtypes and non-negative shapes, and the tensors' byte ranges must tile the data exactly.
    """
    def bad(message: str) -> EngineDirError:
        return EngineDirError(path, field, f"not a valid safetensors file: {message}")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise bad(f"header length {header_len} exceeds the file ({size} bytes) or {MAX_HEADER_BYTES}")
            raw = f.read(header_len)
    except OSError as e:
        raise EngineDirError(path, field, f"cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("the header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_bytes = size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(name, info, 8 + header_len, bad)
        if entry.end > size:
            raise bad(f"tensor {name!r} ends at byte {entry.end}, past the end of the file ({size} bytes): truncated")
        entries[name] = entry
    position = 8 + header_len
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != position:
            raise bad(f"tensor {name!r} starts at byte {entry.start}, expected {position} (a gap or an overlap)")
        position = entry.end
    if position - 8 - header_len != data_bytes:
        raise bad(f"the tensors hold {position - 8 - header_len} bytes, the file has {data_bytes} after the header")
    return entries


def _entry(name: str, info: Any, base: int, bad) -> TensorEntry:
    if not isinstance(info, dict):
        raise bad(f"tensor {name!r} is not described by an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BYTES:
        raise bad(f"tensor {name!r} has dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40
                                              for d in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    if offsets[1] - offsets[0] != numel * SAFETENSORS_DTYPE_BYTES[dtype]:
        raise bad(f"tensor {name!r}: shape {shape} of {dtype} is {numel * SAFETENSORS_DTYPE_BYTES[dtype]} bytes, "
                  f"its data_offsets hold {offsets[1] - offsets[0]}")
    return TensorEntry(dtype, tuple(shape), base + offsets[0], base + offsets[1])


def held_weight_bytes(engine_dir: Path, manifest: Manifest) -> int:
    """Bytes of rank 0's weights as the runtime holds them (the quantized codes and scales where quantized).
    The manifest's figure is untrusted: anything but a whole number of bytes >= 0 is an EngineDirError."""
    held = manifest.quantization.get("weight_bytes")
    if held is not None and (isinstance(held, bool) or not isinstance(held, int) or held < 0):
        raise EngineDirError(engine_dir / MANIFEST_NAME, "quantization.weight_bytes",
                             f"expected a whole number of bytes >= 0, got {held!r}", limit=0)  # fmt: skip
    if held:
        return held
    path = engine_dir / manifest.weights_file  # rank 0's shard: what one device holds
    return path.stat().st_size if path.is_file() else 0


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_engine_dir(engine_dir: str | Path, manifest: Manifest, full: bool = False) -> VerifyResult:
    """Checks the engine dir's files against `manifest` (see the module docstring); raises EngineDirError."""
    root = Path(engine_dir).resolve()
    listed = _check_layout(root, manifest)
    for field, rel in _weight_fields(manifest):
        read_safetensors_header(root / rel, field)
    stats = {rel: _stat_key(root / rel) for rel in sorted(listed)}
    manifest_digest = sha256_file(root / MANIFEST_NAME)
    stamp = _stamp_path(root)
    total = sum(key[0] for key in stats.values())
    if not full and stamp is not None and _read_stamp(stamp) == _stamp(root, manifest_digest, stats):
        return VerifyResult("stamp", len(stats), total)
    for rel in sorted(listed):
        got, want = sha256_file(root / rel), manifest.files[rel]
        if got != want:
            raise EngineDirError(root / rel, f"files[{rel!r}]", f"sha256 {got[:16]}... differs from the manifest's "
                                 f"{want[:16]}...: the file changed after the build; rebuild the engine")
    if stamp is not None:
        _write_stamp(stamp, _stamp(root, manifest_digest, stats))
    return VerifyResult("sha256", len(stats), total)


def _weight_fields(manifest: Manifest) -> list[tuple[str, str]]:
    if manifest.tensor_parallel == 1:
        return [("weights_file", manifest.weights_file)]
    return [(f"shards[{r}].weights_file", manifest.shards[r]["weights_file"]) for r in range(manifest.tensor_parallel)]


def _check_layout(root: Path, m: Manifest) -> set[str]:
    """Every named file inside the dir, regular and hashed in the manifest; the tokenizer dir holds only
    listed files. Returns the listed files."""
    for field, rel in m.file_fields():
        path = engine_path(root, rel, field)
        if field == "tokenizer_dir":
            if not path.is_dir():
                raise EngineDirError(path, field, "missing or not a directory; rebuild the engine")
            continue
        if not path.is_file():
            raise EngineDirError(path, field, "missing or not a regular file; rebuild the engine")
        if not field.startswith("files[") and rel not in m.files:
            raise EngineDirError(path, field, "not listed in the manifest's files (no hash to check it against)")
    for dirpath, dirnames, filenames in os.walk(root / m.tokenizer_dir):  # symlinked dirs are not entered
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            engine_path(root, rel, "tokenizer_dir")  # a symlink out of the dir
            if name in filenames and rel not in m.files:
                raise EngineDirError(path, "tokenizer_dir", "a file the manifest does not list (no hash to check "
                                     "it against)")
    return set(m.files)


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _stamp(root: Path, manifest_digest: str, stats: dict[str, tuple[int, int, int, int]]) -> dict[str, Any]:
    return {"version": STAMP_VERSION, "engine_dir": str(root), "manifest_sha256": manifest_digest,
            "files": {rel: list(key) for rel, key in stats.items()}}


def _stamp_path(root: Path) -> Optional[Path]:
    base = os.environ.get("TRTPAGED_CACHE_DIR")
    if not base:
        home = os.path.expanduser("~")
        if not os.path.isdir(home):  # HOME unset or nowhere (e.g. /nonexistent, which must never be made)
            return None
        base = os.path.join(home, ".cache", "trtpaged")
    if not os.path.isabs(base):
        return None
    stamp = Path(base) / "verified" / (hashlib.sha256(str(root).encode()).hexdigest() + ".json")
    if stamp.resolve() == root or root in stamp.resolve().parents:
        return None  # the stamp must live outside the dir it vouches for
    return stamp


def _read_stamp(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None


def _write_stamp(path: Path, stamp: dict) -> None:
    """Atomically; a cache dir that cannot be written only means the next load hashes again."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".stamp-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(stamp, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:  # a full filesystem: the half-written stamp goes (was one left per load)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
