"""The tensor-parallel all-reduce ONNX node: names, schema, the exporter's translation and a joint reference.

Each rank's graph has one node after every row-parallel layer (o_proj, down_proj),
domain `trtpaged`, op_type `TrtpagedAllReduce` (no TensorRT built-in has that
name; the parser finds the plugin by op_type, plugin_version and
plugin_namespace). The TensorRT plugin sums the input over the ranks with NCCL.

Input:  x [T, hidden]  (the rank's partial sum)
Output: y [T, hidden]  (the sum over all ranks, identical on every rank)
Attributes: rank, world_size (int), plugin_version, plugin_namespace (string)

`AllReduceExchange` lets onnx.reference run the rank graphs of one engine
jointly, one thread per rank: each rank's node hands its input to the exchange
and gets the rank-ordered sum back, so verification runs exactly what the
ranks compute together.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import numpy as np
from onnx.defs import OpSchema
from onnx.reference.op_run import OpRun

from trtpaged.builder.onnx_node import (DOMAIN, DOMAIN_VERSION, PLUGIN_ATTRIBUTES, PLUGIN_NAMESPACE, PLUGIN_VERSION,
                                        register_custom_schema)

OP_TYPE = "TrtpagedAllReduce"
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


@functools.lru_cache(maxsize=1)
def register_schema() -> OpSchema:
    """Registers (once) the node's schema with onnx (onnxscript emits it; onnx.checker checks it)."""
    return register_custom_schema(
        OP_TYPE, __doc__ or "", [("x", "T")], [("y", "T")], [("T", _FLOATS, "activations")],
        [("rank", OpSchema.AttrType.INT), ("world_size", OpSchema.AttrType.INT), *PLUGIN_ATTRIBUTES],
    )


def translation() -> dict:
    """The exporter's translation of trtpaged::all_reduce into one TrtpagedAllReduce node."""
    import onnxscript
    import torch

    from trtpaged.models import all_reduce  # noqa: F401  (registers the torch op)

    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def all_reduce_node(x, rank, world_size):
        return getattr(opset, OP_TYPE)(x, rank=rank, world_size=world_size, plugin_version=PLUGIN_VERSION,
                                       plugin_namespace=PLUGIN_NAMESPACE)

    return {torch.ops.trtpaged.all_reduce.default: all_reduce_node}


class AllReduceExchange:
    """A rendezvous of `world_size` threads: each puts its array, all get the sum in rank order."""

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self._slots: list[Optional[np.ndarray]] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def reduce(self, rank: int, x: np.ndarray) -> np.ndarray:
        self._slots[rank] = x
        self._barrier.wait()
        total = self._slots[0].astype(np.float32)
        for part in self._slots[1:]:
            total = total + part.astype(np.float32)
        self._barrier.wait()  # nobody overwrites a slot before every rank has summed
        return total.astype(x.dtype)

    def abort(self) -> None:
        """Wakes every waiting rank with BrokenBarrierError (a rank failed)."""
        self._barrier.abort()


def reference_op(exchange: AllReduceExchange) -> type:
    """An onnx.reference op class named TrtpagedAllReduce that reduces through `exchange`."""

    def _run(self, x, rank=None, world_size=None, plugin_version=None, plugin_namespace=None):
        if int(world_size) != exchange.world_size:
            raise ValueError(f"world_size: node says {world_size}, the exchange has {exchange.world_size} ranks")
        return (exchange.reduce(int(rank), x),)

    return type(OP_TYPE, (OpRun,), {"op_domain": DOMAIN, "_run": _run})
