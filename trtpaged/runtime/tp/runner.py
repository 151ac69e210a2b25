"""Rank 0's `ModelRunner` for a tensor-parallel engine: broadcast the command, run the own shard, return logits.

The scheduler and block pool stay in rank 0's `LLMEngine`, which does not know
the model is split: every block copy, swap and step it asks for is broadcast
first (messages.py), then applied to rank 0's own shard. Any failure of a
collective (a rank died: gloo reports the closed connection at once; a rank
hung: the timeout) raises `TensorParallelError` naming what happened, and the
remaining workers are stopped. A local worker that exits while a collective
waits on it ends that collective within `hangup.POLL_S`, even where its
connection stays open (hangup.py).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from trtpaged.manifest import Manifest
from trtpaged.runtime.runners.base import StepBatch, pool_block_bytes
from trtpaged.runtime.runners.torch_runner import TorchRunner
from trtpaged.runtime.tp import hangup, messages
from trtpaged.runtime.tp.launch import WorkerSet, threads_per_rank
from trtpaged.runtime.tp.messages import Op
from trtpaged.runtime.tp.rendezvous import (Collectives, Rendezvous, TensorParallelError, default_timeout_s,
                                            make_groups, open_store, wait_for_ranks)


STOP_WAIT_S = 5.0  # how long close() waits for a command another thread is running


class TensorParallelRunner:
    """Rank 0 of N: drives the other ranks and runs its own shard (a `TorchRunner`). `close()` stops the ranks."""

    backend = "torch"

    def __init__(self, local: TorchRunner, coll: Collectives, workers: Optional[WorkerSet],
                 worker_connections: Sequence[tuple[int, int]] = ()) -> None:
        """`worker_connections`: rank 0's connections to the local workers (`hangup.connections_to`), shut down
        when one of them exits."""
        self.local, self.coll, self.workers = local, coll, workers
        self.num_kv_blocks = local.num_kv_blocks
        self.world_size = coll.world_size
        self._failure: Optional[str] = None
        self._broken = [False]  # shared with the finalizer: no STOP once a rank failed
        self._busy = threading.Lock()  # held while a command runs (by a server's engine thread)
        self._exits: list[str] = []  # the exits the watch hung up on (shared with it: no reference to the runner)
        watch = None
        if workers is not None:
            watch = hangup.ExitWatch(workers.failure,
                                     functools.partial(_end_collectives, coll, worker_connections, self._exits))
        self._finalizer = weakref.finalize(self, _shutdown, coll, workers, self._broken, self._busy, watch)

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shard of the step model."""
        return self.local.model

    def step(self, batch: StepBatch) -> torch.Tensor:
        with self._guard("step"):
            fields, payload = messages.step_message(batch)
            messages.send(self.coll, Op.STEP, fields, payload)
            return self.local.step(batch)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._moves(Op.COPY, pairs, self.local.copy_blocks)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._moves(Op.SWAP_OUT, pairs, self.local.swap_out)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._moves(Op.SWAP_IN, pairs, self.local.swap_in)

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's shard of the pool."""
        return self.local.kv_cache

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Per block, every rank's shard bytes concatenated in rank order (one KV-tier entry)."""
        if not block_ids:
            return []
        with self._guard("read_blocks"):
            messages.send(self.coll, Op.READ_BLOCKS, [len(block_ids)], messages.ids_payload(block_ids))
            own = self.local.read_blocks(block_ids)
            return messages.shard_bytes(self.coll, block_ids, own, pool_block_bytes(self.local.kv_cache))

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Writes what `read_blocks` returned: each rank takes its own shard."""
        if not blocks:
            return
        size = pool_block_bytes(self.local.kv_cache)
        for block_id, payload in blocks:
            if len(payload) != size * self.world_size:
                raise ValueError(f"write_blocks: block {block_id} payload is {len(payload)} bytes, "
                                 f"{self.world_size} shards of {size} expected")
        ids = [b for b, _ in blocks]
        with self._guard("write_blocks"):
            messages.send(self.coll, Op.WRITE_BLOCKS, [len(ids)], messages.ids_payload(ids))
            data = torch.frombuffer(bytearray(b"".join(p for _, p in blocks)), dtype=torch.uint8)
            self.coll.broadcast(data)
            self.local.write_blocks(messages.own_shards(data, ids, 0, self.world_size, size))

    def _moves(self, op: Op, pairs: Sequence[tuple[int, int]], apply) -> None:
        if not pairs:
            return
        with self._guard(op.name.lower()):
            messages.send(self.coll, op, [len(pairs)], messages.pairs_payload(pairs))
            apply(pairs)

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel engine stopped earlier: {self._failure}")
        # a worker that died since the last call (killed while idle) is found before a collective waits on it: a
        # collective learns of it only from its closed connection, which a process that inherited the worker's
        # sockets keeps open (once in CI: the step then waited out the whole timeout)
        dead = _exited(self.workers, self._exits)
        with _interrupt_deferred(), self._busy:
            try:
                if dead:
                    raise TensorParallelError(dead)
                yield
            except BaseException as exc:  # noqa: BLE001  (gloo and NCCL raise RuntimeError or DistBackendError)
                self._broken[0] = True
                if isinstance(exc, Exception):
                    why = dead or _dead_workers(self.workers, self._exits) or _unanswered(self.workers, exc)
                    self._failure = f"{what} failed on {self.world_size} ranks: {why}"
                else:  # a second Ctrl-C: rank 0 left the command halfway, the other ranks did not
                    self._failure = f"{what} interrupted on {self.world_size} ranks ({type(exc).__name__})"
                if self.workers is not None:
                    self.workers.stop(grace_s=0.0)
                if not isinstance(exc, Exception):
                    raise
                raise TensorParallelError(self._failure) from exc

    def failure(self) -> Optional[str]:
        """Why the ranks can no longer step (a collective failed, or a local worker exited), or None: what a health
        check reports before the next step would find it."""
        if self._failure is not None:
            return self._failure
        dead = _exited(self.workers, self._exits)
        return f"{dead} ({self.world_size} ranks)" if dead else None

    def close(self) -> None:
        """Sends STOP and waits for the local workers; idempotent. Kills them instead when a rank failed, or when a
        command another thread runs has not ended within STOP_WAIT_S (stuck on a hung rank)."""
        self._finalizer()


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[None]:
    """Holds a Ctrl-C (SIGINT) of the main thread until the command is done on every rank, then hands it to the
    handler it was meant for (KeyboardInterrupt): raised halfway, it left the other ranks inside a collective rank 0
    had abandoned, and the next call waited out the whole timeout and failed. A second Ctrl-C interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield  # only the main thread gets signals; SIG_IGN and SIG_DFL have no handler to call later
        return
    pending: list[int] = []

    def hold(signum: int, frame) -> None:
        if pending:
            previous(signum, frame)
        pending.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        previous(pending[0], None)


