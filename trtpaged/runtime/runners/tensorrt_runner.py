"""The TensorRT backend: engine.plan executed through TensorRT's Python API on torch CUDA tensors.

The plan is deserialized with the plugin library registered; each step sets the
input shapes, binds torch tensors by data pointer and enqueues on the current
torch stream. The KV pool is bound both as input `kv_cache` and as output
`kv_cache_out`: the plugin aliases the two and updates the pool in place. An
engine built with `tensorrt.kv_pool: address` (builder/onnx_pool.py) has no pool
tensor: its input `kv_cache_pool` is bound to a pinned host int64 [2] holding the
pool's device address and num_kv_blocks, which the plugin writes through; the pool's
layout then comes from the manifest. A quantized pool's bytes are allocated in the
type the engine declares (int8 or fp16 pairs: `tensorrt.quantized_pool`).
Block copies and swaps go through the kernel library, as in the torch backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from trtpaged.step_io import INPUT_NAMES
from trtpaged.tensorrt_env import dims_tuple
from trtpaged.runtime.runners.base import BlockStaging, StepBatch

POOL_INPUT, POOL_OUTPUT, LOGITS = "kv_cache", "kv_cache_out", "logits"
POOL_ADDRESS_INPUT = "kv_cache_pool"  # builder/onnx_pool.py
_STEP_INPUTS = tuple(name for name in INPUT_NAMES if name != POOL_INPUT)


def _torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    # int8 (or fp16 pairs): the bytes of a quantized KV pool (int8 or fp8_e4m3 codes with per-row scales)
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int32: torch.int32, trt.int8: torch.int8, trt.int64: torch.int64}
    if dtype not in table:
        raise ValueError(f"engine.plan: tensor dtype {dtype} is not one trtpaged binds")
    return table[dtype]


def pool_block_layout(manifest: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """(one block's shape [num_layers, 2, num_kv_heads, block_size, row], dtype) of an engine dir's KV pool:
    row head_dim values, or head_dim + 2 int8 bytes for a quantized cache."""
    from trtpaged.kv_formats import QUANTIZED_KV_CACHE_DTYPES
    from trtpaged.models.loading import TORCH_DTYPES

    d, kv = manifest.dims, manifest.kv_cache_dtype
    quantized = kv in QUANTIZED_KV_CACHE_DTYPES
    shape = (d.num_layers, 2, d.num_kv_heads, manifest.limits.block_size, d.head_dim + 2 if quantized else d.head_dim)
    return shape, torch.int8 if quantized else TORCH_DTYPES[kv]


class TensorRTRunner:
    """Runs a serialized TensorRT plan over a KV pool it allocates on `device`."""

    backend = "tensorrt"
    _pool_address: Optional[torch.Tensor] = None  # kv_pool address: pinned int64 [2] {pool address, num_kv_blocks}

    def __init__(self, plan_path: str | Path, num_kv_blocks: int, device: str = "cuda", num_host_blocks: int = 0,
                 plugin_library: Optional[Path] = None,
                 pool_layout: Optional[tuple[tuple[int, ...], torch.dtype]] = None) -> None:
        """pool_layout: one block's shape and dtype (pool_block_layout), needed by an engine without a pool tensor
        (kv_pool address); an aliased pool's comes from the engine."""
        import tensorrt as trt

        from trtpaged.tensorrt_env import load_plugin_library, tensorrt_version_reason

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: the TensorRT backend runs on CUDA, got {device!r}")
        version = str(trt.__version__)
        too_old = tensorrt_version_reason(version)
        if too_old:
            raise RuntimeError(too_old)
        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        load_plugin_library(self._runtime.get_plugin_registry(), version, plugin_library)  # CompileError: one line
        with torch.cuda.device(self.device):
            engine = self._runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
            if engine is None:
                raise RuntimeError(f"{plan_path}: TensorRT could not deserialize the plan (see its errors above)")
            self._engine = engine
            self._context = engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        by_address = POOL_ADDRESS_INPUT in names
        pool_names = (POOL_ADDRESS_INPUT,) if by_address else (POOL_INPUT, POOL_OUTPUT)
        missing = [n for n in (*_STEP_INPUTS, *pool_names, LOGITS) if n not in names]
        if missing:
            raise ValueError(f"{plan_path}: engine has no tensor(s) {missing}; it does not follow the I/O contract")
        if by_address:
            if pool_layout is None:
                raise ValueError(f"{plan_path}: the engine takes the KV pool by address ({POOL_ADDRESS_INPUT}); "
                                 "its layout must be given (TensorRTRunner.from_engine_dir reads it from the manifest)")
            block_shape, pool_dtype = pool_layout
        else:
            max_pool = dims_tuple(self._engine.get_tensor_profile_shape(POOL_INPUT, 0)[2])
            if num_kv_blocks > max_pool[0]:
                raise ValueError(f"num_kv_blocks: {num_kv_blocks} exceeds the {max_pool[0]} blocks engine.plan was "
                                 "built for; rebuild with a larger kv_cache budget")
            block_shape = tuple(max_pool[1:])
            pool_dtype = _torch_dtype(trt, self._engine.get_tensor_dtype(POOL_INPUT))
        pool_shape = (num_kv_blocks, *block_shape)
        self.kv_cache = torch.zeros(pool_shape, dtype=pool_dtype, device=self.device)
        if by_address:  # read by the plugin on the host at enqueue (pinned: also readable by the device)
            self._pool_address = torch.tensor([self.kv_cache.data_ptr(), num_kv_blocks], dtype=torch.int64,
                                              pin_memory=self.device.type == "cuda")
        self.num_kv_blocks = num_kv_blocks
        self._logits_dtype = _torch_dtype(trt, self._engine.get_tensor_dtype(LOGITS))
        self.vocab_size = dims_tuple(self._engine.get_tensor_shape(LOGITS))[-1]
        self.host_cache = (
            torch.zeros((num_host_blocks, *pool_shape[1:]), dtype=pool_dtype, pin_memory=True)
            if num_host_blocks else None
        )
        from trtpaged import kernels

        if not kernels.available() or not kernels.has_cuda():
            raise RuntimeError("the TensorRT backend needs the kernel library built with CUDA for block copies "
                               "and swaps")
        self._kernels = kernels
        self._staging = BlockStaging(lambda src, dst, pairs: kernels.swap_blocks(src, dst, pairs))

    @classmethod
    def from_engine_dir(cls, engine_dir: str | Path, num_kv_blocks: int, device: str = "cuda",
                        num_host_blocks: int = 0) -> "TensorRTRunner":
        import tensorrt as trt

        from trtpaged.tensorrt_env import check_build_info
        from trtpaged.manifest import read_manifest

        manifest = read_manifest(engine_dir)
        if not manifest.plan_file:
            raise ValueError(f"{engine_dir}: the engine dir has no engine.plan (built without TensorRT)")
        check_build_info(Path(engine_dir), str(trt.__version__))  # CompileError (a RuntimeError): one line
        return cls(Path(engine_dir) / manifest.plan_file, num_kv_blocks, device, num_host_blocks,
                   pool_layout=pool_block_layout(manifest))

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> torch.Tensor:
        """Runs one packed step; returns float32 logits [len(batch.logits_index), vocab]."""
        if batch.num_tokens == 0:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        with torch.cuda.device(self.device):
            tensors = {
                name: getattr(batch, name).to(self.device, dtype=torch.int32, non_blocking=True).contiguous()
                for name in _STEP_INPUTS
            }
            num_outputs = int(tensors["logits_index"].shape[0])
            if num_outputs == 0:
                # No sequence samples this step (a prompt chunk cut by the token budget): the profile's
                # num_outputs starts at 1, so ask for row 0 and return none.
                tensors["logits_index"] = torch.zeros(1, dtype=torch.int32, device=self.device)
            logits = self._run(tensors)
            return logits[:num_outputs].float()

    def _run(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sets shapes, binds every tensor and enqueues on the current stream; the caller entered the device."""
        ctx = self._context
        for name, t in tensors.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"{name}: shape {tuple(t.shape)} is outside what engine.plan was built for "
                                 f"(profile {self._engine.get_tensor_profile_shape(name, 0)})")
        pool = self._pool_address if self._pool_address is not None else self.kv_cache
        pool_name = POOL_ADDRESS_INPUT if self._pool_address is not None else POOL_INPUT
        if not ctx.set_input_shape(pool_name, tuple(pool.shape)):
            raise ValueError(f"{pool_name}: shape {tuple(pool.shape)} is outside engine.plan's profile")
        logits = torch.empty(dims_tuple(ctx.get_tensor_shape(LOGITS)), dtype=self._logits_dtype, device=self.device)
        addresses = {name: t.data_ptr() for name, t in tensors.items()}
        if self._pool_address is not None:  # by address: the plugin writes through kv_cache_pool's pointer
            addresses[POOL_ADDRESS_INPUT] = self._pool_address.data_ptr()
        else:
            addresses[POOL_INPUT] = addresses[POOL_OUTPUT] = self.kv_cache.data_ptr()  # aliased: updated in place
        addresses[LOGITS] = logits.data_ptr()
        for name, address in addresses.items():
            if not ctx.set_tensor_address(name, address):
                raise RuntimeError(f"TensorRT refused the address of {name} (see its errors above)")
        stream = torch.cuda.current_stream(self.device)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT failed to enqueue the step (see its errors above)")
        return logits

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._kernels.copy_blocks(self.kv_cache, list(pairs))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._kernels.swap_blocks(self.kv_cache, self._host_pool("swap_out"), list(pairs))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._kernels.swap_blocks(self._host_pool("swap_in"), self.kv_cache, list(pairs))

    def _host_pool(self, what: str) -> torch.Tensor:
        if self.host_cache is None:
            raise RuntimeError(f"{what}: the engine has no host pool (num_host_blocks is 0)")
        return self.host_cache

    def failure(self) -> Optional[str]:
        """Always None: a failure in this process shows as the failing step's error."""
        return None

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return self._staging.read(self.kv_cache, block_ids)

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        self._staging.write(self.kv_cache, blocks)
