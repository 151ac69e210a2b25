"""The KV pool's forms selectable at build (model.yaml `tensorrt:`), host side, on CPU without TensorRT.

- `kv_pool: aliased` (the default): the pool a tensor the plugin updates in place;
- `kv_pool: address`: the pool's device address and num_kv_blocks an int64 [2] host input the plugin
  writes through (no pool tensor in the network, TensorRT-LLM's pattern);
- `quantized_pool: float16`: an int8/fp8_e4m3 pool's bytes typed as fp16 pairs (no uint8: a plugin output may not be
  kUINT8).

Each form: the model.yaml field is parsed and recorded, the graph passes the conformance rules
(builder/tensorrt_rules.py), and the TensorRT runner binds what the engine declares (a recording fake
engine and a fake `tensorrt` module). The retyped quantized graph is run by onnx.reference against the
int8 graph: the same logits and the same pool bytes.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tests.test_tensorrt_conformance import export_tiny_graphs
from trtpaged.builder import onnx_pool
from trtpaged.builder.onnx_node import OP_TYPE
from trtpaged.builder.tensorrt_rules import check_graph, format_violations
from trtpaged.config import ConfigError, TensorRTOptions, parse_config


def test_tensorrt_section_defaults_and_values():
    assert parse_config({"model": {"tiny": {}}}).tensorrt == TensorRTOptions("auto", "aliased", "int8")
    got = parse_config({"model": {"tiny": {}}, "tensorrt": {"graph": "always", "kv_pool": "address",
                                                            "quantized_pool": "float16"}}).tensorrt
    assert got.describe() == {"graph": "always", "kv_pool": "address", "quantized_pool": "float16"}


@pytest.mark.parametrize("spec,field,match", [
    ({"kv_pool": "pointer"}, "tensorrt.kv_pool", "allowed: aliased, address"),
    ({"quantized_pool": "int16"}, "tensorrt.quantized_pool", "allowed: int8, float16"),
    ({"graph": "never"}, "tensorrt.graph", "allowed: auto, always"),
    ({"kvpool": "address"}, "tensorrt.kvpool", "did you mean 'tensorrt.kv_pool'"),
    ("address", "tensorrt", "expected a mapping"),
])
def test_bad_tensorrt_values_name_the_field(spec, field, match):
    with pytest.raises(ConfigError, match=match) as e:
        parse_config({"model": {"tiny": {}}, "tensorrt": spec})
    assert e.value.field == field


# --- the graph forms ------------------------------------------------------------------------------------


def _case(kv_cache_dtype: str, dtype: str = "float32") -> dict:
    return {"quantization": None, "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "tensor_parallel": 1}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, Path]:
    """A tiny export per KV cache dtype (the aliased form, as the build's export stage writes it)."""
    out = {}
    for kv in ("float16", "int8"):
        d = tmp_path_factory.mktemp(f"g_{kv}")
        (out[kv],) = export_tiny_graphs(_case(kv), d)
    return out


def _rewritten(src: Path, tmp_path: Path, kv_pool: str, quantized_pool: str) -> tuple[Path, list[str]]:
    import shutil

    for f in src.parent.iterdir():
        shutil.copy(f, tmp_path / f.name)
    path = tmp_path / src.name
    return path, onnx_pool.apply_pool_form(path, kv_pool, quantized_pool, num_layers=2)


@pytest.mark.parametrize("kv", ["float16", "int8"])
def test_address_form_has_no_pool_tensor_and_conforms(graphs, kv, tmp_path):
    path, changed = _rewritten(graphs[kv], tmp_path, "address", "int8")
    assert changed and "by address" in changed[-1]
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    (pool,) = [i for i in g.input if i.name == onnx_pool.POOL_ADDRESS_INPUT]
    assert pool.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_value for d in pool.type.tensor_type.shape.dim] == [2]
    names = {i.name for i in g.input} | {o.name for o in g.output} | {v.name for v in g.value_info}
    assert not names & {"kv_cache", "kv_cache_out"} and [o.name for o in g.output] == ["logits"]
    nodes = [n for n in g.node if n.op_type == OP_TYPE]
    assert len(nodes) == 2
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.input[3] == onnx_pool.POOL_ADDRESS_INPUT and len(node.output) == 1
        assert attrs["kv_pool"] == b"address" and attrs["num_layers"] == 2
        assert attrs["kv_cache_dtype"] == kv.encode()  # a float pool's type named too: no tensor shows it
    violations = check_graph(path)
    assert not violations, format_violations(violations)
    onnx.checker.check_model(str(path), full_check=True)


