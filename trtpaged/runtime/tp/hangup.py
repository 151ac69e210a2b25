"""Ends a collective that waits on a local worker which has exited: rank 0 shuts down its own connections to the
workers.

A collective learns of a dead rank only from its closed connection. Where another process still holds the dead
worker's sockets (one it forked, or one that took a copy), nothing closes, and rank 0 waited out the whole
`TRTPAGED_TP_TIMEOUT_S` (300 s) before failing. Neither gloo's `abort()` nor its `shutdown()` ends a wait under way
(torch 2.13: the step still took the whole timeout); a `shutdown(2)` of rank 0's own end of the connection does, as
if the peer had closed it.

`ExitWatch` polls the local workers while the runner is open and, when one has exited, shuts down rank 0's TCP
connections to the workers (found once, at start, as those whose other end is a socket a worker holds: never a
client's HTTP connection or the store's) and aborts an NCCL compute group. Once a worker has died the engine cannot
step again, so ending every connection is right whether or not a command is under way. Linux only (`/proc`):
elsewhere nothing is found and a death mid-collective is still found at the timeout.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import Callable, Optional, Sequence

POLL_S = 0.2  # how often the workers are polled; a death mid-collective ends it within about this

Address = tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]


def socket_inodes(pid: int | str = "self") -> dict[int, int]:
    """fd -> socket inode of every socket process `pid` holds ({} when its /proc entry cannot be read)."""
    inodes = {}
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes[int(name)] = int(target[len("socket:["):-1])
    return inodes


def tcp_endpoints() -> dict[int, tuple[Address, Address]]:
    """inode -> (local, remote) of every TCP socket in this network namespace (/proc/net/tcp and tcp6); an
    IPv4-mapped IPv6 address is given as its IPv4 address."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                table[int(fields[9])] = (_address(fields[1]), _address(fields[2]))
    return table


def _address(hex_address: str) -> Address:
    """'0100007F:1F90' (the kernel's byte order: each 32-bit word native-endian) -> (127.0.0.1, 8080)."""
    host, port = hex_address.split(":")
    raw = b"".join(int(host[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(host), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port, 16)


def connections_to(pids: Sequence[int], except_port: Optional[int] = None) -> list[tuple[int, int]]:
    """(fd, inode) of this process's TCP connections whose other end is a socket one of `pids` holds, leaving out
    those this process accepted on `except_port` (its TCPStore's: the store outlives a worker's death)."""
    table = tcp_endpoints()
    theirs = {table[inode][0] for pid in pids for inode in socket_inodes(pid).values() if inode in table}
    return [(fd, inode) for fd, inode in socket_inodes().items()
            if inode in table and table[inode][1] in theirs and table[inode][0][1] != except_port]


def hang_up(connections: Sequence[tuple[int, int]]) -> int:
    """Shuts down (both ways) each of `connections` still open as the same socket; returns how many."""
    done = 0
    for fd, inode in connections:
        try:
            copy = os.dup(fd)
        except OSError:
            continue  # closed
        # checked on the copy, which cannot change under us: the owner may close the number (gloo closes a pair
        # whose peer is gone) and another thread reuse it for, say, a client's connection
        try:
            sock = socket.socket(fileno=copy) if os.fstat(copy).st_ino == inode else None
        except OSError:
            sock = None
        if sock is None:
            os.close(copy)
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # already disconnected
        finally:
            sock.close()  # the copy only: the owner's descriptor stays
    return done


class ExitWatch:
    """A daemon thread that calls `on_exit(why)` once, when `failure()` first reports an exited worker."""

    def __init__(self, failure: Callable[[], Optional[str]], on_exit: Callable[[str], None]) -> None:
        self._failure, self._on_exit = failure, on_exit
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtpaged-tp-exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(POLL_S):
            why = self._failure()
            if why:
                self._on_exit(why)
                return

    def stop(self) -> None:
        """No call after this returns (a STOP's own exits are not a failure)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
