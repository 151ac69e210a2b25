"""Local-disk store (a tier through checked.py): one file per entry under a directory, persistent across restarts,
bounded in size.

Files are written to a temporary name and renamed into place (a crash leaves no
half-written entry under a real name; a truncated one from elsewhere fails its
checks). Recency is kept in memory and in the file's mtime, refreshed on each
hit, so the least recently used entries go first when the directory outgrows
`capacity_bytes`, also across restarts. An entry that fails its checks is
removed (`discard`), so the next write-back of that block replaces it.

Each engine keeps its entries in a subdirectory named by its fingerprint (`namespace`): engines sharing a
directory never count or evict each other's files (a small tier starting beside a large one evicted all of its
entries), while replicas of one engine share theirs. A full filesystem makes room by evicting this tier's oldest
entries, a directory removed under a running server is made again, and failures are logged (the first, then at
most one a minute) as well as counted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from trtpaged.runtime.kv_tiers.base import TierCounters

SUFFIX = ".kv"
LOG_EVERY_S = 60.0  # after the first, at most one failure line a minute
STALE_S = 24 * 3600.0  # other namespaces' entries unused this long may go when the directory is over size
_NAMESPACE = re.compile(r"[0-9a-f]{16}")
log = logging.getLogger("trtpaged.runtime")


def namespace_of(fingerprint: bytes) -> str:
    """The subdirectory an engine's entries live in: its fingerprint's first 8 bytes, in hex (16 characters)."""
    return fingerprint[:8].hex()


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


def _entries(directory: str | os.PathLike) -> list[tuple[int, str, int]]:
    """(mtime in ns, path, size) of each entry file in `directory` (regular files only, not through links)."""
    found = []
    for entry in os.scandir(directory):
        if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            found.append((st.st_mtime_ns, entry.path, st.st_size))
    return found


ABANDONED_WRITE_S = 60.0  # a temp file this old, of a process that is gone, is a write killed half-way


def remove_abandoned_writes(directory: str | os.PathLike) -> int:
    """Removes the temp files of entry writes whose process died before the rename (".NAME.kv.PID.TID.tmp", older
    than ABANDONED_WRITE_S): no scan counted them, so each crash left up to an entry's bytes beyond the tier's size
    for ever. A write that a live process may still be making, or a recent one (another container's pids are not
    seen here), is kept. Returns how many went."""
    removed, old_before = 0, time.time() - ABANDONED_WRITE_S
    for entry in os.scandir(directory):
        parts = entry.name.split(".")
        if not (entry.name.startswith(".") and entry.name.endswith(".tmp") and len(parts) >= 5 and parts[-3].isdigit()):
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
            if mtime > old_before or _writer_may_live(int(parts[-3]), mtime):
                continue
            os.unlink(entry.path)
            removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed


def _writer_may_live(pid: int, written_at: float) -> bool:
    """Whether process `pid` may still be writing a temp file last written at `written_at`: it runs, and it
    started before then (a restarted server often gets its old pid back, in a container pid 1: a process that
    started after the write is not its writer). Unknown start times count as alive."""
    if not 0 < pid <= 1 << 22:  # past any pid_max: no process's
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    started = _process_start(pid)
    return started is None or started <= written_at


def _process_start(pid: int) -> Optional[float]:
    """When `pid` started (seconds since the epoch), from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime, after the command name
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _remove_quietly(path: Path) -> None:
    """Removes a failed write's temp file, if it can: on a read-only filesystem the unlink itself fails (EROFS, even
    for a file that is not there), which raised out of the tier and cost the tiers after it their write-back."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class DiskTier:
    slow = True

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, name: str = "disk", namespace: str = "") -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_tiers.disk.size: must be > 0 bytes, got {capacity_bytes}")
        self.name = name
        self.root = writable_dir(Path(path) / namespace if namespace else path)
        self.capacity_bytes = capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._logged_at: Optional[float] = None  # when a failure was last logged
        free = shutil.disk_usage(self.root).free
        if free < capacity_bytes:
            log.warning("kv tier %s: %s has %d bytes free, less than the tier's size (%d); it will evict its oldest "
                        "entries when the filesystem is full", name, self.root, free, capacity_bytes)
        # file name -> bytes of the entries on disk, least recently used first (a dict in order: an eviction takes the
        # first entries, where a scan of every file's mtime grew with the entries, 79 ms a write-back at 20,000)
        self._sizes: OrderedDict[str, int] = OrderedDict()
        remove_abandoned_writes(self.root)
        for _, entry, size in sorted(_entries(self.root)):
            self._sizes[os.path.basename(entry)] = size
        self._bytes = sum(self._sizes.values())
        with self._lock:
            self._evict_to(self.capacity_bytes)  # a smaller size than the last run's
        if namespace:
            self._evict_stale_neighbours(Path(path))

    def _evict_stale_neighbours(self, parent: Path) -> None:
        """Removes the entries of other namespaces (other engines, or older builds of this one: a rebuild is another
        fingerprint) and of the layout before namespaces that nobody used for STALE_S, oldest first, while the
        whole directory is over this tier's size: what no running engine counts would otherwise stay for ever."""
        try:
            neighbours = self._neighbours(parent)
            found = [entry for directory in (parent, *neighbours) for entry in _entries(directory)]
        except OSError as e:
            self._failed("a scan of other engines' entries", e)
            return
        total = self._bytes + sum(size for _, _, size in found)
        stale_before = (time.time() - STALE_S) * 1e9
        for mtime_ns, path, size in sorted(found):
            if total <= self.capacity_bytes or mtime_ns > stale_before:
                break
            try:
                os.unlink(path)
                total -= size
            except OSError as e:
                self._failed("removing a stale entry", e)
        for neighbour in neighbours:  # namespaces left empty go
            try:
                os.rmdir(neighbour)
            except OSError:
                pass  # not empty: in use or not yet stale

    def _neighbours(self, parent: Path) -> list[str]:
        """The other namespaces' directories under `parent`."""
        return [entry.path for entry in os.scandir(parent) if _NAMESPACE.fullmatch(entry.name)
                and entry.path != str(self.root) and entry.is_dir(follow_symlinks=False)]

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
            self._failed("a read", e)  # out of descriptors, EIO, ...: the entry may be good, so it stays
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
        except OSError as e:
            self._failed("a read", e)
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

    def touch(self, key: bytes) -> bool:
        """Whether an entry file is there (another process's too, as `get` finds them), its recency set as a read's."""
        path = self.path_of(key)
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as e:
            self._failed("a probe", e)
            return False
        with self._lock:
            if path.name in self._sizes:
                self._sizes.move_to_end(path.name)
        return True

    def put(self, key: bytes, entry: bytes) -> None:
        if len(entry) > self.capacity_bytes:
            self.counters.dropped += 1
            return
        path = self.path_of(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with self._lock:
            self._evict_to(self.capacity_bytes - len(entry))
            try:
                self._write(tmp, path, entry)
            except OSError as e:
                self.counters.dropped += 1
                self._failed("a write-back (dropped)", e)
                _remove_quietly(tmp)
                return
            self._bytes += len(entry) - self._sizes.get(path.name, 0)
            self._sizes[path.name] = len(entry)
            self._sizes.move_to_end(path.name)
            self.counters.puts += 1
            self.counters.bytes_written += len(entry)

    def _write(self, tmp: Path, path: Path, entry: bytes) -> None:
        """Writes `entry` under `path`; once more after making room when the filesystem is full (this tier's
        oldest entries) or the directory is gone (made again). Raises the OSError that remains."""
        for attempt in (0, 1):
            try:
                tmp.write_bytes(entry)
                os.replace(tmp, path)
                return
            except OSError as e:
                _remove_quietly(tmp)
                if attempt or e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOENT):
                    raise
                if e.errno == errno.ENOENT:  # the directory was removed: its entries with it
                    self.root.mkdir(parents=True, exist_ok=True)
                    self._sizes.clear()
                    self._bytes = 0
                else:  # the filesystem holds less than the tier's size: make room for this entry and as much again
                    self._evict_to(max(0, self._bytes - 2 * len(entry)))

    def _failed(self, what: str, error: OSError) -> None:
        """Counts a failed store operation and logs it: the first, then at most one every LOG_EVERY_S."""
        self.counters.errors += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("kv tier %s: %s failed in %s (%s); %d failures so far, %d write-backs dropped", self.name,
                        what, self.root, error.strerror or error, self.counters.errors, self.counters.dropped)

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
