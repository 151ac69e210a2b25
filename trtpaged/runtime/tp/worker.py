"""Ranks 1..N-1: load the shard, join rank 0, then apply every command it broadcasts until STOP.

    python -m trtpaged.runtime.tp.worker ENGINE_DIR            # torchrun's variables from the environment
    python -m trtpaged.runtime.tp.worker ENGINE_DIR --rank 1 --world-size 2 --master-addr 127.0.0.1 --master-port P

A worker exits when rank 0 sends STOP (code 0), when a collective fails or
times out because rank 0 or another rank is gone (code 1, one line on stderr
saying why), and when its parent process (the local launcher) disappears.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn, Optional

from trtpaged.runtime.tp.rendezvous import Rendezvous, default_timeout_s


def run_worker(engine_dir: Path, rz: Rendezvous, device: str = "cpu") -> NoReturn:
    """The whole life of one non-zero rank: ends the process at STOP (code 0); raises on any failure."""
    import torch

    from trtpaged.engine_files import verify_engine_dir
    from trtpaged.manifest import read_manifest
    from trtpaged.models import load_step_model
    from trtpaged.models.all_reduce import RankReduce
    from trtpaged.runtime.runners import TorchRunner
    from trtpaged.runtime.runners.base import pool_block_bytes
    from trtpaged.runtime.tp import messages
    from trtpaged.runtime.tp.messages import Op
    from trtpaged.runtime.tp.rendezvous import make_groups, mark_ready, open_store

    manifest = read_manifest(engine_dir)
    # this rank's own copy of the dir (another machine's, or changed since rank 0 checked it): the INIT fingerprint
    # below compares manifests only, so a shard that no longer matches its hash would run unnoticed
    verify_engine_dir(engine_dir, manifest)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # NCCL's communicator and the kernels' current device
    reduce = RankReduce(rz.rank, rz.world_size)
    model, _ = load_step_model(engine_dir, device, reduce)
    store = open_store(rz)
    mark_ready(store, rz.rank)
    coll = make_groups(store, rz, torch.device(device))
    reduce.group = coll
    op, fields, _ = messages.receive(coll)
    if op != Op.INIT:
        raise RuntimeError(f"rank {rz.rank}: expected INIT from rank 0, got {op.name}")
    num_kv_blocks, num_host_blocks, engine_print = fields[:3]
    if engine_print != messages.fingerprint(manifest.to_json()):
        raise RuntimeError(f"rank {rz.rank}: {engine_dir} is not the engine rank 0 loaded (manifest differs)")
    kv_cache_dtype = manifest.kv_cache_dtype
    pool = model.new_kv_cache(num_kv_blocks, manifest.limits.block_size, kv_cache_dtype, device=device)
    runner = TorchRunner(model, pool, num_host_blocks)
    while True:
        op, fields, payload = messages.receive(coll)
        if op == Op.STOP:
            exit_process(0)  # with the groups and the store still held: no destructor runs
        if op == Op.STEP:
            runner.step(messages.step_batch(fields, payload))
        elif op == Op.COPY:
            runner.copy_blocks(messages.pairs_of(payload))
        elif op == Op.SWAP_OUT:
            runner.swap_out(messages.pairs_of(payload))
        elif op == Op.SWAP_IN:
            runner.swap_in(messages.pairs_of(payload))
        elif op == Op.READ_BLOCKS:
            ids = payload.tolist()
            messages.shard_bytes(coll, ids, runner.read_blocks(ids), pool_block_bytes(runner.kv_cache))
        elif op == Op.WRITE_BLOCKS:
            ids, size = payload.tolist(), pool_block_bytes(runner.kv_cache)
            data = coll.broadcast(torch.empty(len(ids) * rz.world_size * size, dtype=torch.uint8))
            runner.write_blocks(messages.own_shards(data, ids, rz.rank, rz.world_size, size))
        else:
            raise RuntimeError(f"rank {rz.rank}: unexpected command {op.name}")


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """Ends this process when the launcher that started it is gone (no orphans)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="trtpaged-tp-parent-watch", daemon=True).start()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trtpaged.runtime.tp.worker", description=__doc__.splitlines()[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--device", default=None, help="cpu, or cuda:N (default: cuda:LOCAL_RANK when CUDA is present)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: $TRTPAGED_TP_TIMEOUT_S or 300)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (local launch)")
    parser.add_argument("--error-fd", type=int, default=None,
                        help="write why this rank failed to this inherited descriptor too (one line; local launch)")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    try:
        if args.rank is not None:
            rz = Rendezvous(args.master_addr, args.master_port, args.world_size, args.rank,
                            args.timeout or default_timeout_s(), loopback=args.master_addr == "127.0.0.1")
        else:
            rz = Rendezvous.from_env(args.timeout)
            if rz is None:
                raise ValueError("WORLD_SIZE: not set; give --rank/--world-size/--master-addr/--master-port or the "
                                 "torchrun variables")
        device = args.device or _default_device()
        run_worker(args.engine, rz, device)  # exits at STOP
    except KeyboardInterrupt:
        return 1
    except Exception as exc:  # noqa: BLE001  (one line for the launcher's log; rank 0 reports the exit)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"trtpaged tp worker (rank {args.rank if args.rank is not None else os.environ.get('RANK')}): {why}",
              file=sys.stderr, flush=True)
        if args.error_fd is not None:
            try:
                os.write(args.error_fd, (why + "\n").encode("utf-8"))
            except OSError:
                pass  # stderr has it
        return 1


def exit_process(code: int) -> NoReturn:
    """Ends a worker process without the interpreter's teardown.

    After STOP (or a failure already reported on stderr) nothing is left to write. Destroying gloo's
    groups and the TCPStore client races rank 0 closing its side: a worker that had received STOP once
    aborted there (SIGABRT, "terminate called without an active exception").
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _default_device() -> str:
    import torch

    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    exit_process(main())
