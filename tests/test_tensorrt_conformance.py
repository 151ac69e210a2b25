"""The exported graphs against what TensorRT's ONNX parser accepts (trtpaged/builder/tensorrt_rules.py).

No TensorRT here: the rules are taken from the parser's source and TensorRT's quantization rules
(each rule names its source). Two halves:
- every rule rejects a small graph that breaks it, the patterns trtpaged's export had before issue 20
  (UINT4 codes, rank-2 per-channel int8 scales, de-quantization after a Gather, a Cast between
  DequantizeLinear and the MatMul, INT4 block 32), and accepts the conforming form;
- a tiny export of every example's quantization and KV cache dtype passes every rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from trtpaged.builder.tensorrt_rules import RULES, check_graph, format_violations
from tests.conftest import TINY_KV4
from tests.test_families import BASE as FAMILY_DIMS, FAMILIES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _dq_graph(codes: onnx.TensorProto, scale: onnx.TensorProto, *, axis: Optional[int], block_size: int = 0,
              via_gather: bool = False, cast: bool = False, zero_point: onnx.TensorProto | None = None,
              k: int = 128, n: int = 64) -> onnx.ModelProto:
    """x [T, K] @ DequantizeLinear(codes) [K, N] (or a variant that breaks one rule)."""
    f = TensorProto.FLOAT
    nodes, inits = [], [codes, scale]
    dq_inputs = [codes.name, scale.name]
    if via_gather:
        inits.append(numpy_helper.from_array(np.array([0, 1], dtype=np.int64), "ids"))
        nodes.append(helper.make_node("Gather", [codes.name, "ids"], ["rows"]))
        dq_inputs[0] = "rows"
    if zero_point is not None:
        inits.append(zero_point)
        dq_inputs.append(zero_point.name)
    attrs = {**({} if axis is None else {"axis": axis}), **({"block_size": block_size} if block_size else {})}
    nodes.append(helper.make_node("DequantizeLinear", dq_inputs, ["w"], name="dq", **attrs))
    weight = "w"
    if cast:
        nodes.append(helper.make_node("Cast", ["w"], ["w16"], to=TensorProto.FLOAT16))
        nodes.append(helper.make_node("Cast", ["w16"], ["w32"], to=f))
        weight = "w32"
    nodes.append(helper.make_node("MatMul", ["x", weight], ["y"], name="mm"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["T", k])],
                              [helper.make_tensor_value_info("y", f, ["T", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return onnx.shape_inference.infer_shapes(model)


def _int8(k=128, n=64, name="codes"):
    return numpy_helper.from_array(np.ones((k, n), dtype=np.int8), name)


def _int4(k=128, n=64, signed=True, name="codes"):
    return helper.make_tensor(name, TensorProto.INT4 if signed else TensorProto.UINT4, [k, n],
                              np.ones(k * n, dtype=np.int64).tolist())


def _scale(shape, value=0.01, dtype=np.float32, name="scale"):
    return numpy_helper.from_array(np.full(shape, value, dtype=dtype), name)


def _rules(model) -> set[str]:
    return {v.rule for v in check_graph(model)}


def test_conforming_weight_only_patterns_pass():
    assert _rules(_dq_graph(_int8(), _scale([64]), axis=1)) == set()  # int8 per channel, 1-D scale
    for block in (64, 128):  # int4 block quantization along K
        assert _rules(_dq_graph(_int4(), _scale([128 // block, 64]), axis=0, block_size=block)) == set()


@pytest.mark.parametrize("case,rule", [
    ("uint4 codes", "initializer-dtype"),
    ("int8 rank-2 per-channel scale", "dq-block-dtype"),
    ("int4 block 32", "dq-int4-block-size"),
    ("int4 blocked along N", "dq-int4-block-size"),
    ("dq after gather", "dq-constant-root"),
    ("cast before matmul", "dq-feeds-matmul"),
    ("nonzero zero point", "dq-zero-point"),
    ("zero point of another volume", "dq-zero-point"),
    ("negative scale", "dq-scale"),
    ("int32 scale", "dq-scale"),
    ("wrong per-channel count", "dq-scale-shape"),
    ("gather of int8", "op-input-dtype"),
])
def test_each_rule_rejects_the_pattern_that_breaks_it(case, rule):
    graphs = {
        "uint4 codes": lambda: _dq_graph(_int4(signed=False), _scale([2, 64]), axis=0, block_size=64),
        "int8 rank-2 per-channel scale": lambda: _dq_graph(_int8(), _scale([1, 64]), axis=1, block_size=128),
        "int4 block 32": lambda: _dq_graph(_int4(), _scale([4, 64]), axis=0, block_size=32),
        "int4 blocked along N": lambda: _dq_graph(_int4(), _scale([128, 1]), axis=1, block_size=64),
        "dq after gather": lambda: _dq_graph(_int8(), _scale([64]), axis=1, via_gather=True),
        "cast before matmul": lambda: _dq_graph(_int8(), _scale([64]), axis=1, cast=True),
        "nonzero zero point": lambda: _dq_graph(_int8(), _scale([64]), axis=1,
                                                zero_point=numpy_helper.from_array(np.full(64, 3, np.int8), "zp")),
        "zero point of another volume": lambda: _dq_graph(
            _int8(), _scale([64]), axis=1, zero_point=numpy_helper.from_array(np.zeros(1, np.int8), "zp")),
        "negative scale": lambda: _dq_graph(_int8(), _scale([64], value=-0.5), axis=1),
        "int32 scale": lambda: _dq_graph(_int8(), numpy_helper.from_array(np.ones(64, np.int32), "scale"), axis=1),
        "wrong per-channel count": lambda: _dq_graph(_int8(), _scale([32]), axis=1),
        "gather of int8": lambda: _dq_graph(_int8(), _scale([64]), axis=1, via_gather=True),
    }
    assert rule in RULES and RULES[rule].source
    assert rule in _rules(graphs[case]())


def _op_graph(node: onnx.NodeProto, inputs: dict[str, int], inits: tuple = (), out_type: int = TensorProto.FLOAT,
              tensor: Optional[onnx.TensorProto] = None) -> onnx.ModelProto:
    """One node over graph inputs {name: type} ([4] each) and initializers, output y."""
    initializers = [*inits, *([tensor] if tensor else [])]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [4]) for n, t in inputs.items()],
                              [helper.make_tensor_value_info("y", out_type, [4])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _external(location: str, extra: Optional[dict] = None) -> onnx.TensorProto:
    tensor = numpy_helper.from_array(np.ones(4, np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "offset": "0", "length": "16", **(extra or {})}.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


@pytest.mark.parametrize("case,rule", [
    ("reduce axes computed", "constant-axes"),
    ("unsqueeze axes computed", "constant-axes"),
    ("integer pow exponent", "float-pow"),
    ("gelu approximate erf", "gelu-approximate"),
    ("cast to double", "tensor-dtype"),
    ("double network input", "tensor-dtype"),
    ("external data in the parent folder", "external-data"),
    ("external data with an unknown key", "external-data"),
])
def test_importer_refusals_of_operands_and_types(case, rule):
    """Refusals of TensorRT's importers the table missed (was: accepted): axes the importer needs as constants,
    an integer Pow exponent, an unknown Gelu approximation, DOUBLE (held as float32), external data it cannot read.
    The conforming form of each passes."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    two = numpy_helper.from_array(np.array(2, np.int64), "e")
    graphs = {
        "reduce axes computed": (_op_graph(helper.make_node("ReduceMean", ["x", "a"], ["y"]), {"x": f, "a": i64}),
                                 _op_graph(helper.make_node("ReduceMean", ["x", "axes"], ["y"]), {"x": f}, (axes,))),
        "unsqueeze axes computed": (_op_graph(helper.make_node("Unsqueeze", ["x", "a"], ["y"]), {"x": f, "a": i64}),
                                    _op_graph(helper.make_node("Unsqueeze", ["x", "axes"], ["y"]), {"x": f}, (axes,))),
        "integer pow exponent": (
            _op_graph(helper.make_node("Pow", ["x", "e"], ["y"]), {"x": f}, (two,)),
            _op_graph(helper.make_node("Pow", ["x", "e"], ["y"]), {"x": f},
                      (numpy_helper.from_array(np.array(2, np.float32), "e"),))),
        "gelu approximate erf": (_op_graph(helper.make_node("Gelu", ["x"], ["y"], approximate="erf"), {"x": f}),
                                 _op_graph(helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"), {"x": f})),
        "cast to double": (_op_graph(helper.make_node("Cast", ["x"], ["y"], to=TensorProto.DOUBLE), {"x": f},
                                     out_type=TensorProto.DOUBLE),
                           _op_graph(helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16), {"x": f},
                                     out_type=TensorProto.FLOAT16)),
        "double network input": (_op_graph(helper.make_node("Neg", ["x"], ["y"]), {"x": TensorProto.DOUBLE},
                                           out_type=TensorProto.DOUBLE),
                                 _op_graph(helper.make_node("Neg", ["x"], ["y"]), {"x": f})),
        "external data in the parent folder": (
            _op_graph(helper.make_node("Add", ["x", "w"], ["y"]), {"x": f}, tensor=_external("../w.bin")),
            _op_graph(helper.make_node("Add", ["x", "w"], ["y"]), {"x": f}, tensor=_external("w.bin"))),
        "external data with an unknown key": (
            _op_graph(helper.make_node("Add", ["x", "w"], ["y"]), {"x": f},
                      tensor=_external("w.bin", {"basepath": "/tmp"})),
            _op_graph(helper.make_node("Add", ["x", "w"], ["y"]), {"x": f},
                      tensor=_external("w.bin", {"checksum": "0"}))),
    }
    refused, accepted = graphs[case]
    assert rule in RULES and RULES[rule].source
    assert rule in _rules(refused)
    assert _rules(accepted) == set()


def test_constant_nodes_are_taken_as_the_parser_takes_them():
    """The parser imports Constant nodes as weights (onnxOpImporters.cpp Constant: value, value_float(s) as FLOAT,
    value_int(s) as INT64), so constant axes and exponents may come from them (was: every Constant refused as an op
    without an importer, and a value_float one as UNDEFINED); a sparse_value one stays refused."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Constant", [], ["axes"], value_ints=[0]),
             helper.make_node("Constant", [], ["two"], value_float=2.0),
             helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.ones(4, np.float32))),
             helper.make_node("Pow", ["x", "two"], ["sq"]), helper.make_node("Add", ["sq", "one"], ["z"]),
             helper.make_node("Unsqueeze", ["z", "axes"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [4])],
                              [helper.make_tensor_value_info("y", f, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    assert _rules(model) == set()
    integer = helper.make_graph([helper.make_node("Constant", [], ["two"], value_int=2),
                                 helper.make_node("Pow", ["x", "two"], ["y"])], "g",
                                [helper.make_tensor_value_info("x", f, [4])],
                                [helper.make_tensor_value_info("y", f, [4])])
    assert _rules(helper.make_model(integer)) == {"float-pow"}  # an INT64 exponent from a Constant node
    sparse = helper.make_node("Constant", [], ["y"], sparse_value=helper.make_sparse_tensor(
        numpy_helper.from_array(np.ones(1, np.float32)), numpy_helper.from_array(np.zeros(1, np.int64)), [4]))
    assert _rules(helper.make_model(helper.make_graph([sparse], "g", [], [helper.make_tensor_value_info("y", f, [4])])
                                    )) == {"initializer-dtype"}


def test_per_channel_dequantize_names_its_axis():
    """Without an axis, ONNX (and onnx.reference at verification) scales along axis 1 and TensorRT's parser along
    axis 0: a square int8 weight would parse and be de-quantized along the other axis (was: accepted)."""
    square = _dq_graph(_int8(64, 64), _scale([64]), axis=None, k=64, n=64)
    assert _rules(square) == {"dq-axis"}
    assert _rules(_dq_graph(_int8(64, 64), _scale([64]), axis=1, k=64, n=64)) == set()
    assert _rules(_dq_graph(_int8(64, 64), _scale([]), axis=None, k=64, n=64)) == set()  # per tensor: no axis used


def test_plugin_nodes_need_their_registered_creator_and_fields():
    from trtpaged.builder.onnx_node import OP_TYPE

    f = TensorProto.FLOAT

    def graph(**attrs):
        inputs = ["q", "k", "v", "kv_cache", "positions", "query_start", "context_lens", "block_tables"]
        node = helper.make_node(OP_TYPE, inputs, ["y", "kv_cache_out"], domain="trtpaged", name="attn", **attrs)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, f, [4]) for n in inputs],
                              [helper.make_tensor_value_info("y", f, [4])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("trtpaged", 1)])

    fields = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, layer=0, scale=0.25, kv_cache_dtype="auto")
    ok = dict(fields, plugin_version="1", plugin_namespace="trtpaged")
    assert _rules(graph(**ok)) == set()
    assert _rules(graph(**dict(ok, plugin_namespace="other"))) == {"op-importer"}
    assert _rules(graph(**dict(ok, scale=1))) == {"plugin-fields"}  # INT where the creator wants kFLOAT32
    assert _rules(graph(**{k: v for k, v in ok.items() if k != "layer"})) == {"plugin-fields"}
    # the window and soft-cap fields are optional (absent: 0), but of their type when present
    assert _rules(graph(**dict(ok, sliding_window=4096, logit_softcap=50.0))) == set()
    assert _rules(graph(**dict(ok, sliding_window=4096.0))) == {"plugin-fields"}
    unknown = helper.make_model(helper.make_graph([helper.make_node("MatMulInteger", ["x", "x"], ["y"])], "g",
                                                  [helper.make_tensor_value_info("x", f, [4])],
                                                  [helper.make_tensor_value_info("y", f, [4])]))
    assert _rules(unknown) == {"op-importer"}


def _example_cases() -> list[tuple[str, dict]]:
    """(example name, its quantization / kv_cache_dtype / dtype / tensor_parallel on the TINY_KV4 dims)."""
    cases = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        tp = min(int(data.get("tensor_parallel", 1)), 2)  # TINY_KV4's 8 heads / 4 KV heads split over 2
        cases.append((path.stem, {"quantization": data.get("quantization"), "dtype": data.get("dtype", "float32"),
                                  "kv_cache_dtype": data.get("kv_cache_dtype", "auto"), "tensor_parallel": tp}))
    return cases


def export_tiny_graphs(case: dict, out: Path, tie: bool = True, trace_every_rank: bool = False,
                       rank_models: Optional[list] = None) -> list[Path]:
    """The rank graphs the build's export stage writes for `case` on the tiny dims, in the case's own dtype
    (float16 too, which a CPU build would turn into float32), without verification. The build traces rank 0
    and makes the other ranks' graphs from it; `trace_every_rank` traces each rank's model instead.
    `rank_models` gets the exported step models appended."""
    from trtpaged.builder import tensorrt_graph
    from trtpaged.builder.export import export_onnx, export_other_rank
    from trtpaged.builder.pipeline import rank_step_model, shard_files
    from trtpaged.builder.quantize import quantized_step_model
    from trtpaged.builder.weights import save_weights
    from trtpaged.config import parse_config
    from trtpaged.kv_formats import QUANTIZED_KV_CACHE_DTYPES
    from trtpaged.models import dims_from_hf_config, load_hf
    from trtpaged.models.loading import TORCH_DTYPES, step_model_from_hf

    data = {**TINY_KV4, "dtype": case["dtype"], "kv_cache_dtype": case["kv_cache_dtype"],
            "tensor_parallel": case["tensor_parallel"]}
    data["model"] = {"tiny": {**TINY_KV4["model"]["tiny"], "tie_word_embeddings": tie, **case.get("tiny", {})}}
    if case["quantization"]:
        data["quantization"] = case["quantization"]
    config = parse_config(data)
    hf = load_hf(config.model, torch.float32)
    dims = dims_from_hf_config(hf.config, config.limits.max_seq_len)
    dtype = TORCH_DTYPES[config.dtype]
    graph, plan = None, {}
    if config.quantization.enabled:
        model, quantized = quantized_step_model(hf.model, config.model, dims, config.quantization, dtype)
        graph, plan = tensorrt_graph.plan_graph(quantized, hf.model, dims, dtype, config.quantization), quantized.plan
    else:
        model = step_model_from_hf(hf.model, dims, dtype)
    kv = config.kv_cache_dtype
    kv = kv if kv in QUANTIZED_KV_CACHE_DTYPES else TORCH_DTYPES[kv]
    paths = []
    shards = shard_files(config.tensor_parallel)
    for rank, files in enumerate(shards):
        rank_model = rank_step_model(model, plan, config.tensor_parallel, rank, config.quantization)
        save_weights(rank_model, out / files["weights_file"])
        if graph is not None:
            source = graph.step_model()
            if len(shards) > 1:
                source = rank_step_model(source, graph.state.plan, config.tensor_parallel, rank, config.quantization)
            rank_model = tensorrt_graph.to_tensorrt_graph(source)
        if rank_models is not None:
            rank_models.append(rank_model)
        if rank > 0 and not trace_every_rank:
            paths.append(export_other_rank(paths[0], rank_model, rank, out / files["onnx_file"],
                                           out / files["weights_file"]))
        else:
            paths.append(export_onnx(rank_model, config.limits.block_size, kv, out / files["onnx_file"],
                                     out / files["weights_file"]))
    return paths


@pytest.mark.parametrize("quantization, tiny", [
    (None, {"attention_bias": True}),  # q/k/v biases sliced per rank, o_proj bias zero on rank 1
    ({"weights": "int4", "group_size": 32, "lm_head": "int8"}, {}),  # the TensorRT forms' side file
], ids=["float-biases", "int4"])
def test_a_rank_graph_made_from_rank_0s_equals_its_own_trace(quantization, tiny, tmp_path):
    """The build traces rank 0 only; rank 1's graph made from it must be the graph tracing rank 1 gives:
    the same nodes and attributes (the all-reduce's rank included) and the same initializers, byte for byte."""
    from trtpaged.builder.export import export_other_rank
    from trtpaged.builder.onnx_allreduce import OP_TYPE as ALLREDUCE

    case = {"quantization": quantization, "dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel": 2,
            "tiny": tiny}
    models: list = []
    traced = export_tiny_graphs(case, tmp_path, tie=False, trace_every_rank=True, rank_models=models)
    if tiny.get("attention_bias"):
        assert any(name.endswith("o_proj.bias") for name in models[1].state_dict())
    made = export_other_rank(traced[0], models[1], 1, tmp_path / "made-rank1.onnx",
                             tmp_path / "weights-rank1.safetensors")  # its own side file, if the model has one
    assert check_graph(made) == []
    onnx.checker.check_model(str(made), full_check=True)
    want, got = onnx.load(str(traced[1])), onnx.load(str(made))  # external data read in

    def nodes(model):
        return [(n.domain, n.op_type, [(a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute])
                for n in model.graph.node]

    def tensors(model):
        return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}

    assert nodes(got) == nodes(want)
    assert any(n[1] == ALLREDUCE and ("rank", 1) in n[2] for n in nodes(got))
    a, b = tensors(want), tensors(got)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("name,case", _example_cases(), ids=[n for n, _ in _example_cases()])
def test_every_example_exports_a_graph_tensorrt_accepts(name, case, tmp_path):
    for path in export_tiny_graphs(case, tmp_path):
        violations = check_graph(path)
        assert not violations, f"{name} ({path.name}):\n{format_violations(violations)}"
        onnx.checker.check_model(str(path), full_check=True)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"phi3-longrope"}))  # phi3's ops; its 256 positions < 512
