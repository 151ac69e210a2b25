"""What TensorRT's ONNX parser accepts, as a rule table, and a checker that applies it to an exported graph.

Each rule names its source: the onnx-tensorrt parser (the mid-2024 snapshot of
github.com/onnx/onnx-tensorrt: file, function, line) or, where TensorRT's own
documentation says more than that snapshot (NVIDIA's "Working with Quantized
Types"; the TensorRT 10.x/11.x headers), the summary of it in issue 20. The
checker reads only the graph structure (no weights are loaded except the
scales, which must be positive), so it runs on any CPU in milliseconds.

`check_graph(model)` returns every violation; `tests/test_tensorrt_conformance.py`
runs it over a tiny export of every example's quantization and KV cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import onnx
from onnx import TensorProto

from trtpaged.builder.onnx_allreduce import OP_TYPE as ALLREDUCE_OP
from trtpaged.builder.onnx_node import OP_TYPE as ATTENTION_OP
from trtpaged.builder.onnx_node import PLUGIN_NAMESPACE, PLUGIN_VERSION

_PARSER = "onnx-tensorrt"


@dataclass(frozen=True)
class Rule:
    id: str
    text: str
    source: str


RULES = {r.id: r for r in (
    Rule("initializer-dtype", "every initializer has a data type the parser converts (no UINT4, no INT16, ...)",
         f"{_PARSER} weightUtils.cpp getDtypeSizeBits (line 44); importerUtils.cpp convertDtype (line 314)"),
    Rule("op-importer", "every node's op_type has a built-in importer, or is a plugin trtpaged registers",
         f"{_PARSER} onnxOpImporters.cpp DEFINE_BUILTIN_OP_IMPORTER list; FallbackPluginImporter (line 6438) "
         "finds other op_types by op_type, plugin_version and plugin_namespace"),
    Rule("op-input-dtype", "each node's data inputs have a type its operator row lists",
         f"{_PARSER} docs/operators.md, Operator Support Matrix (Supported Types column)"),
    Rule("plugin-fields", "a plugin node carries every field its creator declares, as an attribute of the type "
         "the parser turns into that field type (INT -> kINT32, FLOAT -> kFLOAT32, STRING -> kCHAR)",
         f"{_PARSER} onnxOpImporters.cpp loadFields (line 6112); plugins/src/tensorrt/fields.cpp, "
         "allreduce_plugin.cpp (the creators' field lists)"),
    Rule("dq-input-dtype", "DequantizeLinear's input is INT8, INT4 or FP8 (not UINT8/UINT4)",
         f"{_PARSER} docs/operators.md DequantizeLinear row; onnxOpImporters.cpp QuantDequantLinearHelper "
         "(line 1346: notInvalidType UINT8; 'TensorRT only allows FP8, INT8, and INT4 quantization')"),
    Rule("dq-zero-point", "DequantizeLinear has no zero point, or an all-zero one (symmetric only) with as many "
         "values as the scale",
         f"{_PARSER} docs/operators.md DequantizeLinear row ('x_zero_point must be zero'); "
         "QuantDequantLinearHelper ('TensorRT only supports symmetric quantization'; line 1507: 'The scale and zero "
         "point must have the same volume')"),
    Rule("dq-scale", "the scale is a positive FP32/FP16/BF16 constant",
         f"{_PARSER} QuantDequantLinearHelper ('Scale coefficients must all be positive'; the DQ output type is the "
         "scale's type)"),
    Rule("dq-scale-shape", "the scale is a scalar, 1-D with one value per channel of `axis` (per-channel), or of "
         "the input's rank blocked along exactly one axis (block quantization)",
         f"{_PARSER} QuantDequantLinearHelper (scale rank checks: 'number of scales is not equal to the number of "
         "output channels', 'Only a single blocking dimension is allowed', 'Invalid rank for the scale tensor')"),
    Rule("dq-axis", "a DequantizeLinear with more than one scale names its axis: absent, ONNX reads axis 1 (what "
         "onnx.reference verifies), the 10.1 parser axis 0 (the input's rank, then 0 for per-channel scales) and "
         "later parsers axis 1, so the same graph de-quantizes along different axes by TensorRT version",
         f"{_PARSER} onnxOpImporters.cpp QuantDequantLinearHelper (line 1521: attrs.get(\"axis\", "
         "inputDims.nbDims); line 1529: 'if (axis == inputDims.nbDims) axis = 0'); the later parser's "
         "QuantDequantLinearHelper: attrs.get(\"axis\", 1)"),
    Rule("dq-block-dtype", "block quantization (a scale of the input's rank) is for INT4 (and FP8/FP4) only; "
         "INT8 is per-tensor or per-channel with a 1-D scale",
         "NVIDIA, Working with Quantized Types (block quantization: INT4/FP8/FP4), as summarized in issue 20 item 3"),
    Rule("dq-int4-block-size", "INT4 block quantization has block size 64 or 128, along the input dimension "
         "the MatMul reduces over",
         "NVIDIA, Working with Quantized Types (INT4 weight-only block sizes), as summarized in issue 20 item 2"),
    Rule("dq-constant-root", "DequantizeLinear's input is a constant (initializer): per-channel and block "
         "de-quantization must be rooted at a constant, not at a Gather's output",
         "NVIDIA, Working with Quantized Types, as summarized in issue 20 item 4"),
    Rule("dq-feeds-matmul", "DequantizeLinear's output goes straight into a MatMul's weight input (no Cast, "
         "Transpose or Gemm between), the pattern of NVIDIA's exporters (a weight-only GEMM for INT4; INT8 may run "
         "as a de-quantization and a float GEMM)",
         "issue 20 item 7 (NVIDIA's exporters emit DequantizeLinear -> MatMul); the DQ output type is the "
         "scale's (QuantDequantLinearHelper), so a compute-dtype scale needs no Cast"),
    Rule("plugin-pool-io", "the paged-attention node's pool I/O is one form the plugin takes: aliased (input "
         "kv_cache a float pool, or a quantized pool's bytes typed INT8/FP16, and output kv_cache_out "
         "aliased to it) or by address (input an INT64 [2] network input, one output, num_layers and a named "
         "kv_cache_dtype)",
         "TensorRT NvInferRuntime.h IPluginV3OneBuildV2::getAliasedInput (an output aliases one input; only "
         "with PreviewFeature::kALIASED_PLUGIN_IO_10_03), IPluginV3OneBuild::getOutputDataTypes (no kUINT8 output) and "
         "DataType; plugins/src/tensorrt/attention_io.cpp "
         "is_pool_type / check_shapes, fields.cpp validate"),
    Rule("constant-axes", "the axes a Reduce*, Slice, Squeeze or Unsqueeze takes as an input are a constant "
         "(initializer or Constant), not computed in the graph",
         f"{_PARSER} importerUtils.cpp reduceTensor (line 1474: 'Axis input must be an initializer!'); "
         "onnxOpImporters.cpp Slice (line 5322: 'does not support dynamic axes'), Squeeze (line 5619), Unsqueeze "
         "(line 5889: 'Axes input for unsqueeze operation should be a constant tensor')"),
    Rule("float-pow", "both of Pow's inputs are floating point (ONNX allows an integer exponent; TensorRT does not)",
         f"{_PARSER} importerUtils.cpp elementwiseCheck (line 554: 'Elementwise layer does not support operator POW "
         "with boolean or integer types')"),
    Rule("gelu-approximate", "Gelu's approximate is 'none' or 'tanh'",
         f"{_PARSER} onnxOpImporters.cpp Gelu (line 1990: 'Invalid value provided for the Gelu approximate "
         "attribute')"),
    Rule("tensor-dtype", "a Cast's `to`, and every network input's and output's type, is a type the parser converts, "
         "and not DOUBLE (converted to kFLOAT: TensorRT would compute, take or give float32 where the graph says "
         "float64)",
         f"{_PARSER} onnxOpCheckers.cpp Cast (line 184: 'Unsupported data type for the Cast operator!'); "
         "ModelImporter.cpp importInput (line 362) and the output marking (line 786): 'Failed to convert ONNX date "
         "type to TensorRT data type'; importerUtils.cpp convertDtype (line 318: DOUBLE -> kFLOAT)"),
    Rule("external-data", "an external initializer names only location, offset, length (checksum), its location "
         "in the model's folder (no ../)",
         f"{_PARSER} WeightsContext.cpp convertOnnxWeights (line 248: 'Key value of: ... was not expected!'), "
         "parseExternalWeights (line 151: 'Relative paths to parent (../) are not allowed')"),
    Rule("int4-even-last-dim", "an INT4 tensor's last dimension is even (packing)",
         f"{_PARSER} QuantDequantLinearHelper ('Quantization to INT4 is not supported for tensors with an odd "
         "last dimension')"),
)}

# data types the parser converts (importerUtils.cpp convertDtype, line 314)
PARSER_DTYPES = frozenset({
    TensorProto.DOUBLE, TensorProto.FLOAT, TensorProto.INT8, TensorProto.UINT8, TensorProto.FLOAT16,
    TensorProto.BFLOAT16, TensorProto.BOOL, TensorProto.INT32, TensorProto.INT64, TensorProto.FLOAT8E4M3FN,
    TensorProto.INT4,
})
_F, _H, _B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
_I32, _I64, _BOOL, _I8 = TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL, TensorProto.INT8
_FLOATS = frozenset({_F, _H, _B})
_NUMERIC = _FLOATS | {_I32, _I64}
_MOVABLE = _NUMERIC | {_BOOL}
# op_type -> (supported types, which inputs are data) from docs/operators.md's rows, for every op a trtpaged
# graph has; an op not listed here fails op-importer until it is added with its row's types.
OP_TYPES: dict[str, tuple[frozenset, tuple[int, ...]]] = {
    "Add": (_NUMERIC, (0, 1)), "Sub": (_NUMERIC, (0, 1)), "Mul": (_NUMERIC, (0, 1)), "Div": (_NUMERIC, (0, 1)),
    "Neg": (_NUMERIC, (0,)), "Pow": (_FLOATS, (0,)), "Sqrt": (_FLOATS, (0,)), "Reciprocal": (_FLOATS, (0,)),
    "Cos": (_FLOATS, (0,)), "Sin": (_FLOATS, (0,)), "Sigmoid": (_FLOATS, (0,)), "Softmax": (_FLOATS, (0,)),
    "Gelu": (_FLOATS, (0,)), "Tanh": (_FLOATS, (0,)),  # Gemma's tanh GELU and soft-caps (importers Gelu, Tanh)
    "Cast": (_MOVABLE | {TensorProto.UINT8}, (0,)), "Concat": (_MOVABLE, ()), "Expand": (_MOVABLE, (0,)),
    "Gather": (_MOVABLE, (0,)), "Identity": (_MOVABLE, (0,)), "Reshape": (_MOVABLE, (0,)),
    "Shape": (_MOVABLE, (0,)), "Slice": (_MOVABLE, (0,)), "Split": (_MOVABLE, (0,)), "Squeeze": (_MOVABLE, (0,)),
    "Unsqueeze": (_MOVABLE, (0,)), "Transpose": (_MOVABLE, (0,)), "Where": (_MOVABLE, (1, 2)),
    "Range": (_NUMERIC, (0,)), "ReduceMean": (_NUMERIC, (0,)), "ReduceSum": (_NUMERIC, (0,)),
    "Gemm": (_FLOATS, (0, 1)), "MatMul": (_FLOATS, (0, 1)),
    "DequantizeLinear": (frozenset({_I8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN}), (0,)),
    "Constant": (_MOVABLE, ()),  # no inputs: its value is checked as an initializer (initializer-dtype)
}
_INT, _FLOAT, _STRING = onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING
# the fields each trtpaged plugin creator declares (plugins/src/tensorrt/fields.cpp, allreduce_plugin.cpp)
PLUGIN_FIELDS: dict[str, dict[str, int]] = {
    ATTENTION_OP: {"num_heads": _INT, "num_kv_heads": _INT, "head_dim": _INT, "block_size": _INT, "layer": _INT,
                   "scale": _FLOAT, "kv_cache_dtype": _STRING},
    ALLREDUCE_OP: {"rank": _INT, "world_size": _INT},
}
# fields a creator takes when present and defaults when absent (fields.cpp: kv_pool "aliased"/"address",
# num_layers with address; sliding_window and logit_softcap 0, as a graph exported before they existed has none)
PLUGIN_OPTIONAL_FIELDS: dict[str, dict[str, int]] = {ATTENTION_OP: {"kv_pool": _STRING, "num_layers": _INT,
                                                                    "sliding_window": _INT, "logit_softcap": _FLOAT}}
# not UINT8: the aliased pool is also the plugin's output kv_cache_out, and getOutputDataTypes may not give kUINT8
# (NvInferRuntime.h, IPluginV3OneBuild::getOutputDataTypes: "DataType:kBOOL and DataType::kUINT8 are not supported")
_QUANTIZED_POOL_TYPES = frozenset({_I8, _H})
# attribute types loadFields turns into plugin fields (onnxOpImporters.cpp line 6112)
PLUGIN_ATTRIBUTE_TYPES = frozenset({_INT, _FLOAT, _STRING, onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS,
                                    onnx.AttributeProto.STRINGS, onnx.AttributeProto.TENSOR})
INT4_BLOCK_SIZES = (64, 128)
# op_type -> the input index of the axes its importer needs as a constant (rule constant-axes)
CONSTANT_AXES = {"ReduceMean": 1, "ReduceSum": 1, "Slice": 3, "Squeeze": 1, "Unsqueeze": 1}
GELU_APPROXIMATIONS = (b"none", b"tanh")
# the tensor types TensorRT holds as given (DOUBLE is converted to kFLOAT)
EXACT_DTYPES = PARSER_DTYPES - {TensorProto.DOUBLE}
_EXTERNAL_KEYS = frozenset({"location", "offset", "length", "checksum"})


@dataclass(frozen=True)
class Violation:
    rule: str
    where: str  # node or initializer name
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message} [{self.rule}: {RULES[self.rule].source}]"


class _Graph:
    """Types, shapes, initializers and consumers of one graph, read without loading external data."""

    def __init__(self, model: onnx.ModelProto, base_dir: Optional[Path]) -> None:
        graph = model.graph
        self.base_dir = base_dir
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_inputs = {i.name for i in graph.input}
        self.types: dict[str, int] = {}
        self.shapes: dict[str, Optional[list[int]]] = {}
        for info in (*graph.input, *graph.value_info, *graph.output):
            tensor_type = info.type.tensor_type
            self.types[info.name] = tensor_type.elem_type
            dims = tensor_type.shape.dim if tensor_type.HasField("shape") else None
            self.shapes[info.name] = None if dims is None else [d.dim_value if d.HasField("dim_value") else -1
                                                                 for d in dims]
        for t in graph.initializer:
            self.types[t.name], self.shapes[t.name] = t.data_type, list(t.dims)
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
            if node.op_type == "Constant":
                for out in node.output:
                    self.initializers.setdefault(out, _constant_tensor(node))
                    if self.initializers[out].data_type:
                        self.types.setdefault(out, self.initializers[out].data_type)

    def values(self, name: str) -> Optional[np.ndarray]:
        tensor = self.initializers.get(name)
        if tensor is None:
            return None
        from onnx import numpy_helper
        from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

        if uses_external_data(tensor):
            if self.base_dir is None:
                return None
            tensor = onnx.TensorProto.FromString(tensor.SerializeToString())
            load_external_data_for_tensor(tensor, str(self.base_dir))
        return numpy_helper.to_array(tensor)


def _constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto:
    """A Constant node's value as a tensor: `value`, or value_float(s) / value_int(s) as FLOAT / INT64 (the
    Constant importer's types); an empty (UNDEFINED) tensor for the forms the parser does not take
    (sparse_value, value_string(s))."""
    from onnx import numpy_helper

    for attr in node.attribute:
        if attr.name == "value":
            return attr.t
        if attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
            dtype = np.float32 if attr.name.startswith("value_float") else np.int64
            return numpy_helper.from_array(np.array(onnx.helper.get_attribute_value(attr), dtype=dtype),
                                           node.output[0])
    return onnx.TensorProto()


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _dtype_name(dtype: int) -> str:
    return TensorProto.DataType.Name(dtype) if dtype in TensorProto.DataType.values() else str(dtype)


def _load(model: onnx.ModelProto | str | Path) -> tuple[onnx.ModelProto, Optional[Path]]:
    if isinstance(model, onnx.ModelProto):
        return model, None
    return onnx.load(str(model), load_external_data=False), Path(model).parent


def check_graph(model: onnx.ModelProto | str | Path) -> list[Violation]:
    """Every rule violation of the graph (a ModelProto, or the path of a model.onnx whose scales may then be read)."""
    proto, base_dir = _load(model)
    g = _Graph(proto, base_dir)
    out: list[Violation] = []
    for name, tensor in g.initializers.items():
        if tensor.data_type not in PARSER_DTYPES:
            out.append(Violation("initializer-dtype", name, f"{_dtype_name(tensor.data_type)} has no TensorRT type"))
        if tensor.data_type == TensorProto.INT4 and tensor.dims and tensor.dims[-1] % 2:
            out.append(Violation("int4-even-last-dim", name, f"INT4 shape {list(tensor.dims)} has an odd last dim"))
    out.extend(_check_external_data(proto.graph.initializer))
    for info in (*proto.graph.input, *proto.graph.output):
        dtype = info.type.tensor_type.elem_type
        if info.name not in g.initializers and dtype not in EXACT_DTYPES:
            out.append(Violation("tensor-dtype", info.name, f"network input/output of type {_dtype_name(dtype)}"))
    for node in proto.graph.node:
        out.extend(_check_node(node, g))
    return out


def _check_external_data(initializers: Iterable[onnx.TensorProto]) -> Iterable[Violation]:
    for tensor in initializers:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = {e.key: e.value for e in tensor.external_data}
        unknown = sorted(set(entries) - _EXTERNAL_KEYS)
        if unknown:
            yield Violation("external-data", tensor.name, f"external data keys {unknown} (the parser refuses them)")
        if "../" in entries.get("location", "").replace("\\", "/") or entries.get("location", "").startswith("/"):
            yield Violation("external-data", tensor.name, f"location {entries.get('location')!r} is outside the "
                                                          "model's folder")


def _check_node(node: onnx.NodeProto, g: _Graph) -> Iterable[Violation]:
    where = node.name or (node.output[0] if node.output else node.op_type)
    if node.op_type in PLUGIN_FIELDS:
        yield from _check_plugin(node, where)
        if node.op_type == ATTENTION_OP:
            yield from _check_pool_io(node, g, where)
        return
    if node.domain not in ("", "ai.onnx") or node.op_type not in OP_TYPES:
        yield Violation("op-importer", where, f"{node.domain or 'ai.onnx'}::{node.op_type} has no TensorRT importer "
                                              "in the rule table and is no trtpaged plugin")
        return
    allowed, data_inputs = OP_TYPES[node.op_type]
    indices = data_inputs or tuple(range(len(node.input)))
    for i in indices:
        if i < len(node.input) and node.input[i]:
            dtype = g.types.get(node.input[i])
            if dtype is not None and dtype not in allowed:
                rule = "dq-input-dtype" if node.op_type == "DequantizeLinear" else "op-input-dtype"
                yield Violation(rule, where, f"{node.op_type} input {i} ({node.input[i]}) is {_dtype_name(dtype)}; "
                                             f"TensorRT takes {', '.join(sorted(map(_dtype_name, allowed)))}")
    if node.op_type == "DequantizeLinear":
        yield from _check_dequantize(node, g, where)
    yield from _check_operands(node, g, where)


def _check_operands(node: onnx.NodeProto, g: _Graph, where: str) -> Iterable[Violation]:
    """The attribute values and constant operands the importers of the rule table's ops insist on."""
    axes = CONSTANT_AXES.get(node.op_type)
    if axes is not None and axes < len(node.input) and node.input[axes] and node.input[axes] not in g.initializers:
        yield Violation("constant-axes", where, f"{node.op_type} axes {node.input[axes]} are computed in the graph")
    if node.op_type == "Pow" and len(node.input) > 1 and g.types.get(node.input[1], _F) not in _FLOATS:
        yield Violation("float-pow", where, f"Pow exponent {node.input[1]} is {_dtype_name(g.types[node.input[1]])}")
    if node.op_type == "Gelu" and _attr(node, "approximate", b"none") not in GELU_APPROXIMATIONS:
        yield Violation("gelu-approximate", where, f"approximate {_attr(node, 'approximate')!r}")
    if node.op_type == "Cast" and _attr(node, "to") not in EXACT_DTYPES:
        yield Violation("tensor-dtype", where, f"Cast to {_dtype_name(_attr(node, 'to') or 0)}")


