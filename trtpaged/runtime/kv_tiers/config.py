"""The tiers' settings (LLM(kv_tiers=...), `trtpaged serve --kv-*`) and building the stack for one engine.

    kv_tiers = {"host_memory": "8GiB", "disk": {"path": "/var/cache/trtpaged", "size": "100GiB"},
                "remote": "redis://127.0.0.1:6379/0",      # or {"url": ..., "timeout_s": 0.5}
                "load_timeout_s": 2.0,                     # the longest a waiting request waits for its prefix
                "secret_file": "/etc/trtpaged/kv-secret"}  # disk and Redis entries signed with its bytes

Every error is a ValueError naming the field (`kv_tiers.disk.size`) and what is allowed.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from trtpaged.runtime.kv_tiers.base import KVTier
from trtpaged.runtime.kv_tiers.checked import CheckedTier, EntryCodec
from trtpaged.runtime.kv_tiers.disk import DiskTier, namespace_of, writable_dir
from trtpaged.runtime.kv_tiers.entry import engine_fingerprint, entry_bytes
from trtpaged.runtime.kv_tiers.host import HostMemoryTier
from trtpaged.runtime.kv_tiers.remote import RedisTier, check_redis_url
from trtpaged.runtime.kv_tiers.stack import TierStack

KEYS = ("host_memory", "disk", "remote", "load_timeout_s", "secret_file")
DISK_KEYS = ("path", "size")
REMOTE_KEYS = ("url", "timeout_s")
MAX_TIMEOUT_S = 60.0
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096


@dataclass(frozen=True)
class KVTierConfig:
    """Which tiers sit below the pool, top to bottom: host memory, local disk, a Redis server."""

    host_memory: int = 0  # bytes; 0: no host tier
    disk_path: Optional[str] = None
    disk_size: int = 0  # bytes
    remote: Optional[str] = field(default=None, repr=False)  # redis://HOST:PORT[/DB]; may hold a password
    remote_timeout_s: float = 0.5  # per store operation
    load_timeout_s: float = 2.0  # a waiting request's prefix read from the tiers; past it, the rest is recomputed
    # disk and Redis entries are signed and checked with it (HMAC-SHA256, entry.py): without it, whoever can write
    # to the directory or the Redis server can change answers
    secret: Optional[bytes] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.host_memory < 0:
            raise ValueError(f"kv_tiers.host_memory: must be >= 0 bytes, got {self.host_memory}")
        if (self.disk_path is None) != (self.disk_size == 0):
            raise ValueError("kv_tiers.disk: needs both path and size (> 0 bytes)")
        if self.disk_size < 0:
            raise ValueError(f"kv_tiers.disk.size: must be > 0 bytes, got {self.disk_size}")
        if self.remote is not None:
            check_redis_url(self.remote)
        if not 0 < self.remote_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"kv_tiers.remote.timeout_s: must be in (0, {MAX_TIMEOUT_S}], got {self.remote_timeout_s}")
        if not 0 < self.load_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"kv_tiers.load_timeout_s: must be in (0, {MAX_TIMEOUT_S}], got {self.load_timeout_s}")
        if self.secret is not None:
            _check_secret_size(len(self.secret), "the secret")
            if not (self.disk_path or self.remote):
                raise ValueError("kv_tiers.secret_file: signs disk and Redis entries; set disk or remote with it (the "
                                 "host tier stays in the process and is not signed)")

    @property
    def enabled(self) -> bool:
        return bool(self.host_memory or self.disk_path or self.remote)

    @classmethod
    def parse(cls, spec: Union[None, "KVTierConfig", Mapping[str, Any]]) -> "KVTierConfig":
        """From a mapping as documented above (sizes as bytes or "8GiB"); None: no tiers."""
        from trtpaged.config import parse_size

        if spec is None:
            return cls()
        if isinstance(spec, KVTierConfig):
            return spec
        if not isinstance(spec, Mapping):
            raise ValueError(f"kv_tiers: expected a mapping with keys {', '.join(KEYS)}, got {type(spec).__name__}")
        _known(spec, KEYS, "kv_tiers")

        def size(value: Any, field: str) -> int:
            try:
                n = parse_size(value)
            except ValueError as e:
                raise ValueError(f"{field}: {e}") from None
            if n < 1:
                raise ValueError(f"{field}: must be > 0 bytes, got {value!r}")
            return n

        values: dict[str, Any] = {}
        if spec.get("load_timeout_s") is not None:
            t = spec["load_timeout_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)):
                raise ValueError(f"kv_tiers.load_timeout_s: expected seconds, got {t!r}")
            values["load_timeout_s"] = float(t)
        if spec.get("host_memory") is not None:
            values["host_memory"] = size(spec["host_memory"], "kv_tiers.host_memory")
        if spec.get("secret_file") is not None:
            values["secret"] = read_secret(spec["secret_file"])
        disk = spec.get("disk")
        if disk is not None:
            if not isinstance(disk, Mapping) or "path" not in disk or "size" not in disk:
                raise ValueError("kv_tiers.disk: expected {path: DIR, size: SIZE}")
            _known(disk, DISK_KEYS, "kv_tiers.disk")
            if not isinstance(disk["path"], str) or not disk["path"]:
                raise ValueError(f"kv_tiers.disk.path: expected a directory path, got {disk['path']!r}")
            values["disk_path"], values["disk_size"] = disk["path"], size(disk["size"], "kv_tiers.disk.size")
        remote = spec.get("remote")
        if remote is not None:
            if isinstance(remote, Mapping):
                _known(remote, REMOTE_KEYS, "kv_tiers.remote")
                if "timeout_s" in remote:
                    t = remote["timeout_s"]
                    if isinstance(t, bool) or not isinstance(t, (int, float)):
                        raise ValueError(f"kv_tiers.remote.timeout_s: expected seconds, got {t!r}")
                    values["remote_timeout_s"] = float(t)
                remote = remote.get("url")
            if not isinstance(remote, str):
                raise ValueError(f"kv_tiers.remote: expected redis://HOST:PORT[/DB], got {remote!r}")
            values["remote"] = remote
        return cls(**values)

    def check_room(self, block_size: int, block_bytes: int) -> None:
        """Refuses (ValueError naming it) a host or disk size too small for one entry of `block_bytes` (one block of
        every tensor-parallel rank), and a disk path this process cannot write. LLM calls it with the manifest's
        figure before any weight is loaded."""
        one = entry_bytes(block_size, block_bytes)
        for key, size in (("kv_tiers.host_memory", self.host_memory), ("kv_tiers.disk.size", self.disk_size)):
            if size and size < one:
                raise ValueError(f"{key}: {size} bytes hold no block; one block's entry is {one} bytes")
        if self.disk_path:
            writable_dir(self.disk_path)

    def build(self, fingerprint: bytes, block_bytes: int) -> Optional[TierStack]:
        """The stack for one engine (None without tiers); the remote tier connects lazily. Sizes too small for one
        entry are `check_room`'s to refuse, before the engine loads."""
        if not self.enabled:
            return None
        tiers: list[KVTier] = []
        codec = EntryCodec(fingerprint, block_bytes, self.secret)
        if self.host_memory:
            tiers.append(HostMemoryTier(self.host_memory))
        if self.disk_path:
            disk = DiskTier(self.disk_path, self.disk_size, namespace=namespace_of(fingerprint))
            tiers.append(CheckedTier(disk, codec))
        if self.remote:
            tiers.append(CheckedTier(RedisTier(self.remote, timeout_s=self.remote_timeout_s), codec))
        return TierStack(tiers, fingerprint, load_timeout_s=self.load_timeout_s)