@pytest.mark.parametrize("pool_type,elem,row", [("float16", onnx.TensorProto.FLOAT16, 9)])
def test_retyped_quantized_pool_conforms_and_runs_as_the_int8_graph(graphs, pool_type, elem, row, tmp_path):
    """The same bytes typed fp16 pairs: onnx.reference gives the int8 graph's logits and pool bytes."""
    from onnx.reference import ReferenceEvaluator

    from trtpaged.builder.onnx_reference import TrtpagedPagedAttention
    from trtpaged.builder.probe import standard_probe

    path, changed = _rewritten(graphs["int8"], tmp_path, "aliased", pool_type)
    assert changed == [f"quantized pool bytes typed {pool_type}"]
    model = onnx.load(str(path), load_external_data=False)
    pool_in = next(i for i in model.graph.input if i.name == "kv_cache")
    dims = [d.dim_value for d in pool_in.type.tensor_type.shape.dim]
    assert pool_in.type.tensor_type.elem_type == elem and dims[-1] == row  # head_dim 16 + 2 bytes
    violations = check_graph(path)
    assert not violations, format_violations(violations)
    onnx.checker.check_model(str(path), full_check=True)

    _, steps, num_kv_blocks = standard_probe(320, 16)
    typed = {"float16": np.float16}[pool_type]
    runs = {}
    for name, p, dtype, last in (("int8", graphs["int8"], np.int8, 18), (pool_type, path, typed, row)):
        session = ReferenceEvaluator(str(p), new_ops=[TrtpagedPagedAttention])
        pool = np.zeros([num_kv_blocks, *dims[1:-1], last], dtype=dtype)
        logits = []
        for step in steps:
            feeds = {n: t.numpy() for n, t in step.inputs.items()}
            feeds["kv_cache"] = pool
            out, pool = session.run(None, {n: feeds[n] for n in session.input_names})
            logits.append(out)
        runs[name] = (logits, pool.view(np.int8))
    assert runs[pool_type][1].dtype == np.int8 and np.array_equal(runs[pool_type][1], runs["int8"][1])
    assert np.abs(runs["int8"][1]).sum() > 0  # the cache was written
    for a, b in zip(runs[pool_type][0], runs["int8"][0]):
        assert np.array_equal(a, b)


def test_a_quantized_pool_typed_uint8_breaks_the_plugin_output_rule(graphs, tmp_path):
    """uint8 was a quantized_pool form; the aliased pool is also the plugin's output kv_cache_out, which TensorRT's
    header forbids as kUINT8 (getOutputDataTypes). A graph typed so is refused, naming the rule."""
    model = onnx.load(str(graphs["int8"]), load_external_data=False)
    names = onnx_pool._pool_values(model.graph)
    for info in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        if info.name in names:
            info.type.tensor_type.elem_type = onnx.TensorProto.UINT8
    path = tmp_path / "uint8.onnx"
    onnx.save(model, str(path))
    violations = check_graph(path)
    assert violations and {v.rule for v in violations} == {"plugin-pool-io"}, format_violations(violations)
    assert "kv_cache is UINT8" in str(violations[0])


def test_defaults_leave_the_graph_alone_and_float_pools_are_not_retyped(graphs, tmp_path):
    path, changed = _rewritten(graphs["float16"], tmp_path, "aliased", "float16")
    assert changed == []  # the form is for a quantized pool's bytes; a float16 pool keeps its type
    assert onnx_pool.apply_pool_form(path, "aliased", "int8", 2) == []


def test_rules_refuse_pool_io_the_plugin_does_not_take(graphs, tmp_path):
    path, _ = _rewritten(graphs["float16"], tmp_path, "address", "int8")
    model = onnx.load(str(path), load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == OP_TYPE)
    node.output.append("extra_pool_out")  # an address node with a second (pool) output
    assert {v.rule for v in check_graph(model)} == {"plugin-pool-io"}
    aliased = onnx.load(str(graphs["int8"]), load_external_data=False)
    next(i for i in aliased.graph.input if i.name == "kv_cache").type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    assert "plugin-pool-io" in {v.rule for v in check_graph(aliased)}  # a quantized pool typed fp32


