"""The paged-attention ONNX node: names, schema and the exporter's translation.

One node per layer, domain `trtpaged`. The TensorRT ONNX parser ignores the
domain and looks a plugin up by op_type + plugin_version + plugin_namespace, so
the op_type is one no TensorRT built-in uses.

Inputs:  q [T, H, D], k [T, KVH, D], v [T, KVH, D], kv_cache (pool), positions [T],
         query_start [S+1], context_lens [S], block_tables [S, MB]
Outputs: out [T, H, D], kv_cache_out (the updated pool; aliased to kv_cache by the plugin)
Attributes: num_heads, num_kv_heads, head_dim, block_size, layer, sliding_window (int), scale,
            logit_softcap (float), kv_cache_dtype, plugin_version, plugin_namespace (string); kv_pool (string) and
            num_layers (int) where the pool is passed by address (builder/onnx_pool.py: kv_cache is then int64 [2]
            and the node has the one output `out`)
sliding_window > 0: each query reads only the sliding_window positions ending at its own (0: all);
logit_softcap > 0: scores become cap * tanh(score / cap) (0: none); trtpaged_attention_options in the C ABI.
kv_cache_dtype: "auto" (the pool holds values of its own float type) or "int8" / "fp8_e4m3": the pool is
int8 bytes [..., block_size, head_dim + 2], each row head_dim codes and its fp16 scale
(trtpaged/kv_quant.py); the plugin reads it as a field of the same name.
"""

from __future__ import annotations

import functools

import onnx
from onnx.defs import OpSchema

DOMAIN = "trtpaged"
DOMAIN_VERSION = 1
OP_TYPE = "TrtpagedPagedAttention"
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "trtpaged"
INT_ATTRIBUTES = ("num_heads", "num_kv_heads", "head_dim", "block_size", "layer", "sliding_window")
INPUTS = ("q", "k", "v", "kv_cache", "positions", "query_start", "context_lens", "block_tables")
OUTPUTS = ("out", "kv_cache_out")
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
# int8 (or fp16 pairs): the bytes of a quantized pool; int64: the pool's address (builder/onnx_pool.py)
_POOLS = _FLOATS + ["tensor(int8)", "tensor(int64)"]


_INT, _FLOAT, _STRING = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT, OpSchema.AttrType.STRING
# what the TensorRT parser finds a plugin by, on every node of ours that a plugin implements
PLUGIN_ATTRIBUTES = (("plugin_version", _STRING), ("plugin_namespace", _STRING))


def register_custom_schema(op_type: str, doc: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
                           type_constraints: list[tuple[str, list[str], str]],
                           attributes: list[tuple[str, OpSchema.AttrType]]) -> OpSchema:  # fmt: skip
    """Registers a node of the `trtpaged` domain with onnx, once (onnxscript needs the schema to emit
    the node, onnx.checker to check it); inputs/outputs are (name, type variable) pairs, an output name
    (and an attribute name) ending in "?" optional."""
    if onnx.defs.has(op_type, DOMAIN):
        return onnx.defs.get_schema(op_type, DOMAIN_VERSION, DOMAIN)

    def param(name: str, t: str) -> OpSchema.FormalParameter:
        optional = OpSchema.FormalParameterOption.Optional if name.endswith("?") else \
            OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(name.rstrip("?"), t, param_option=optional)

    schema = OpSchema(
        op_type, DOMAIN, DOMAIN_VERSION, doc=doc,
        inputs=[param(name, t) for name, t in inputs], outputs=[param(name, t) for name, t in outputs],
        type_constraints=type_constraints,
        attributes=[OpSchema.Attribute(name.rstrip("?"), kind, "", required=not name.endswith("?"))
                    for name, kind in attributes],
    )  # fmt: skip
    onnx.defs.register_schema(schema)
    return schema


@functools.lru_cache(maxsize=1)
def register_schema() -> OpSchema:
    """Registers (once) the node's schema with onnx, which onnxscript needs to emit the node."""
    types = {"q": "T", "k": "T", "v": "T", "kv_cache": "C", "out": "T", "kv_cache_out": "C"}
    return register_custom_schema(
        OP_TYPE, __doc__ or "", [(name, types.get(name, "I")) for name in INPUTS],
        [("out", "T"), ("kv_cache_out?", "C")],  # no kv_cache_out where the pool is passed by address
        [("T", _FLOATS, "activations"), ("C", _POOLS, "KV pool"), ("I", ["tensor(int32)"], "indices")],
        [(a, _INT) for a in INT_ATTRIBUTES] + [("scale", _FLOAT), ("logit_softcap", _FLOAT),
                                               ("kv_cache_dtype", _STRING), *PLUGIN_ATTRIBUTES, ("kv_pool?", _STRING),
                                               ("num_layers?", _INT)],
    )  # fmt: skip


def translation_table() -> dict:
    """The exporter's custom_translation_table: trtpaged::paged_attention -> one TrtpagedPagedAttention node."""
    import onnxscript
    import torch

    from trtpaged.models import attention_op  # noqa: F401  (registers the torch op)

    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def paged_attention(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                        num_heads, num_kv_heads, head_dim, block_size, layer, scale, kv_cache_dtype="auto",
                        sliding_window=0, logit_softcap=0.0):
        return getattr(opset, OP_TYPE)(
            q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
            layer=layer, sliding_window=int(sliding_window), scale=float(scale),
            logit_softcap=float(logit_softcap), kv_cache_dtype=kv_cache_dtype, plugin_version=PLUGIN_VERSION,
            plugin_namespace=PLUGIN_NAMESPACE,
        )

    return {torch.ops.trtpaged.paged_attention.default: paged_attention}
