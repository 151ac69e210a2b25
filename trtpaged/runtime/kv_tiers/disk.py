"""Local-disk store (a tier through checked.py): one file per entry under a directory, persistent across restarts,
bounded in size.

Files are written to a temporary name and renamed into place (a crash leaves no
half-written entry under a real name; a truncated one from elsewhere fails its
checks). Recency is the file's mtime, refreshed on each hit, so the least
recently used entries go first when the directory outgrows `capacity_bytes`,
also across restarts.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Optional

from trtpaged.runtime.kv_tiers.base import TierCounters

SUFFIX = ".kv"


class DiskTier:
    slow = True

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, name: str = "disk") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_tiers.disk.size: must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.root = Path(path)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"kv_tiers.disk.path: {self.root} cannot be written ({e.strerror or e})") from None
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # file name -> bytes, for the entries on disk
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                self._sizes[entry.name] = entry.stat().st_size
        self._bytes = sum(self._sizes.values())
        with self._lock:
            self._evict_to(self.capacity_bytes)  # a smaller size than the last run's

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def num_entries(self) -> int:
        return len(self._sizes)

    def path_of(self, key: bytes) -> Path:
        return self.root / (key.hex() + SUFFIX)

    def get(self, key: bytes) -> Optional[bytes]:
        path = self.path_of(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            return None
        except OSError:
            self.counters.errors += 1
            return None
        return data

    def contains(self, key: bytes) -> bool:
        return self.path_of(key).name in self._sizes

    def put(self, key: bytes, entry: bytes) -> None:
        if len(entry) > self.capacity_bytes:
            self.counters.dropped += 1
            return
        path = self.path_of(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with self._lock:
            self._evict_to(self.capacity_bytes - len(entry))
            try:
                tmp.write_bytes(entry)
                os.replace(tmp, path)
            except OSError:
                self.counters.errors += 1
                self.counters.dropped += 1
                tmp.unlink(missing_ok=True)
                return
            self._bytes += len(entry) - self._sizes.get(path.name, 0)
            self._sizes[path.name] = len(entry)
            self.counters.puts += 1
            self.counters.bytes_written += len(entry)

    def _evict_to(self, limit: int) -> None:
        if self._bytes <= limit:
            return
        by_age = []
        for name in self._sizes:
            try:
                by_age.append(((self.root / name).stat().st_mtime_ns, name))
            except FileNotFoundError:
                by_age.append((0, name))
        for _, name in sorted(by_age):
            if self._bytes <= limit:
                break
            (self.root / name).unlink(missing_ok=True)
            self._bytes -= self._sizes.pop(name)
            self.counters.evictions += 1

    def close(self) -> None:
        pass