def _exited(workers: Optional[WorkerSet], exits: Sequence[str]) -> Optional[str]:
    """Which local workers exited: those the exit watch found when it hung up, not the healthy ones that exited since
    because of the hang-up (3 or more ranks), else those exited now."""
    if exits:
        return exits[0]
    return workers.failure() if workers is not None else None


def _dead_workers(workers: Optional[WorkerSet], exits: Sequence[str], wait_s: float = 1.0) -> Optional[str]:
    """Which local workers exited (`_exited`); waits briefly, since the closed connection may be seen before the
    exit."""
    if workers is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        why = _exited(workers, exits)
        if why or time.monotonic() > deadline:
            return why
        time.sleep(0.02)


def _unanswered(workers: Optional[WorkerSet], exc: Exception) -> str:
    """The collective's own first line, and the local ranks still alive, one or more of which did not answer (gloo
    does not say which)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    alive = workers.alive() if workers else ""
    return f"{first}; no rank exited, alive (one or more not answering): {alive}" if alive else first


def _end_collectives(coll: Collectives, connections: Sequence[tuple[int, int]], exits: list[str], why: str) -> None:
    """A local worker exited (`why`, kept in `exits`): any collective under way or to come fails now, not at the
    timeout."""
    exits.append(why)  # before the hang-up, whose failures name it
    hangup.hang_up(connections)
    if coll.compute is not coll.control:
        coll.compute.abort()  # NCCL: ncclCommAbort ends its kernels (not run here: no multi-GPU machine)


def _shutdown(coll: Collectives, workers: Optional[WorkerSet], broken: list[bool], busy: threading.Lock,
              watch: Optional[hangup.ExitWatch] = None) -> None:
    # a command still under way in another thread after STOP_WAIT_S is stuck on a hung rank: STOP would wait behind
    # it in the group's queue for the whole collective timeout (a server's SIGTERM took that long to exit); the local
    # workers are killed instead, which ends the stuck collective, and it is given time to unwind (torn down under
    # it at exit, gloo aborted the process). STOP itself gets STOP_WAIT_S: a rank that hung between two commands
    # never takes it (it waited out the whole timeout when a server's engine thread had stopped between steps)
    idle = busy.acquire(timeout=STOP_WAIT_S)
    try:
        if idle and not broken[0]:
            if watch is not None:
                watch.stop()  # before STOP: the workers' own exits after it are no failure
            try:
                messages.send(coll, Op.STOP, timeout=timedelta(seconds=STOP_WAIT_S))
            except Exception:  # noqa: BLE001  (gloo raises RuntimeError or DistBackendError)
                broken[0] = True
        broken[0] = broken[0] or not idle
        if workers is not None:
            workers.stop(grace_s=0.0 if broken[0] else 10.0)
        if not idle:  # the watch, still running, hangs up on the kills: the stuck command ends even where the
            idle = busy.acquire(timeout=STOP_WAIT_S)  # killed rank's sockets outlive it
    finally:
        if watch is not None:
            watch.stop()
        if idle:
            busy.release()


def rank_devices(device: str, world_size: int) -> dict[int, str]:
    """Each local rank's device: cpu for all, or one GPU per rank (cuda:r)."""
    if torch.device(device).type == "cpu":
        return {r: "cpu" for r in range(world_size)}
    count = torch.cuda.device_count()
    if count < world_size:
        raise ValueError(f"tensor_parallel: {world_size} ranks need {world_size} GPUs on this machine, found {count}")
    return {r: f"cuda:{r}" for r in range(world_size)}