def test_every_family_exports_a_graph_tensorrt_accepts(family, tmp_path):
    """Each family's own ops conform (was: Gemma's tanh GELU and soft-cap Tanh, which TensorRT's parser imports,
    were missing from the rule table, so the compile stage refused every Gemma graph)."""
    case = {"quantization": None, "dtype": "float32", "kv_cache_dtype": "auto", "tensor_parallel": 1,
            "tiny": {**FAMILY_DIMS, **FAMILIES[family]}}
    (path,) = export_tiny_graphs(case, tmp_path, tie=False)
    violations = check_graph(path)
    assert not violations, f"{family}:\n{format_violations(violations)}"


@pytest.mark.parametrize("family,quantization,dtype,kv_cache_dtype", [
    ("gemma2", {"weights": "int4", "group_size": 32, "lm_head": "int8"}, "float16", "int8"),
    ("gemma3", {"weights": "int8", "lm_head": "int8"}, "bfloat16", "fp8_e4m3"),
    ("phi3", {"weights": "int4", "group_size": 32, "lm_head": "none"}, "bfloat16", "float16"),
])
def test_family_graphs_in_half_precision_with_quantized_weights_conform(family, quantization, dtype, kv_cache_dtype,
                                                                          tmp_path):
    """A family's own ops (GELU, soft-caps, q/k norms, partial rotary) in float16/bfloat16 beside de-quantized
    weights and a quantized or half KV cache: every rule holds and onnx.checker passes."""
    case = {"quantization": quantization, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "tensor_parallel": 1,
            "tiny": {**FAMILY_DIMS, **FAMILIES[family]}}
    (path,) = export_tiny_graphs(case, tmp_path, tie=True)
    violations = check_graph(path)
    assert not violations, f"{family}:\n{format_violations(violations)}"
    onnx.checker.check_model(str(path), full_check=True)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "float16"])