def _check_plugin(node: onnx.NodeProto, where: str) -> Iterable[Violation]:
    version, namespace = _attr(node, "plugin_version"), _attr(node, "plugin_namespace")
    if (version, namespace) != (PLUGIN_VERSION.encode(), PLUGIN_NAMESPACE.encode()):
        yield Violation("op-importer", where, f"{node.op_type}: plugin_version {version!r}, plugin_namespace "
                                              f"{namespace!r}; the registered creator is {PLUGIN_VERSION!r}, "
                                              f"{PLUGIN_NAMESPACE!r}")
    attributes = {a.name: a.type for a in node.attribute}
    for name, kind in attributes.items():
        if kind not in PLUGIN_ATTRIBUTE_TYPES:
            kind_name = onnx.AttributeProto.AttributeType.Name(kind)
            yield Violation("plugin-fields", where, f"attribute {name} of type {kind_name} is no plugin field")
    for name, kind in PLUGIN_OPTIONAL_FIELDS.get(node.op_type, {}).items():
        if name in attributes and attributes[name] != kind:
            yield Violation("plugin-fields", where, f"field {name}: attribute "
                                                    f"{onnx.AttributeProto.AttributeType.Name(attributes[name])}, "
                                                    f"the creator wants {onnx.AttributeProto.AttributeType.Name(kind)}")
    for name, kind in PLUGIN_FIELDS[node.op_type].items():
        if attributes.get(name) != kind:
            got = "missing" if name not in attributes else onnx.AttributeProto.AttributeType.Name(attributes[name])
            yield Violation("plugin-fields", where, f"field {name}: attribute {got}, the creator wants "
                                                    f"{onnx.AttributeProto.AttributeType.Name(kind)}")