# --- the runner's bindings ---------------------------------------------------------------------------------


class RecordingContext:
    def __init__(self) -> None:
        self.log: list = []
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple] = {}

    def set_input_shape(self, name, shape):
        self.log.append(("set_input_shape", name, tuple(shape)))
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return (self.shapes["logits_index"][0], 11)

    def set_tensor_address(self, name, address):
        self.log.append(("set_tensor_address", name))
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream):
        self.log.append(("execute_async_v3", stream))
        return True


class FakeCudaEngine:
    """The ICudaEngine calls TensorRTRunner makes, over a fixed tensor list (recording the context it makes)."""

    def __init__(self, names: list[str], pool_dtype: str = "f16", pool_block: tuple = (2, 2, 2, 16, 16)) -> None:
        self.names, self.pool_dtype, self.pool_block = names, pool_dtype, pool_block
        self.context = RecordingContext()

    @property
    def num_io_tensors(self):
        return len(self.names)

    def get_tensor_name(self, i):
        return self.names[i]

    def create_execution_context(self):
        return self.context

    def get_tensor_profile_shape(self, name, profile):
        assert name == "kv_cache", "the pool's profile is asked only of an aliased pool"
        return [(1, *self.pool_block), (64, *self.pool_block), (64, *self.pool_block)]

    def get_tensor_dtype(self, name):
        return {"kv_cache": self.pool_dtype, "logits": "f32"}[name]

    def get_tensor_shape(self, name):
        return (-1, 11)


STEP = ["input_ids", "positions", "query_start", "context_lens", "block_tables", "logits_index"]


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """A `tensorrt` module whose Runtime deserializes to the FakeCudaEngine set on it; CUDA entry is a no-op."""
    import contextlib

    from trtpaged import kernels, tensorrt_env

    trt = types.SimpleNamespace(__version__="10.16.0", float32="f32", float16="f16", bfloat16="bf16", int32="i32",
                                int8="i8", int64="i64", engine=None)
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level=None: None})

    class Runtime:
        def __init__(self, logger):
            pass

        def get_plugin_registry(self):
            return None

        def deserialize_cuda_engine(self, data):
            return trt.engine

    trt.Runtime = Runtime
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(tensorrt_env, "load_plugin_library", lambda registry, version, path=None: Path("lib.so"))
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: types.SimpleNamespace(cuda_stream=77))
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(kernels, "has_cuda", lambda: True)
    return trt


def _step(runner):
    from trtpaged.runtime.runners.base import StepBatch

    i32 = torch.int32
    batch = StepBatch(input_ids=torch.tensor([5, 6, 7], dtype=i32), positions=torch.tensor([0, 1, 2], dtype=i32),
                      query_start=torch.tensor([0, 3], dtype=i32), context_lens=torch.tensor([3], dtype=i32),
                      block_tables=torch.tensor([[2]], dtype=i32), logits_index=torch.tensor([2], dtype=i32))
    return runner._run({n: getattr(batch, n) for n in STEP})


def test_address_engine_binds_the_pinned_pool_address_and_no_pool_tensor(fake_tensorrt, tmp_path, monkeypatch):
    from trtpaged.runtime.runners import tensorrt_runner as mod

    engine = FakeCudaEngine([*STEP, mod.POOL_ADDRESS_INPUT, "logits"])
    monkeypatch.setattr(torch, "zeros", _cpu(torch.zeros))
    monkeypatch.setattr(torch, "tensor", _cpu(torch.tensor, pinned=True))
    monkeypatch.setattr(torch, "empty", _cpu(torch.empty))
    runner = _construct(fake_tensorrt, engine, tmp_path, pool_layout=((2, 2, 2, 16, 18), torch.int8))
    assert torch.tensor.pinned  # the address tensor is asked for in pinned host memory on a CUDA device
    assert runner.kv_cache.shape == (40, 2, 2, 2, 16, 18) and runner.kv_cache.dtype == torch.int8
    assert runner._pool_address.tolist() == [runner.kv_cache.data_ptr(), 40]
    _step(runner)
    ctx = engine.context
    assert ctx.addresses[mod.POOL_ADDRESS_INPUT] == runner._pool_address.data_ptr()
    assert ("set_input_shape", mod.POOL_ADDRESS_INPUT, (2,)) in ctx.log
    assert not {"kv_cache", "kv_cache_out"} & set(ctx.addresses)
    assert set(ctx.addresses) == {*STEP, mod.POOL_ADDRESS_INPUT, "logits"}
    assert ctx.log[-1] == ("execute_async_v3", 77)