def test_int4_graph_with_every_kv_cache_dtype_conforms(kv_cache_dtype, tmp_path):
    case = {"quantization": {"weights": "int4", "group_size": 32, "lm_head": "int8"}, "dtype": "float32",
            "kv_cache_dtype": kv_cache_dtype, "tensor_parallel": 1}
    (path,) = export_tiny_graphs(case, tmp_path, tie=False)
    assert check_graph(path) == []


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, None)])
def test_graph_form_computes_the_engine_weight_exactly(bits, group):
    """Signed INT4 with offsets + 8*scales (group 32 spread over blocks of 64), and int8 per channel transposed,
    are the engine's W bit for bit."""
    from trtpaged.builder.tensorrt_graph import TensorRTLinear
    from trtpaged.models.qlinear import QuantizedLinear
    from trtpaged.models.quant import quantize

    torch.manual_seed(1)
    weight = quantize(torch.randn(48, 256) * 0.05, bits, group)
    engine = QuantizedLinear.from_weight(weight, torch.randn(48), torch.float32)
    graph = TensorRTLinear(engine, torch.float32)
    assert torch.equal(graph.dequantized(), weight.dequantize())
    if bits == 4:  # the codes are the engine's nibbles ^ 8 (q - 8 in two's complement), laid out [K, N]
        from trtpaged.models.quant import unpack_int4

        codes = unpack_int4(graph.tensorrt_codes)
        want = (weight.int_codes() ^ 8).t().to(torch.uint8)
        if group == 32:  # [2K, N]: per 64 inputs, a block with the first group then zeros, then zeros and the second
            blocks = codes.reshape(-1, 2, 2, 32, 48)  # [chunk, copy, group in chunk, input, N]
            assert torch.equal(blocks[:, 0, 1], torch.zeros_like(blocks[:, 0, 1]))
            assert torch.equal(blocks[:, 1, 0], torch.zeros_like(blocks[:, 1, 0]))
            codes = torch.stack((blocks[:, 0, 0], blocks[:, 1, 1]), dim=1).reshape(256, 48)
        assert torch.equal(codes, want)
    x = torch.randn(5, 256)
    want = torch.nn.functional.linear(x.double(), weight.dequantize(torch.float64), engine.bias.double())
    assert float((graph(x).double() - want).abs().max()) <= 1e-4