def _check_pool_io(node: onnx.NodeProto, g: _Graph, where: str) -> Iterable[Violation]:
    kv_pool = (_attr(node, "kv_pool") or b"aliased").decode()
    kv_cache_dtype = (_attr(node, "kv_cache_dtype") or b"auto").decode()
    pool = node.input[3] if len(node.input) > 3 else ""
    pool_type, pool_shape = g.types.get(pool), g.shapes.get(pool)
    outputs = [o for o in node.output if o]

    def bad(message: str) -> Violation:
        return Violation("plugin-pool-io", where, message)

    if kv_pool == "address":
        if pool_type != TensorProto.INT64 or pool_shape != [2] or pool not in g.graph_inputs:
            yield bad(f"kv_pool address: input {pool!r} must be an INT64 [2] network input, got "
                      f"{_dtype_name(pool_type) if pool_type else '?'} {pool_shape}")
        if len(outputs) != 1:
            yield bad(f"kv_pool address: one output (out), got {len(outputs)}")
        if _attr(node, "num_layers") is None or kv_cache_dtype == "auto":
            yield bad("kv_pool address: needs num_layers and kv_cache_dtype naming the pool's type")
    elif kv_pool == "aliased":
        quantized = kv_cache_dtype in ("int8", "fp8_e4m3")
        allowed = _QUANTIZED_POOL_TYPES if quantized else _FLOATS
        if pool_type is not None and pool_type not in allowed:
            yield bad(f"kv_cache is {_dtype_name(pool_type)}; kv_cache_dtype {kv_cache_dtype} takes "
                      f"{', '.join(sorted(map(_dtype_name, allowed)))}")
        if len(outputs) != 2:
            yield bad(f"kv_pool aliased: two outputs (out, kv_cache_out), got {len(outputs)}")
    else:
        yield bad(f"kv_pool {kv_pool!r} is neither aliased nor address")


