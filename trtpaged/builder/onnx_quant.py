"""Quantized weights in the ONNX graph: `trtpaged::dequantize_linear` -> standard `DequantizeLinear`.

The TensorRT graph's linears (builder/tensorrt_graph.py, `TensorRTLinear`) de-quantize
through `trtpaged::dequantize_linear`, which the exporter first writes as a node of our
own domain (`trtpaged.DequantizeWeight`): its optimizer cannot constant-fold an op it does
not know, so the integer weights stay integers. After export, `lower_dequantize_nodes`
rewrites every such node into opset-21 `DequantizeLinear` and retypes int4 codes (stored
packed as uint8 [K, N/2], the bytes ONNX uses for INT4 [K, N]):

- int4: `DequantizeLinear(codes INT4 [K, N], scales [K/B, N], axis=0, block_size=B)`;
- int8: `DequantizeLinear(codes INT8 [K, N], scales [N], axis=1)` (per channel);

scales in the compute dtype, output straight into the MatMul (rules: builder/tensorrt_rules.py),
and what onnx.reference runs at verification. TensorRT documents weight-only GEMMs for INT4;
the int8 form parses, but may run as a de-quantization and a float GEMM (docs/quantization.md).
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
        [("Q", ["tensor(int8)", "tensor(uint8)"], "codes"),
         ("S", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "scales")],
        [("bits", OpSchema.AttrType.INT), ("block_size", OpSchema.AttrType.INT)],
    )


def translation() -> dict:
    """The exporter's translation of trtpaged::dequantize_linear."""
    import onnxscript
    import torch

    from trtpaged.builder import tensorrt_graph  # noqa: F401  (registers the torch op)

    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def dequantize_linear(codes, scales, bits, block_size):
        return getattr(opset, OP_TYPE)(codes, scales, bits=bits, block_size=block_size)

    return {torch.ops.trtpaged.dequantize_linear.default: dequantize_linear}


def lower_dequantize_nodes(model) -> int:
    """Rewrites every DequantizeWeight node of an onnx_ir model into DequantizeLinear; returns how many."""
    import onnx_ir as ir

    lowered = 0
    for node in list(model.graph):
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        bits = node.attributes["bits"].as_int()
        block_size = node.attributes["block_size"].as_int()
        codes = node.inputs[0]
        if bits == 4:
            _retype_int4(codes, ir)
        node.op_type, node.domain = "DequantizeLinear", ""
        node.attributes.clear()
        node.attributes["axis"] = ir.AttrInt64("axis", 0 if block_size else 1)
        if block_size:
            node.attributes["block_size"] = ir.AttrInt64("block_size", block_size)
        lowered += 1
    if lowered:
        model.opset_imports[""] = max(model.opset_imports.get("", OPSET), OPSET)
    return lowered


def _retype_int4(codes, ir) -> None:
    """Packed uint8 [K, N/2] signed nibbles -> INT4 [K, N] (same bytes: ONNX packs the even element in the low
    nibble)."""
    tensor = codes.const_value
    if tensor is None or tensor.dtype != ir.DataType.UINT8:
        raise ValueError(f"{codes.name}: int4 codes must be a uint8 initializer, got {tensor!r}")
    n, half = tensor.shape
    shape = ir.Shape([n, 2 * half])
    if isinstance(tensor, ir.ExternalTensor):
        codes.const_value = ir.ExternalTensor(tensor.location, tensor.offset, tensor.length, ir.DataType.INT4,
                                              shape=shape, name=codes.name, base_dir=tensor.base_dir)
    else:
        import numpy as np
        import ml_dtypes  # noqa: F401  (numpy int4 types come with onnx_ir)

        packed = tensor.numpy()
        nibbles = np.stack((packed & 0x0F, packed >> 4), axis=-1).reshape(n, 2 * half).astype(np.int16)
        signed = ((nibbles ^ 8) - 8).astype(np.int8)
        codes.const_value = ir.Tensor(signed.astype(ml_dtypes.int4), name=codes.name)
    codes.dtype, codes.shape = ir.DataType.INT4, shape
