"""`backend: auto` on a fake "TensorRT present" machine: the TensorRT engine where it compiles, else the torch
engine with one warning naming the reason; `backend: tensorrt` fails with the reason and leaves nothing.

The fake is at the seam the build uses: `tensorrt_env.unavailable_reason` (TensorRT, GPU and plugin present)
and `builder.compile.compile_engine` (writes a plan, or raises CompileError as TensorRT's parser would).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


def _tiny(backend: str, **extra) -> dict:
    data = yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "tiny.yaml").read_text())
    data.pop("output")
    return {**data, "backend": backend, **extra}


@pytest.fixture
def tensorrt_present(monkeypatch):
    """TensorRT, a GPU and the plugin 'present'; returns the list of compile calls (a fake compile writes a plan)."""
    from trtpaged import tensorrt_env
    from trtpaged.builder import compile as trt_compile

    calls: list = []
    monkeypatch.setattr(tensorrt_env, "unavailable_reason", lambda: None)

    def fake_compile(onnx_path, plan_path, profile, *, echo=print, plugin_library=None, model=None):
        calls.append(onnx_path)
        plan_path.write_bytes(b"plan")
        (plan_path.parent / tensorrt_env.BUILD_INFO_FILE).write_text("{}")
        if getattr(fake_compile, "error", None):
            raise tensorrt_env.CompileError(fake_compile.error)
        return plan_path

    monkeypatch.setattr(trt_compile, "compile_engine", fake_compile)
    return fake_compile, calls


def _build(data: dict, out, lines: list[str]):
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config

    return build_engine(parse_config(data), out, skip_verify=True, echo=lines.append)


def test_auto_builds_the_tensorrt_runner_where_it_compiles(tensorrt_present, tmp_path):
    fake, calls = tensorrt_present
    lines: list[str] = []
    result = _build(_tiny("auto"), tmp_path / "eng", lines)
    assert len(calls) == 1 and result.manifest.backends == ["torch", "tensorrt"]
    assert (tmp_path / "eng" / "engine.plan").is_file()
    assert not [line for line in lines if line.startswith("warning:")]


def test_auto_falls_back_to_torch_with_one_warning_naming_the_reason(tensorrt_present, tmp_path):
    fake, calls = tensorrt_present
    fake.error = "TensorRT could not parse model.onnx: node dq: INT8 input with a rank-2 scale"
    lines: list[str] = []
    result = _build(_tiny("auto"), tmp_path / "eng", lines)
    assert len(calls) == 1 and result.manifest.backends == ["torch"] and result.manifest.plan_file is None
    assert not (tmp_path / "eng" / "engine.plan").exists() and not (tmp_path / "eng" / "tensorrt.json").exists()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "backend auto" in warnings[0] and "rank-2 scale" in warnings[0]


def test_auto_skips_a_kv_cache_dtype_tensorrt_lacks_with_one_warning(tensorrt_present, tmp_path, monkeypatch):
    from trtpaged.builder import compile as trt_compile

    fake, calls = tensorrt_present
    monkeypatch.setattr(trt_compile, "TENSORRT_KV_CACHE_DTYPES", ("float16",))  # as if float32 had no CUDA kernel
    lines: list[str] = []
    result = _build(_tiny("auto"), tmp_path / "eng", lines)
    assert calls == [] and result.manifest.backends == ["torch"]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "kv_cache_dtype float32" in warnings[0]


def test_backend_tensorrt_fails_with_the_reason_and_leaves_nothing(tensorrt_present, tmp_path):
    from trtpaged.builder.pipeline import BuildError

    fake, _ = tensorrt_present
    fake.error = "TensorRT could not parse model.onnx: UINT4 initializer"
    with pytest.raises(BuildError, match="compile: TensorRT could not parse model.onnx: UINT4 initializer"):
        _build(_tiny("tensorrt"), tmp_path / "eng", [])
    assert not (tmp_path / "eng").exists()


INT8_GROUP32 = {"quantization": {"weights": "int8", "group_size": 32, "lm_head": "int8"}}


def _build_verified(data: dict, out, lines: list[str]):
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config

    return build_engine(parse_config(data), out, echo=lines.append)


def test_auto_compiles_a_requantized_graph_whose_accuracy_holds(tensorrt_present, tmp_path):
    fake, calls = tensorrt_present
    lines: list[str] = []
    result = _build_verified(_tiny("auto", **INT8_GROUP32), tmp_path / "eng", lines)
    assert len(calls) == 1 and "tensorrt" in result.manifest.backends
    graph = result.manifest.verification["accuracy"]["tensorrt_graph"]
    assert graph["agreement_away_from_ties"] >= 0.95
    assert any("TensorRT graph: layers.0.self_attn.qkv_proj: int8 group 32 -> int8 per channel" in l for l in lines)
    assert not [line for line in lines if line.startswith("warning:")]
    # the compile stage runs here, so the TensorRT graph (tensorrt.graph: auto) is written
    assert result.manifest.tensorrt["graph_written"] and (tmp_path / "eng" / "model-tensorrt.safetensors").is_file()


def test_auto_writes_no_tensorrt_graph_where_compile_will_not_run(tensorrt_present, tmp_path, monkeypatch):
    """TensorRT present, but the kv_cache_dtype has no TensorRT kernel: no compile, so no graph file either."""
    from trtpaged.builder import compile as trt_compile

    fake, calls = tensorrt_present
    monkeypatch.setattr(trt_compile, "TENSORRT_KV_CACHE_DTYPES", ("float16",))
    lines: list[str] = []
    result = _build_verified(_tiny("auto", **INT8_GROUP32), tmp_path / "eng", lines)
    assert calls == [] and result.manifest.backends == ["torch"] and not result.manifest.tensorrt["graph_written"]
    assert not (tmp_path / "eng" / "model-tensorrt.safetensors").exists()
    assert "tensorrt_graph" not in result.manifest.verification["accuracy"]
    assert len([line for line in lines if line.startswith("warning:")]) == 1


def test_a_graph_too_inaccurate_is_not_compiled_by_auto_and_fails_tensorrt(tensorrt_present, tmp_path, monkeypatch):
    from trtpaged.builder import pipeline

    fake, calls = tensorrt_present
    monkeypatch.setattr(pipeline, "graph_accuracy_reason",
                        lambda result, scheme: f"top-1 {result.agreement:.1%} (test)")
    lines: list[str] = []
    result = _build_verified(_tiny("auto", **INT8_GROUP32), tmp_path / "auto", lines)
    assert calls == [] and result.manifest.backends == ["torch"]
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "(test)" in warnings[0]
    with pytest.raises(pipeline.BuildError, match=r"accuracy: top-1 .*\(test\)"):
        _build_verified(_tiny("tensorrt", **INT8_GROUP32), tmp_path / "trt", [])
    assert not (tmp_path / "trt").exists()


def test_graph_accuracy_reason_names_the_figures_and_the_bound():
    from trtpaged.builder.accuracy import PathAccuracy, graph_accuracy_reason

    assert graph_accuracy_reason(PathAccuracy(1.0, 0.9, 0.85, 140), "int4") is None
    reason = graph_accuracy_reason(PathAccuracy(14.6, 0.736, 0.741, 140), "int4")
    assert "74.1% of 140 positions" in reason and "needs 80%" in reason and "14.6" in reason


@pytest.mark.parametrize("kv_pool,kv_cache_dtype,quantized_pool", [("address", "float32", "int8"),
                                                             ("aliased", "int8", "float16")])
def test_the_pool_form_named_in_model_yaml_is_what_compile_gets_and_the_manifest_records(
        tensorrt_present, tmp_path, kv_pool, kv_cache_dtype, quantized_pool):
    """tensorrt.kv_pool / quantized_pool reach the graph TensorRT compiles (after verification of the aliased
    export) and the manifest."""
    import onnx

    from trtpaged.builder.tensorrt_rules import check_graph

    fake, calls = tensorrt_present
    data = _tiny("auto", kv_cache_dtype=kv_cache_dtype, tensorrt={"kv_pool": kv_pool, "quantized_pool": quantized_pool})
    lines: list[str] = []
    result = _build_verified(data, tmp_path / "eng", lines)
    assert len(calls) == 1 and result.manifest.verification["max_abs_diff"] <= result.manifest.verification["tolerance"]
    assert {k: result.manifest.tensorrt[k] for k in ("kv_pool", "quantized_pool")} == \
        {"kv_pool": kv_pool, "quantized_pool": quantized_pool}
    graph = onnx.load(str(tmp_path / "eng" / "model.onnx"), load_external_data=False).graph
    inputs = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    if kv_pool == "address":
        assert inputs["kv_cache_pool"] == onnx.TensorProto.INT64 and "kv_cache" not in inputs
    else:
        assert inputs["kv_cache"] == onnx.TensorProto.FLOAT16
    assert check_graph(tmp_path / "eng" / "model.onnx") == []