def _check_dequantize(node: onnx.NodeProto, g: _Graph, where: str) -> Iterable[Violation]:
    x, scale = node.input[0], node.input[1]
    x_type, x_shape, s_shape = g.types.get(x), g.shapes.get(x), g.shapes.get(scale)
    if len(node.input) > 2 and node.input[2]:
        zero = g.values(node.input[2])
        if zero is None or np.any(zero.astype(np.float64) != 0):
            yield Violation("dq-zero-point", where, f"zero point {node.input[2]} is not all zeros")
        elif s_shape is not None and zero.size != int(np.prod(s_shape)):
            yield Violation("dq-zero-point", where, f"zero point {node.input[2]} has {zero.size} values, the scale "
                                                    f"{int(np.prod(s_shape))}")
    if x not in g.initializers:
        yield Violation("dq-constant-root", where, f"input {x} is computed in the graph, not a constant")
    if scale not in g.initializers:
        yield Violation("dq-scale", where, f"scale {scale} is not a constant")
    elif g.types.get(scale) not in _FLOATS:
        yield Violation("dq-scale", where, f"scale {scale} is {_dtype_name(g.types.get(scale, 0))}")
    else:
        values = g.values(scale)
        if values is not None and not bool(np.all(values.astype(np.float64) > 0)):
            yield Violation("dq-scale", where, f"scale {scale} has values <= 0")
    yield from _check_scale_shape(node, x_type, x_shape, s_shape, where)
    users = g.consumers.get(node.output[0], [])
    for user in users:
        if user.op_type != "MatMul" or list(user.input).index(node.output[0]) != 1:
            yield Violation("dq-feeds-matmul", where, f"output {node.output[0]} goes into {user.op_type} "
                                                      f"({user.name or user.output[0]}), not a MatMul's weight input")
    if not users:
        yield Violation("dq-feeds-matmul", where, f"output {node.output[0]} is unused")


