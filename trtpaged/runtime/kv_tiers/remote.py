"""Remote store (a tier through checked.py): a Redis server shared by replicas (redis-py client, as LMCache's
remote backend).

Every operation has a bounded timeout. A store that is down or slow costs at most
one timeout, then the tier stays quiet for `retry_after_s` (lookups are misses,
write-backs are dropped, both counted) and the next operation after that
reconnects (redis-py's connection pool opens a new connection). Its size is the
server's business (`maxmemory` with an LRU policy; `.ci/run` starts one so);
`ttl_s` optionally expires entries.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Optional
from urllib.parse import urlparse

from trtpaged.runtime.kv_tiers.base import TierCounters

KEY_PREFIX = b"trtpaged:kv:"
log = logging.getLogger("trtpaged.runtime")


def redacted(url: str) -> str:
    """The URL as messages and logs may show it: a password in it (before the host, or a password= option)
    replaced by ***."""
    parsed = urlparse(url)
    if parsed.password is None and not re.search(r"(?i)(^|&)password=", parsed.query):
        return url
    if parsed.password is not None:
        parsed = parsed._replace(netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@", 1))
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parsed.query)
    return parsed._replace(query=query).geturl()


def check_redis_url(url: str) -> str:
    """The URL if it is a redis:// (or rediss://, unix://) URL with a host; ValueError naming `remote` otherwise."""
    shown = repr(redacted(url))
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix") or (parsed.scheme != "unix" and not parsed.hostname):
        raise ValueError(f"kv_tiers.remote: expected redis://HOST:PORT[/DB], got {shown}")
    try:
        parsed.port  # noqa: B018  (parses it: out of range raises)
    except ValueError as e:
        raise ValueError(f"kv_tiers.remote: {e} in {shown}") from None
    db = parsed.path.strip("/") if parsed.scheme != "unix" else ""
    if db and not db.isdigit():  # redis-py would use database 0 for "abc" and fail every operation for "-1"
        raise ValueError(f"kv_tiers.remote: the database after the host must be a number >= 0, got {db!r} in {shown}")
    _check_url_options(url, shown)
    return url


def _check_url_options(url: str, shown: str) -> None:
    """The URL's query options as redis-py reads them, tried on a connection object (nothing is opened): an option
    it does not know failed every operation later with a TypeError that no tier counts as the store's."""
    try:
        import redis
    except ImportError:
        return  # RedisTier says that the client is missing
    try:
        redis.ConnectionPool.from_url(url).make_connection()
    except (TypeError, ValueError, redis.RedisError) as e:
        message = str(e).replace("AbstractConnection.__init__() got an unexpected keyword argument", "unknown option")
        raise ValueError(f"kv_tiers.remote: {message} (in {shown})") from None


class RedisTier:
    slow = True

    def __init__(self, url: str, timeout_s: float = 0.5, retry_after_s: float = 1.0, ttl_s: Optional[int] = None,
                 name: str = "remote") -> None:  # fmt: skip
        try:
            import redis
        except ImportError:
            raise ValueError("kv_tiers.remote: the redis Python client is not installed (pip install redis)") from None
        if not timeout_s > 0:
            raise ValueError(f"kv_tiers.remote.timeout_s: must be > 0 seconds, got {timeout_s}")
        self.name = name
        self.url = check_redis_url(url)
        self.counters = TierCounters()
        self.retry_after_s = retry_after_s
        self.ttl_s = ttl_s
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError, redis.ResponseError,
                        redis.exceptions.InvalidResponse)
        self._full = redis.exceptions.OutOfMemoryError  # maxmemory reached under the noeviction policy
        self._said_full = False
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False, health_check_interval=0)
        self._down_until = 0.0
        self._failing = False  # since the last failure, nothing has succeeded (logged once each way)
        self._lock = threading.Lock()  # the down-window only; redis-py's pool is thread-safe

    @property
    def is_up(self) -> bool:
        """False while the tier waits out a failure (no operation is tried)."""
        return time.monotonic() >= self._down_until

    def _call(self, fn, *args):
        if not self.is_up:
            return None
        try:
            answer = fn(*args)
        except self._errors as e:
            if isinstance(e, self._full):  # the store is up: this write is dropped, lookups go on
                return self._refused_write(e)
            if not str(e).startswith("WRONGTYPE"):
                return self._failed(e)
            answer = b""  # something else under our key: a bad entry, not a store that is down
        if self._failing:
            with self._lock:
                back, self._failing = self._failing, False
            if back:
                log.warning("kv tier %s: reachable again", self.name)
        return answer

    def _refused_write(self, e: Exception) -> None:
        if not self._said_full:
            self._said_full = True
            log.warning("kv tier %s: the Redis server refuses writes (%s); write-backs are dropped until it has room. "
                        "Run it with --maxmemory-policy allkeys-lru so that old blocks make room for new ones",
                        self.name, str(e)[:200])

    def _failed(self, e: Exception) -> None:
        """Counts the failure and keeps the tier quiet for retry_after_s; the first of a run is logged."""
        self.counters.errors += 1
        with self._lock:
            self._down_until = time.monotonic() + self.retry_after_s
            first, self._failing = not self._failing, True
        if first:
            log.warning("kv tier %s: %s (%s); lookups miss and write-backs are dropped, retried every %g s",
                        self.name, type(e).__name__, str(e)[:200], self.retry_after_s)

    def get(self, key: bytes, max_bytes: Optional[int] = None) -> Optional[bytes]:
        """The value under `key`, None when missing (or the store is down). With `max_bytes`, no more than one byte
        past it is read (GETRANGE), as from disk: a value too large to be an entry is refused by its checks without
        being read whole (a 400 MB value under a tier key took 800 MB of the server's memory per lookup)."""
        if max_bytes is None:
            return self._call(self._client.get, KEY_PREFIX + key)
        return self._call(self._get_range, KEY_PREFIX + key, max_bytes)

    def _get_range(self, name: bytes, max_bytes: int) -> Optional[bytes]:
        """EXISTS and GETRANGE in one transaction: GETRANGE answers an empty value for a missing key too, and apart
        a write-back between them made a fresh entry look empty (removed as bad)."""
        exists, data = self._client.pipeline(transaction=True).exists(name).getrange(name, 0, max_bytes).execute(
            raise_on_error=False)
        if not exists:
            return None
        return b"" if isinstance(data, Exception) else data  # WRONGTYPE: something else under our key, a bad entry

    def discard(self, key: bytes) -> None:
        self._call(self._client.delete, KEY_PREFIX + key)

    def contains(self, key: bytes) -> bool:
        return bool(self._call(self._client.exists, KEY_PREFIX + key))

    def touch(self, key: bytes) -> bool:
        return bool(self._call(self._client.touch, KEY_PREFIX + key))  # TOUCH: how many keys exist, their LRU clock set

    def put(self, key: bytes, entry: bytes) -> None:
        done = self._call(self._client.set, KEY_PREFIX + key, entry, self.ttl_s)
        if done:
            self.counters.puts += 1
            self.counters.bytes_written += len(entry)
            if self._said_full:  # the next refusal is a new episode, logged again
                self._said_full = False
                log.warning("kv tier %s: the Redis server accepts writes again", self.name)
        else:
            self.counters.dropped += 1

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
