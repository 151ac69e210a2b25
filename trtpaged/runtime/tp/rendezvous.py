"""Where the tensor-parallel ranks meet and the process groups they talk over.

The ranks meet at rank 0's TCPStore (`torchrun`'s variables: MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK). Each rank other than 0 loads its
shard first and then sets `ready/<rank>` in the store, so rank 0 can tell a rank
that died while loading (its process exited) or never came (the timeout) from
one that is slow, and says which. The groups are made directly on the store
(no torch.distributed default group), so one process can hold several engines
in turn:

- control: gloo over CPU tensors (step batches, block moves);
- compute: the activations' all-reduce: the same gloo group on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch

from trtpaged.errors import FatalEngineError

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
DEFAULT_TIMEOUT_S = 300.0  # rendezvous, and any one collective (a hung rank ends with an error, not a hang)
TIMEOUT_ENV = "TRTPAGED_TP_TIMEOUT_S"  # overrides DEFAULT_TIMEOUT_S


def default_timeout_s() -> float:
    """TRTPAGED_TP_TIMEOUT_S when set, else DEFAULT_TIMEOUT_S; raises ValueError naming the variable."""
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        timeout = float(value)
    except ValueError:
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"{TIMEOUT_ENV}: got {value!r}; expected a positive number of seconds")
    return timeout
_READY = "trtpaged/ready/"


class TensorParallelError(FatalEngineError):
    """A rank died, hung past the timeout, or never joined: the engine cannot go on."""


@dataclass(frozen=True)
class Rendezvous:
    """How one rank reaches the others (torchrun's variables)."""

    master_addr: str
    master_port: int  # 0 on rank 0: any free port (local launch)
    world_size: int
    rank: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    loopback: bool = False  # gloo over 127.0.0.1 only (local launch)

    @classmethod
    def from_env(cls, timeout_s: Optional[float] = None) -> Optional["Rendezvous"]:
        """The rendezvous that MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK describe, or None when WORLD_SIZE
        is unset; raises ValueError naming a missing or bad variable."""
        if "WORLD_SIZE" not in os.environ:
            return None
        missing = [v for v in ENV_VARS if v not in os.environ]
        if missing:
            raise ValueError(f"{', '.join(missing)}: not set; a multi-machine tensor-parallel run needs all of "
                             f"{', '.join(ENV_VARS)} (as torchrun sets them)")
        try:
            rz = cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                     int(os.environ["RANK"]), timeout_s or default_timeout_s())
        except ValueError:
            raise ValueError("MASTER_PORT, WORLD_SIZE, RANK: must be integers, got "
                             f"{os.environ['MASTER_PORT']!r}, {os.environ['WORLD_SIZE']!r}, "
                             f"{os.environ['RANK']!r}") from None
        if not 0 <= rz.rank < rz.world_size:
            raise ValueError(f"RANK: got {rz.rank}; must be in [0, WORLD_SIZE {rz.world_size})")
        return rz


class Collectives:
    """One rank's process groups: `broadcast` on control (CPU tensors), `all_reduce` on compute.

    `seconds` and `calls` add up the wall time and number of each (the step-time cost of tensor parallelism,
    waiting for the slowest rank included)."""

    def __init__(self, rank: int, world_size: int, control, compute) -> None:
        self.rank, self.world_size = rank, world_size
        self.control, self.compute = control, compute
        self.seconds = {"all_reduce": 0.0, "broadcast": 0.0}
        self.calls = {"all_reduce": 0, "broadcast": 0}

    def broadcast(self, x: torch.Tensor, src: int = 0, timeout: Optional[timedelta] = None) -> torch.Tensor:
        """x from rank src, in place; `timeout` replaces the group's for this call."""
        import torch.distributed as dist

        start = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if timeout is not None:
            opts.timeout = timeout
        self.control.broadcast([x], opts).wait()
        self._count("broadcast", start)
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place."""
        start = time.perf_counter()
        self.compute.allreduce([x]).wait()
        self._count("all_reduce", start)
        return x

    def _count(self, what: str, start: float) -> None:
        self.seconds[what] += time.perf_counter() - start
        self.calls[what] += 1


def open_store(rz: Rendezvous):
    """The TCPStore: hosted by rank 0 (returned at once), reached by the others (waits up to the timeout)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rz.timeout_s)
    if rz.rank == 0:
        if not rz.loopback:  # other machines join: every interface
            return dist.TCPStore(rz.master_addr, rz.master_port, rz.world_size, True, timeout=timeout,
                                 wait_for_workers=False)
        # TCPStore's own server listens on every interface whatever host it is given: an unauthenticated store that
        # any host could write to (or join the groups through) while the engine runs
        fd, port = _loopback_listener(rz.master_port)
        try:
            return dist.TCPStore(rz.master_addr, port, rz.world_size, True, timeout=timeout, wait_for_workers=False,
                                 master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
    try:
        return dist.TCPStore(rz.master_addr, rz.master_port, rz.world_size, False, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (torch raises RuntimeError or DistStoreError)
        raise TensorParallelError(f"rank {rz.rank}: no rank 0 at {rz.master_addr}:{rz.master_port} within "
                                  f"{rz.timeout_s:g} s (MASTER_ADDR/MASTER_PORT): {exc}") from None


def _loopback_listener(port: int) -> tuple[int, int]:
    """(fd, port) of a socket listening on 127.0.0.1 only (port 0: any free one), the fd handed over to its owner."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return sock.detach(), port


def mark_ready(store, rank: int) -> None:
    store.set(f"{_READY}{rank}", "1")


def wait_for_ranks(store, rz: Rendezvous, failure: Callable[[], Optional[str]] = lambda: None,
                   poll_s: float = 0.05, local: bool = False) -> None:
    """Rank 0: returns once every rank is ready; raises TensorParallelError when `failure()` says a local rank
    died, or at the timeout naming the ranks that never came (`local`: rank 0 started them itself)."""
    deadline = time.monotonic() + rz.timeout_s
    pending = list(range(1, rz.world_size))
    while pending:
        pending = [r for r in pending if not store.check([f"{_READY}{r}"])]
        if not pending:
            return
        why = failure()
        if why:
            raise TensorParallelError(f"tensor-parallel rendezvous failed: {why}")
        if time.monotonic() > deadline:
            raise TensorParallelError(
                f"tensor-parallel rendezvous timed out after {rz.timeout_s:g} s: rank(s) "
                f"{', '.join(map(str, pending))} of {rz.world_size} did not join "
                f"{rz.master_addr}:{store.port} " + (
                    "(this process started them and they are alive: still loading, or stuck; a slow load needs a "
                    "larger TRTPAGED_TP_TIMEOUT_S)" if local else
                    "(start them with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK set)"))
        time.sleep(poll_s)


def make_groups(store, rz: Rendezvous, device: torch.device) -> Collectives:
    """The control (gloo) and compute (gloo on CPU, NCCL on CUDA) groups of this rank."""
    import torch.distributed as dist

    timeout = timedelta(seconds=rz.timeout_s)
    if rz.loopback:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rz.rank, rz.world_size, opts)
    else:  # the default device: GLOO_SOCKET_IFNAME, else the host name's address
        control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rz.rank, rz.world_size, timeout)
    compute = control
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rz.rank, rz.world_size, opts)
    return Collectives(rz.rank, rz.world_size, control, compute)