def test_compile_refuses_a_graph_that_breaks_a_rule_before_touching_tensorrt(tmp_path):
    """The compile stage checks the rules first: one line naming the first violation and its source."""
    from trtpaged.builder import compile as trt_compile
    from trtpaged.tensorrt_env import CompileError

    path = tmp_path / "model.onnx"
    onnx.save(_dq_graph(_int4(signed=False), _scale([2, 64]), axis=0, block_size=64), str(path))
    with pytest.raises(CompileError) as e:
        trt_compile.compile_engine(path, tmp_path / "engine.plan", profile=None, model="tiny-llama")
    message = str(e.value)
    assert message.startswith("tiny-llama: TensorRT's parser would refuse the graph: codes: UINT4 has no TensorRT type")
    assert "getDtypeSizeBits" in message and "more)" in message and "\n" not in message


@pytest.mark.parametrize("group", [32, 64])
def test_int4_graph_runs_as_hf_with_the_engine_weights(group, tmp_path):
    """onnx.reference runs the signed-INT4 graph (block 64; group 32 spread over blocks of 64) as HF's forward
    with the engine's de-quantized weights: nothing is re-quantized."""
    from trtpaged.builder import tensorrt_graph
    from trtpaged.builder.quantize import dequantized_hf_model, quantized_step_model
    from trtpaged.builder.verify import verify_onnx
    from trtpaged.config import parse_config
    from trtpaged.models import dims_from_hf_config, load_hf

    case = {"quantization": {"weights": "int4", "group_size": group, "lm_head": "int8"}, "dtype": "float32",
            "kv_cache_dtype": "auto", "tensor_parallel": 1}
    (path,) = export_tiny_graphs(case, tmp_path, tie=False)
    config = parse_config({**TINY_KV4, "quantization": case["quantization"]})
    hf = load_hf(config.model, torch.float32)
    dims = dims_from_hf_config(hf.config, config.limits.max_seq_len)
    _, quantized = quantized_step_model(hf.model, config.model, dims, config.quantization, torch.float32)
    graph = tensorrt_graph.plan_graph(quantized, hf.model, dims, torch.float32, config.quantization)
    engine_reference = dequantized_hf_model(hf.model, dims, quantized)
    assert graph.notes == [] and graph.reference is None
    result = verify_onnx(path, engine_reference, dims.vocab_size, 16, "float32", "float32")
    assert result.max_abs_diff <= 1e-4 * result.max_abs_logit