def start_tensor_parallel(
    engine_dir: Path, manifest: Manifest, num_kv_blocks: int, device: str = "cpu", num_host_blocks: int = 0,
    rendezvous: Optional[Rendezvous] = None, timeout_s: Optional[float] = None,
) -> TensorParallelRunner:
    """Rank 0 of a tensor-parallel engine: its shard loaded, the other ranks joined and their pools allocated.

    Without `rendezvous` the other ranks are started here as local processes (loopback only); with one
    (`Rendezvous.from_env()`: torchrun's variables) they are started elsewhere and join at its address.
    """
    from trtpaged.models import load_step_model
    from trtpaged.models.all_reduce import RankReduce

    n = manifest.tensor_parallel
    rz = rendezvous or Rendezvous("127.0.0.1", 0, n, 0, timeout_s or default_timeout_s(), loopback=True)
    if rz.world_size != n:
        raise ValueError(f"WORLD_SIZE: got {rz.world_size}; {engine_dir} is split over tensor_parallel {n} ranks")
    if rz.rank != 0:
        raise ValueError(f"RANK: got {rz.rank}; the scheduler runs on rank 0 only, the other ranks run "
                         "`python -m trtpaged.runtime.tp.worker ENGINE` (or `trtpaged serve` with RANK set)")
    devices = rank_devices(device, n) if rendezvous is None else {0: device}
    if devices[0] == "cpu" and rendezvous is None:
        torch.set_num_threads(threads_per_rank(n))  # the ranks share this machine's cores
    reduce = RankReduce(0, n)
    model, _ = load_step_model(engine_dir, devices[0], reduce)
    store = open_store(rz)
    workers = WorkerSet.start(Path(engine_dir), rz, store.port, devices) if rendezvous is None else None
    try:
        wait_for_ranks(store, rz, workers.failure if workers is not None else lambda: None, local=workers is not None)
        coll = make_groups(store, rz, torch.device(devices[0]))
        reduce.group = coll
        messages.send(coll, Op.INIT, [num_kv_blocks, num_host_blocks, messages.fingerprint(manifest.to_json())])
        connections = hangup.connections_to(workers.pids, except_port=store.port) if workers is not None else []
        # until the runner (whose close stops them) exists: a failure or Ctrl-C here left the workers waiting for
        # commands for as long as the exception's traceback held the groups
        pool = model.new_kv_cache(num_kv_blocks, manifest.limits.block_size, manifest.kv_cache_dtype,
                                  device=devices[0])
        return TensorParallelRunner(TorchRunner(model, pool, num_host_blocks), coll, workers, connections)
    except BaseException:
        if workers is not None:
            workers.stop(grace_s=0.0)
        raise