def test_address_engine_needs_the_pool_layout(fake_tensorrt, tmp_path, monkeypatch):
    from trtpaged.runtime.runners import tensorrt_runner as mod

    engine = FakeCudaEngine([*STEP, mod.POOL_ADDRESS_INPUT, "logits"])
    with pytest.raises(ValueError, match="by address .*layout must be given"):
        _construct(fake_tensorrt, engine, tmp_path, pool_layout=None)


@pytest.mark.parametrize("dtype,torch_dtype", [("f16", torch.float16), ("i8", torch.int8)])
def test_aliased_engine_allocates_the_pool_in_the_type_it_declares(fake_tensorrt, tmp_path, monkeypatch,
                                                                  dtype, torch_dtype):
    from trtpaged.runtime.runners import tensorrt_runner as mod

    block = (2, 2, 2, 16, 9 if dtype == "f16" else 18)
    engine = FakeCudaEngine([*STEP, mod.POOL_INPUT, mod.POOL_OUTPUT, "logits"], dtype, block)
    monkeypatch.setattr(torch, "zeros", _cpu(torch.zeros))
    monkeypatch.setattr(torch, "empty", _cpu(torch.empty))
    runner = _construct(fake_tensorrt, engine, tmp_path)
    assert runner.kv_cache.dtype == torch_dtype and runner.kv_cache.shape == (40, *block)
    assert runner._pool_address is None
    _step(runner)
    ctx = engine.context
    assert ctx.addresses[mod.POOL_INPUT] == ctx.addresses[mod.POOL_OUTPUT] == runner.kv_cache.data_ptr()
    assert mod.POOL_ADDRESS_INPUT not in ctx.addresses


def test_pool_block_layout_follows_the_manifest():
    from trtpaged.manifest import Limits, ModelDims
    from trtpaged.runtime.runners.tensorrt_runner import pool_block_layout

    dims = ModelDims(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=128,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)
    limits = Limits(max_batch_size=8, max_num_tokens=64, max_seq_len=512, block_size=32)
    for kv, want in (("int8", ((3, 2, 2, 32, 18), torch.int8)), ("fp8_e4m3", ((3, 2, 2, 32, 18), torch.int8)),
                     ("bfloat16", ((3, 2, 2, 32, 16), torch.bfloat16))):
        manifest = types.SimpleNamespace(dims=dims, kv_cache_dtype=kv, limits=limits)
        assert pool_block_layout(manifest) == want


def _cpu(fn, pinned: bool = False):
    """torch.zeros/empty/tensor with the device (and pin_memory, which needs CUDA) dropped: the fake runs on CPU."""
    def call(*args, **kwargs):
        kwargs.pop("device", None)
        if kwargs.pop("pin_memory", False) and pinned:
            call.pinned = True
        return fn(*args, **kwargs)

    call.pinned = False
    return call


class _CudaNamedDevice:
    """Stands in for torch.device("cuda") while the runner is made: it checks the type, memory stays on the CPU."""

    def __init__(self, spec):
        self.type = "cuda"

    def __str__(self):
        return "cuda"


def _construct(trt, engine, tmp_path, pool_layout=None):
    from trtpaged.runtime.runners import tensorrt_runner as mod

    trt.engine = engine
    plan = tmp_path / "engine.plan"
    plan.write_bytes(b"plan")
    runner = mod.TensorRTRunner.__new__(mod.TensorRTRunner)
    original = torch.device
    try:
        torch.device = _CudaNamedDevice  # the runner checks device.type == "cuda"; memory stays on the CPU
        runner.__init__(plan, num_kv_blocks=40, device="cuda", pool_layout=pool_layout)
    finally:
        torch.device = original
    runner.device = torch.device("cpu")
    return runner
