"""Local-disk store (a tier through checked.py): one file per entry under a directory, persistent across restarts,
bounded in size.

Files are written to a temporary name and renamed into place (a crash leaves no
half-written entry under a real name; a truncated one from elsewhere fails its
checks). Recency is kept in memory and in the file's mtime, refreshed on each
hit, so the least recently used entries go first when the directory outgrows
`capacity_bytes`, also across restarts. An entry that fails its checks is
removed (`discard`), so the next write-back of that block replaces it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from trtpaged.runtime.kv_tiers.base import TierCounters

SUFFIX = ".kv"


def writable_dir(path: str | os.PathLike) -> Path:
    """`path` as a directory this process can write (made if missing); ValueError naming kv_tiers.disk.path."""
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"kv_tiers.disk.path: {root} cannot be written ({e.strerror or e})") from None
    return root


class DiskTier:
    slow = True

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, name: str = "disk") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_tiers.disk.size: must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.root = writable_dir(path)
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        # file name -> bytes of the entries on disk, least recently used first (a dict in order: an eviction takes the
        # first entries, where a scan of every file's mtime grew with the entries, 79 ms a write-back at 20,000)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._sizes[name] = size
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

    def get(self, key: bytes, max_bytes: Optional[int] = None) -> Optional[bytes]:
        path = self.path_of(key)
        try:
            # non-blocking, not through a link: a FIFO under an entry's name would block the loader (and shutdown)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            if path.name in self._sizes:
                with self._lock:  # removed by someone else (not just renamed in by put): no longer counted
                    if not os.path.lexists(path):
                        self._bytes -= self._sizes.pop(path.name, 0)
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # a link or a socket under the name: a bad entry
                return b""
            self.counters.errors += 1  # out of descriptors, EIO, ...: the entry may be good, so it stays
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            limit = (max_bytes + 1) if max_bytes is not None else None
            chunks, got = [], 0
            while limit is None or got < limit:
                chunk = os.read(fd, (limit - got) if limit is not None else 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            os.utime(fd)  # the recency a restart sorts by
        except OSError:
            self.counters.errors += 1
            return None
        finally:
            os.close(fd)
        with self._lock:
            if path.name in self._sizes:
                self._sizes.move_to_end(path.name)
        return b"".join(chunks)

    def discard(self, key: bytes) -> None:
        path = self.path_of(key)
        with self._lock:
            self._bytes -= self._sizes.pop(path.name, 0)
        try:  # outside the lock: a planted directory tree may take a while
            path.unlink(missing_ok=True)
        except IsADirectoryError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            self.counters.errors += 1

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
            self._sizes.move_to_end(path.name)
            self.counters.puts += 1
            self.counters.bytes_written += len(entry)

    def _evict_to(self, limit: int) -> None:
        while self._bytes > limit and self._sizes:
            name, size = self._sizes.popitem(last=False)
            try:
                (self.root / name).unlink(missing_ok=True)
            except OSError:
                self.counters.errors += 1
            self._bytes -= size
            self.counters.evictions += 1

    def close(self) -> None:
        pass
