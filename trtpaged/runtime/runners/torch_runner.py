"""The torch runner: the eager step model over a KV pool tensor, block moves through the kernel library."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from trtpaged.runtime.cpu_share import shared_budget
from trtpaged.runtime.runners.base import BlockStaging, StepBatch

log = logging.getLogger("trtpaged.runtime")


def _kernels(device: torch.device):
    """The kernel library when it is built for this device, else None (plain tensor indexing)."""
    try:
        from trtpaged import kernels
    except ImportError:
        return None
    if not kernels.available() or (device.type == "cuda" and not kernels.has_cuda()):
        return None
    return kernels


class TorchRunner:
    """Runs any module with the step-model forward signature eagerly.

    `model(input_ids, positions, query_start, context_lens, block_tables,
    logits_index, kv_cache) -> (logits, kv_cache)` must update the pool in
    place. Block copies and swaps use `trtpaged.kernels` when the library is
    built, plain tensor indexing otherwise.
    """

    backend = "torch"

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, num_host_blocks: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.num_kv_blocks = int(kv_cache.shape[0])
        host_shape = (num_host_blocks, *kv_cache.shape[1:])
        pin = self.device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=kv_cache.dtype, pin_memory=pin) if num_host_blocks else None
        self._kernels = _kernels(self.device)
        self._staging = BlockStaging(self._swap)  # the KV tiers' blocks move as swapped blocks do
        self.execution_plan: Optional[str] = None
        # a step model takes the step's `row_invariant` (StepBatch); another module gets the contract's arguments
        self._row_invariant = "row_invariant" in inspect.signature(model.forward).parameters
        set_plan = getattr(model, "set_execution_plan", None)
        if set_plan is not None:  # a step model: how its layers run here is decided once, now
            from trtpaged.models.execution_plan import decide_execution_plan

            plan = decide_execution_plan(model)
            set_plan(plan)
            self.execution_plan = str(plan)
            log.info("execution plan: %s", plan)
        # fewer OpenMP threads while other processes keep this process's cores busy (cpu_share.py), where that
        # changes no result: torch's float GEMM rounds differently on another thread count, so a float model's step
        # gets the count back (a float draft beside a quantized target steps on the thread the target's budget set)
        self._threads = shared_budget() if self.device.type == "cpu" else None
        self._fewer_threads = False
        if self._threads is not None:
            from trtpaged.models.execution_plan import same_bits_on_any_thread_count

            self._fewer_threads = same_bits_on_any_thread_count(model)

    @classmethod
    def from_engine_dir(
        cls, engine_dir: str | Path, num_kv_blocks: int, device: str = "cpu", num_host_blocks: int = 0
    ) -> "TorchRunner":
        """Loads the engine dir's weights into the step model and allocates the pool."""
        from trtpaged.models import load_step_model
        from trtpaged.kv_formats import KV_CACHE_DTYPES
        from trtpaged.manifest import read_manifest

        kv_cache_dtype = read_manifest(engine_dir).kv_cache_dtype
        model, manifest = load_step_model(engine_dir, device=device)
        bs = manifest.limits.block_size
        pool = model.new_kv_cache(num_kv_blocks, bs, kv_cache_dtype if kv_cache_dtype in KV_CACHE_DTYPES else None,
                                  device=device)
        return cls(model, pool, num_host_blocks)

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> torch.Tensor:
        if self._threads is not None:
            if self._fewer_threads:
                self._threads.apply()
            else:
                self._threads.give_back()
        args = [
            t.to(self.device, non_blocking=True)
            for t in (batch.input_ids, batch.positions, batch.query_start, batch.context_lens, batch.block_tables,
                      batch.logits_index)
        ]
        if batch.row_invariant and self._row_invariant:
            logits, kv_cache = self.model(*args, self.kv_cache, row_invariant=True)
        else:
            logits, kv_cache = self.model(*args, self.kv_cache)
        if kv_cache is not self.kv_cache:  # a functional model: keep the updated pool
            self.kv_cache = kv_cache
        return logits.float()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self._kernels is not None:
            self._kernels.copy_blocks(self.kv_cache, list(pairs))
            return
        for src, dst in pairs:  # in order: a later pair may read a block an earlier one wrote
            self.kv_cache[dst].copy_(self.kv_cache[src])

    def _swap(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        if self._kernels is not None:
            self._kernels.swap_blocks(src_pool, dst_pool, list(pairs))
            return
        for src, dst in pairs:
            dst_pool[dst].copy_(src_pool[src])

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs and self.host_cache is None:
            raise RuntimeError("swap_out: the engine has no host pool (num_host_blocks is 0)")
        if self.host_cache is not None:
            self._swap(self.kv_cache, self.host_cache, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs and self.host_cache is None:
            raise RuntimeError("swap_in: the engine has no host pool (num_host_blocks is 0)")
        if self.host_cache is not None:
            self._swap(self.host_cache, self.kv_cache, pairs)

    def failure(self) -> Optional[str]:
        """Always None: a failure in this process shows as the failing step's error."""
        return None

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return self._staging.read(self.kv_cache, block_ids)

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        self._staging.write(self.kv_cache, blocks)