def _check_scale_shape(node: onnx.NodeProto, x_type: Optional[int], x_shape: Optional[list[int]],
                       s_shape: Optional[list[int]], where: str) -> Iterable[Violation]:
    if x_shape is None or s_shape is None or any(d < 0 for d in x_shape):
        yield Violation("dq-scale-shape", where, "input or scale shape unknown (dynamic)")
        return
    volume = int(np.prod(s_shape)) if s_shape else 1
    if volume == 1:
        return
    if _attr(node, "axis") is None:
        yield Violation("dq-axis", where, f"scale {s_shape} without an axis attribute: ONNX de-quantizes along axis 1, "
                                          "TensorRT 10.1's parser along axis 0")
        return
    axis = int(_attr(node, "axis"))
    axis = axis + len(x_shape) if axis < 0 else axis
    if len(s_shape) == 1:
        if s_shape[0] != x_shape[axis]:
            yield Violation("dq-scale-shape", where, f"{s_shape[0]} scales for {x_shape[axis]} channels of axis {axis}")
        return
    if len(s_shape) != len(x_shape):
        yield Violation("dq-scale-shape", where, f"scale rank {len(s_shape)} for an input of rank {len(x_shape)}")
        return
    blocks = [x // s if s else 0 for x, s in zip(x_shape, s_shape)]
    blocked = [i for i, b in enumerate(blocks) if b != 1]
    if len(blocked) != 1 or any(x % s for x, s in zip(x_shape, s_shape)):
        yield Violation("dq-scale-shape", where, f"scale {s_shape} for input {x_shape}: not blocked along one axis")
        return
    if x_type != TensorProto.INT4 and x_type != TensorProto.FLOAT8E4M3FN:
        yield Violation("dq-block-dtype", where, f"{_dtype_name(x_type or 0)} input with a rank-{len(s_shape)} "
                                                 f"scale {s_shape} is block quantization (INT4/FP8 only)")
    elif x_type == TensorProto.INT4 and blocks[blocked[0]] not in INT4_BLOCK_SIZES:
        yield Violation("dq-int4-block-size", where, f"INT4 block size {blocks[blocked[0]]} (TensorRT: "
                                                     f"{' or '.join(map(str, INT4_BLOCK_SIZES))})")
    elif len(x_shape) == 2 and blocked[0] != 0:
        yield Violation("dq-int4-block-size", where, f"blocked along axis {blocked[0]} of {x_shape}; a MatMul "
                                                     "weight [K, N] is blocked along K (axis 0)")


def format_violations(violations: list[Violation], limit: int = 20) -> str:
    """One line per violation (the first `limit`), then a count by rule."""
    lines = [str(v) for v in violations[:limit]]
    counts: dict[str, int] = {}
    for v in violations:
        counts[v.rule] = counts.get(v.rule, 0) + 1
    lines.append("by rule: " + ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items())))
    return "\n".join(lines)
