"""The KV pool's form in the TensorRT graph (model.yaml `tensorrt:`), applied to an exported model.onnx.

The export writes the pool as a tensor the plugin updates in place: input `kv_cache`, each layer's
node reads the previous one's `kv_cache_out`, the last is the graph output `kv_cache_out`
(`kv_pool: aliased`, the plugin's getAliasedInput). Two alternatives, selectable at build so that
a GPU run can measure them (TensorRT "may insert copies" of an aliased tensor):

- `kv_pool: address`: no pool tensor in the network. Input `kv_cache_pool` is int64 [2]
  {the pool's device address, num_kv_blocks}, bound to pinned host memory, which every
  paged-attention node reads and writes through (TensorRT-LLM's host KV pool pointers);
  each node has the one output `out`, attributes kv_pool "address", num_layers, and kv_cache_dtype
  naming the pool's type (a float pool's too: no tensor shows it).
- `quantized_pool: float16`: an int8/fp8_e4m3 pool's bytes typed fp16
  (rows of (head_dim + 2) / 2 elements), in case TensorRT refuses INT8 network I/O outside
  quantization; the plugin takes the same bytes whatever the type.

The rewrite is structural (no weights are loaded or written) and runs after verification,
which runs the exported aliased form (onnx.reference cannot follow a device address).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from trtpaged.builder.onnx_node import OP_TYPE

POOL_INPUT, POOL_OUTPUT = "kv_cache", "kv_cache_out"
POOL_ADDRESS_INPUT = "kv_cache_pool"  # int64 [2]: device address, num_kv_blocks
POOL_TYPES = {"int8": TensorProto.INT8, "float16": TensorProto.FLOAT16}
_FLOAT_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def _attention_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    return [n for n in graph.node if n.op_type == OP_TYPE]


def _kv_cache_dtype(node: onnx.NodeProto) -> str:
    attr = next((a for a in node.attribute if a.name == "kv_cache_dtype"), None)
    return attr.s.decode() if attr is not None else "auto"


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


def _pool_values(graph: onnx.GraphProto) -> set[str]:
    """Names of the pool tensor along the chain: the input, every node's kv_cache_out, the graph output."""
    names = {POOL_INPUT, POOL_OUTPUT}
    names.update(n.output[1] for n in _attention_nodes(graph) if len(n.output) > 1)
    return names


def retype_quantized_pool(model: onnx.ModelProto, pool_type: str) -> bool:
    """Types a quantized pool's bytes as `pool_type` (int8 | float16) along its chain; returns whether
    the graph has a quantized pool (a float pool is left as it is)."""
    graph = model.graph
    nodes = _attention_nodes(graph)
    if not nodes or _kv_cache_dtype(nodes[0]) in ("auto", *_FLOAT_NAMES.values()):
        return False
    elem = POOL_TYPES[pool_type]
    names = _pool_values(graph)
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.name in names:
            tensor_type = info.type.tensor_type
            tensor_type.elem_type = elem
            last = tensor_type.shape.dim[-1]
            if elem == TensorProto.FLOAT16 and last.HasField("dim_value"):
                if last.dim_value % 2:
                    raise ValueError(f"{info.name}: rows of {last.dim_value} bytes cannot be fp16 pairs")
                last.dim_value //= 2
    return True


def to_address_pool(model: onnx.ModelProto, num_layers: int) -> None:
    """Rewrites the aliased pool into kv_pool address: input kv_cache_pool int64 [2] read by every node, one
    output per node, no pool tensor left in the graph."""
    graph = model.graph
    nodes = _attention_nodes(graph)
    if not nodes:
        raise ValueError("the graph has no paged-attention node")
    pool_input = next(i for i in graph.input if i.name == POOL_INPUT)
    float_name = _FLOAT_NAMES.get(pool_input.type.tensor_type.elem_type)
    names = _pool_values(graph)
    for node in nodes:
        node.input[3] = POOL_ADDRESS_INPUT
        del node.output[1:]
        _set_attr(node, "kv_pool", "address")
        _set_attr(node, "num_layers", num_layers)
        if _kv_cache_dtype(node) == "auto":
            if float_name is None:
                raise ValueError(f"{node.name}: kv_cache_dtype auto over a pool of ONNX type "
                                 f"{pool_input.type.tensor_type.elem_type}")
            _set_attr(node, "kv_cache_dtype", float_name)
    index = list(graph.input).index(pool_input)
    graph.input.remove(pool_input)
    graph.input.insert(index, helper.make_tensor_value_info(POOL_ADDRESS_INPUT, TensorProto.INT64, [2]))
    for value in [o for o in graph.output if o.name in names]:
        graph.output.remove(value)
    for value in [v for v in graph.value_info if v.name in names]:
        graph.value_info.remove(value)


def apply_pool_form(onnx_path: Path, kv_pool: str, quantized_pool: str, num_layers: int) -> list[str]:
    """Applies the model.yaml's pool form to model.onnx in place (weights stay external); returns what changed,
    one line each, for the build log (none for the defaults)."""
    if kv_pool == "aliased" and quantized_pool == "int8":
        return []
    model = onnx.load(str(onnx_path), load_external_data=False)
    changed = []
    if kv_pool == "aliased" and quantized_pool != "int8" and retype_quantized_pool(model, quantized_pool):
        changed.append(f"quantized pool bytes typed {quantized_pool}")
    if kv_pool == "address":
        to_address_pool(model, num_layers)
        changed.append(f"pool by address ({POOL_ADDRESS_INPUT} int64 [2] on the host; no pool tensor)")
    if changed:
        onnx.save(model, str(onnx_path))
    return changed
