"""Quantized weights in the ONNX graph: `trtpaged::dequantize_weight` -> standard `DequantizeLinear`.

The exporter first writes each de-quantization as a node of our own domain
(`trtpaged.DequantizeWeight`): the exporter's optimizer cannot constant-fold an
op it does not know, so the integer weights stay integers. After export,
`lower_dequantize_nodes` rewrites every such node into opset-21
`DequantizeLinear(codes, scales, axis=1, block_size=G)` and retypes int4 codes
(stored packed as uint8 [N, K/2], the same bytes ONNX uses for UINT4 [N, K]).
The result is the weight-only pattern `DequantizeLinear -> MatMul` that TensorRT
turns into weight-only GEMMs, and what onnx.reference runs at verification.
"""

from __future__ import annotations

import functools

from onnx.defs import OpSchema

from trtpaged.builder.onnx_node import DOMAIN, DOMAIN_VERSION, register_custom_schema

OP_TYPE = "DequantizeWeight"
OPSET = 21  # block-wise DequantizeLinear and 4-bit types


@functools.lru_cache(maxsize=1)
def register_schema() -> OpSchema:
    """Registers (once) the intermediate node's schema, which onnxscript needs to emit it."""
    return register_custom_schema(
        OP_TYPE, "codes * scales per group (intermediate; lowered to DequantizeLinear)",
        [("codes", "Q"), ("scales", "S")], [("weight", "S")],
        [("Q", ["tensor(int8)", "tensor(uint8)"], "codes"), ("S", ["tensor(float)"], "scales")],
        [("bits", OpSchema.AttrType.INT), ("group_size", OpSchema.AttrType.INT)],
    )


def translation() -> dict:
    """The exporter's translation of trtpaged::dequantize_weight."""
    import onnxscript
    import torch

    from trtpaged.models import qlinear  # noqa: F401  (registers the torch op)

    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def dequantize_weight(codes, scales, bits, group_size):
        return getattr(opset, OP_TYPE)(codes, scales, bits=bits, group_size=group_size)

    return {torch.ops.trtpaged.dequantize_weight.default: dequantize_weight}


def lower_dequantize_nodes(model) -> int:
    """Rewrites every DequantizeWeight node of an onnx_ir model into DequantizeLinear; returns how many."""
    import onnx_ir as ir

    lowered = 0
    for node in list(model.graph):
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        bits = node.attributes["bits"].as_int()
        group_size = node.attributes["group_size"].as_int()
        codes = node.inputs[0]
        if bits == 4:
            _retype_uint4(codes, ir)
        node.op_type, node.domain = "DequantizeLinear", ""
        node.attributes.clear()
        node.attributes["axis"] = ir.AttrInt64("axis", 1)
        node.attributes["block_size"] = ir.AttrInt64("block_size", group_size)
        lowered += 1
    if lowered:
        model.opset_imports[""] = max(model.opset_imports.get("", OPSET), OPSET)
    return lowered


def _retype_uint4(codes, ir) -> None:
    """Packed uint8 [N, K/2] codes -> UINT4 [N, K] (same bytes: ONNX packs the even element in the low nibble)."""
    tensor = codes.const_value
    if tensor is None or tensor.dtype != ir.DataType.UINT8:
        raise ValueError(f"{codes.name}: int4 codes must be a uint8 initializer, got {tensor!r}")
    n, half = tensor.shape
    shape = ir.Shape([n, 2 * half])
    if isinstance(tensor, ir.ExternalTensor):
        codes.const_value = ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, ir.DataType.UINT4,
                                              shape=shape, name=codes.name, base_dir=tensor.base_dir)
    else:
        import numpy as np
        import ml_dtypes  # noqa: F401  (numpy int4 types come with onnx_ir)

        packed = tensor.numpy()
        unpacked = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(n, 2 * half)
        codes.const_value = ir.Tensor(unpacked.astype(ml_dtypes.uint4), name=codes.name)
    codes.dtype, codes.shape = ir.DataType.UINT4, shape