def read_secret(path: Any) -> bytes:
    """The bytes of a secret file, less a trailing newline; ValueError naming kv_tiers.secret_file."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"kv_tiers.secret_file: expected a file path, got {path!r}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise ValueError(f"kv_tiers.secret_file: {path} is not a regular file")
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 2)
    except OSError as e:
        raise ValueError(f"kv_tiers.secret_file: {path} cannot be read ({e.strerror or e})") from None
    secret = secret.removesuffix(b"\n").removesuffix(b"\r")
    _check_secret_size(len(secret), str(path))
    return secret


def _check_secret_size(size: int, what: str) -> None:
    if not MIN_SECRET_BYTES <= size <= MAX_SECRET_BYTES:
        raise ValueError(f"kv_tiers.secret_file: {what} holds {size} bytes; a secret is {MIN_SECRET_BYTES} to "
                         f"{MAX_SECRET_BYTES} bytes (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")


def _known(spec: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in spec:
        if key not in allowed:
            raise ValueError(f"{where}.{key}: unknown key; allowed: {', '.join(allowed)}")


def manifest_fingerprint(manifest: Any, block_shape: tuple[int, ...], pool_dtype: str) -> bytes:
    """An engine's tier fingerprint: its files' digests (model and weights; every rank's shard), dtypes,
    block size, one rank's block shape and the tensor-parallel world size (an entry holds every rank's
    shard in rank order). Anything else is free to change between runs."""
    return engine_fingerprint(files=manifest.files, source=manifest.source, dtype=manifest.dtype,
                              kv_cache_dtype=manifest.kv_cache_dtype, block_size=manifest.limits.block_size,
                              ranks=manifest.tensor_parallel, block_shape=list(block_shape), pool_dtype=pool_dtype)
