"""hangup.py's reading of /proc against the socket API, and its hang-up against what the other end receives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from trtpaged.runtime.tp import hangup

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads Linux's /proc")

# a child that connects to the port given and holds the connection until its stdin closes
HOLDER = ("import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
          "print(s.getsockname()[1], flush=True); sys.stdin.read()")


def _inode(sock: socket.socket) -> int:
    return hangup.socket_inodes()[sock.fileno()]


def _pair(family: int, host: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname()[:2])
    accepted, _ = listener.accept()
    return listener, client, accepted


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_endpoints_are_what_the_sockets_say(family, host):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        socks = _pair(family, host)
    except OSError as exc:
        pytest.skip(f"cannot listen on {host}: {exc}")
    try:
        table = hangup.tcp_endpoints()
        for sock in socks[1:]:
            local, remote = table[_inode(sock)]
            assert (str(local[0]), local[1]) == sock.getsockname()[:2]
            assert (str(remote[0]), remote[1]) == sock.getpeername()[:2]
        local, _ = table[_inode(socks[0])]
        assert (str(local[0]), local[1]) == socks[0].getsockname()[:2]
    finally:
        for sock in socks:
            sock.close()


def test_an_ipv4_mapped_address_is_read_as_ipv4():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        client.connect(("::ffff:127.0.0.1", listener.getsockname()[1]))
    except OSError as exc:
        pytest.skip(f"no dual-stack socket here: {exc}")
    try:
        local, remote = hangup.tcp_endpoints()[_inode(client)]
        assert str(remote[0]) == "127.0.0.1" and remote[1] == listener.getsockname()[1]
        assert str(local[0]) == "127.0.0.1" and local[1] == client.getsockname()[1]
    finally:
        client.close()
        listener.close()


def test_connections_to_finds_the_ones_whose_other_end_a_process_holds():
    """Of this process's sockets: the connection accepted from the child, not the listener, not a connection
    between two of its own sockets, and not one accepted on the port left out."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    store = socket.socket()
    store.bind(("127.0.0.1", 0))
    store.listen(4)
    _, own_client, own_accepted = _pair(socket.AF_INET, "127.0.0.1")
    children = [subprocess.Popen([sys.executable, "-c", HOLDER, str(s.getsockname()[1])], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for s in (listener, store)]
    try:
        ports = [int(c.stdout.readline()) for c in children]
        accepted, peer = listener.accept()
        from_store, store_peer = store.accept()
        assert (peer[1], store_peer[1]) == tuple(ports)
        pids = [c.pid for c in children]
        assert hangup.connections_to(pids, except_port=store.getsockname()[1]) == [(accepted.fileno(),
                                                                                    _inode(accepted))]
        assert sorted(hangup.connections_to(pids)) == sorted([(accepted.fileno(), _inode(accepted)),
                                                              (from_store.fileno(), _inode(from_store))])
        assert hangup.connections_to([]) == []
        accepted.close()
        from_store.close()
    finally:
        for child in children:
            child.stdin.close()
            child.wait()
            child.stdout.close()
        for sock in (listener, store, own_client, own_accepted):
            sock.close()


def test_hang_up_ends_a_wait_on_a_connection_another_process_keeps_open():
    """A thread blocked reading from a peer whose socket outlives it (the child holds it) wakes when this end is
    hung up, and this process's descriptor stays its own."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(listener.getsockname()[1])], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        conn, _ = listener.accept()
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(conn.recv(1)))
        reader.start()
        time.sleep(0.2)
        assert reader.is_alive()
        connections = hangup.connections_to([child.pid])
        assert hangup.hang_up(connections) == 1
        reader.join(timeout=5)
        assert not reader.is_alive() and got == [b""]
        assert conn.fileno() >= 0 and hangup.socket_inodes()[conn.fileno()] == connections[0][1]
        number = conn.fileno()
        other_listener, other_client, other = _pair(socket.AF_INET, "127.0.0.1")  # numbers other than conn's
        conn.close()
        assert hangup.hang_up(connections) == 0  # the number closed
        os.dup2(other.fileno(), number)  # the number reused by another connection
        try:
            assert hangup.hang_up(connections) == 0
            other_client.sendall(b"x")
            with socket.socket(fileno=os.dup(number)) as check:
                assert check.recv(1) == b"x"  # not shut down
        finally:
            os.close(number)
            for sock in (other_listener, other_client, other):
                sock.close()
    finally:
        child.stdin.close()
        child.wait()
        child.stdout.close()
        listener.close()


def test_exit_watch_reports_once_and_not_after_stop():
    calls: list[str] = []
    answer: list[str] = []
    watch = hangup.ExitWatch(lambda: answer[0] if answer else None, calls.append)
    time.sleep(3 * hangup.POLL_S)
    assert calls == []
    answer.append("rank 1 exited")
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(3 * hangup.POLL_S)
    assert calls == ["rank 1 exited"]
    watch.stop()

    stopped: list[str] = []
    quiet = hangup.ExitWatch(lambda: "gone", stopped.append)
    quiet.stop()
    after = len(stopped)  # 0 unless the first poll came before stop(): nothing after it returns
    time.sleep(2 * hangup.POLL_S)
    assert len(stopped) == after
