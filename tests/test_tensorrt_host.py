"""Host-side logic of the TensorRT path, on CPU without TensorRT.

The backend's binding code runs against a fake execution context that records
calls and enforces an optimization profile as TensorRT does; the version,
plugin-major and head_dim checks run on real files (a fake plugin library is a
file holding the tag the real one embeds). The CUDA launch decision is compiled
from plugins/src/cuda/paged_args.h with the host C++ compiler.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from trtpaged import tensorrt_env as trt_env
from trtpaged.builder import compile as trt_compile
from trtpaged.tensorrt_env import CompileError
from trtpaged.runtime.runners.base import StepBatch
from trtpaged.runtime.runners.tensorrt_runner import LOGITS, POOL_INPUT, POOL_OUTPUT, TensorRTRunner

REPO = Path(__file__).resolve().parent.parent
VOCAB = 11


# --- the backend's binding code against a fake execution context ---------------------------------


class FakeContext:
    """Records set_input_shape / set_tensor_address / execute_async_v3 like an IExecutionContext,
    refusing shapes outside a (min, max) profile of num_outputs >= 1 as TensorRT's profile does."""

    def __init__(self, log: list, refuse_address: str | None = None) -> None:
        self.log = log
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.refuse_address = refuse_address

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.log.append(("set_input_shape", name, shape))
        if name == "logits_index" and shape[0] < 1:  # the profile's minimum (ShapeProfile.num_outputs)
            return False
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        assert name == LOGITS
        return (self.shapes["logits_index"][0], VOCAB)

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.log.append(("set_tensor_address", name))
        if name == self.refuse_address:
            return False
        self.addresses[name] = address
        return True

    def execute_async_v3(self, stream: int) -> bool:
        self.log.append(("execute_async_v3", stream))
        return True


class FakeEngine:
    def get_tensor_profile_shape(self, name: str, profile: int):
        return [(1,), (4,), (64,)]


@pytest.fixture
def backend(monkeypatch):
    """A TensorRTRunner whose TensorRT objects are fakes; device entry and the stream are recorded."""
    log: list = []

    @contextlib.contextmanager
    def device(dev):
        log.append(("enter_device", str(dev)))
        yield
        log.append(("exit_device", str(dev)))

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: types.SimpleNamespace(cuda_stream=1234))
    engine = TensorRTRunner.__new__(TensorRTRunner)
    engine.device = torch.device("cpu")
    engine._context = FakeContext(log)
    engine._engine = FakeEngine()
    engine._logits_dtype = torch.float32
    engine.vocab_size = VOCAB
    engine.kv_cache = torch.zeros(6, 2, 2, 1, 8, 16)
    return engine, log


def _batch(logits_index: list[int]) -> StepBatch:
    i32 = torch.int32
    return StepBatch(
        input_ids=torch.tensor([5, 6, 7], dtype=i32), positions=torch.tensor([0, 1, 2], dtype=i32),
        query_start=torch.tensor([0, 3], dtype=i32), context_lens=torch.tensor([3], dtype=i32),
        block_tables=torch.tensor([[2]], dtype=i32), logits_index=torch.tensor(logits_index, dtype=i32),
    )


def test_step_without_logits_rows_runs_and_returns_none(backend):
    engine, log = backend
    out = engine.step(_batch([]))  # a prompt chunk cut by the token budget: nobody samples
    assert out.shape == (0, VOCAB) and out.dtype == torch.float32
    assert ("set_input_shape", "logits_index", (1,)) in log
    assert ("execute_async_v3", 1234) in log


def test_step_binds_every_tensor_inside_the_device_with_the_pool_aliased(backend):
    engine, log = backend
    out = engine.step(_batch([2]))
    assert out.shape == (1, VOCAB)
    ctx = engine._context
    expected = {"input_ids", "positions", "query_start", "context_lens", "block_tables", "logits_index",
                POOL_INPUT, POOL_OUTPUT, LOGITS}
    assert set(ctx.addresses) == expected
    assert ctx.addresses[POOL_INPUT] == ctx.addresses[POOL_OUTPUT] == engine.kv_cache.data_ptr()
    entered = log.index(("enter_device", "cpu"))
    exited = log.index(("exit_device", "cpu"))
    calls = [i for i, entry in enumerate(log)
             if entry[0] in ("set_input_shape", "set_tensor_address", "execute_async_v3")]
    assert calls and all(entered < i < exited for i in calls)


def test_a_refused_tensor_address_is_an_error_naming_the_tensor(backend):
    engine, log = backend
    engine._context.refuse_address = "block_tables"
    with pytest.raises(RuntimeError, match="address of block_tables"):
        engine.step(_batch([2]))
    assert not any(entry[0] == "execute_async_v3" for entry in log)


def test_an_out_of_profile_shape_is_an_error_naming_the_input(backend):
    engine, _ = backend
    engine._context.set_input_shape = lambda name, shape: name != "positions"
    with pytest.raises(ValueError, match="positions: shape"):
        engine.step(_batch([2]))


# --- TensorRT version, plugin library major, engine dir record -----------------------------------


def _fake_plugin(tmp_path: Path, major: int, name: str = "libtrtpaged_trt_plugin_trt10.so") -> Path:
    lib = tmp_path / name
    lib.write_bytes(b"\x7fELF...\0trtpaged-plugin-tensorrt-major=" + str(major).encode() + b";\0...")
    return lib


class FakeRegistry:
    def __init__(self, loads: bool, creator_registered: bool) -> None:
        self.loads, self.creator_registered, self.loaded = loads, creator_registered, []

    def load_library(self, path: str):
        self.loaded.append(path)
        return object() if self.loads else None

    def get_creator(self, name: str, version: str, namespace: str):
        assert (name, version, namespace) == ("TrtpagedPagedAttention", "1", "trtpaged")
        return object() if self.creator_registered else None


@pytest.fixture
def fresh_registry_state(monkeypatch):
    monkeypatch.setattr(trt_env, "_loaded_library", None)


def test_plugin_library_for_another_major_is_refused_in_one_line(tmp_path, fresh_registry_state):
    lib = _fake_plugin(tmp_path, 11)
    with pytest.raises(CompileError) as e:
        trt_env.load_plugin_library(FakeRegistry(True, False), "10.16.0", lib)
    assert "built for TensorRT 11" in str(e.value) and "TensorRT 10.16.0 is installed" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_file_without_the_tag_is_not_a_plugin_library(tmp_path, fresh_registry_state):
    lib = tmp_path / "libtrtpaged_trt_plugin_trt10.so"
    lib.write_bytes(b"\x7fELF nothing here")
    with pytest.raises(CompileError, match="not a trtpaged TensorRT plugin library"):
        trt_env.load_plugin_library(FakeRegistry(True, False), "10.16.0", lib)


def test_plugin_already_registered_from_another_path_is_used(tmp_path, fresh_registry_state):
    first = _fake_plugin(tmp_path, 10)
    registry = FakeRegistry(loads=False, creator_registered=True)  # TensorRT refuses a second copy
    assert trt_env.load_plugin_library(registry, "10.16.0", first) == first.resolve()
    other = _fake_plugin(tmp_path / "..", 10, "libtrtpaged_trt_plugin_trt10_copy.so")
    assert trt_env.load_plugin_library(registry, "10.16.0", other) == first.resolve()
    assert registry.loaded == [str(first.resolve())]


def test_a_library_tensorrt_cannot_load_is_an_error(tmp_path, fresh_registry_state):
    lib = _fake_plugin(tmp_path, 10)
    with pytest.raises(CompileError, match="could not load the plugin library"):
        trt_env.load_plugin_library(FakeRegistry(loads=False, creator_registered=False), "10.16.0", lib)


@pytest.mark.parametrize("version, ok", [("10.2.0.19", False), ("10.3.0", True), ("10.16.1", True), ("11.1.0", True),
                                         ("8.6.1", False)])
def test_tensorrt_before_10_3_is_refused_with_the_reason(version, ok):
    reason = trt_env.tensorrt_version_reason(version)
    assert (reason is None) == ok
    if not ok:
        assert "older than 10.3" in reason and "aliased plugin I/O" in reason


def test_backend_refuses_old_tensorrt_before_touching_its_api(monkeypatch):
    fake = types.ModuleType("tensorrt")
    fake.__version__ = "10.2.0"  # no Runtime, no PreviewFeature.ALIASED_PLUGIN_IO_10_03: would be AttributeError
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    with pytest.raises(RuntimeError, match="TensorRT 10.2.0 is older than 10.3"):
        TensorRTRunner("engine.plan", num_kv_blocks=4, device="cuda")


def test_engine_dir_records_the_full_tensorrt_version_and_sm_and_refuses_others(tmp_path):
    trt_env.write_build_info(tmp_path, "10.16.0.72", tmp_path / "libtrtpaged_trt_plugin_trt10.so", sm="sm_90")
    info = json.loads((tmp_path / "tensorrt.json").read_text())
    assert info["tensorrt_version"] == "10.16.0.72" and info["gpu_sm"] == "sm_90"
    trt_env.check_build_info(tmp_path, "10.16.0.72", sm="sm_90")  # the same TensorRT and GPU: fine
    for version, sm, words in [("11.1.0", "sm_90",
                                ("built with TensorRT 10.16.0.72", "TensorRT 11.1.0 is installed")),
                               ("10.16.1", "sm_90",
                                ("built with TensorRT 10.16.0.72", "TensorRT 10.16.1 is installed")),
                               ("10.3.1", "sm_90", ("TensorRT 10.3.1 is installed",)),
                               ("10.16.0.72", "sm_80", ("built for sm_90", "this GPU is sm_80"))]:
        with pytest.raises(CompileError) as e:
            trt_env.check_build_info(tmp_path, version, sm=sm)
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_build_info_without_the_sm_is_refused(tmp_path):
    (tmp_path / "tensorrt.json").write_text(json.dumps({"tensorrt_version": "10.16.0", "tensorrt_major": 10}))
    with pytest.raises(CompileError, match="does not record the GPU"):
        trt_env.check_build_info(tmp_path, "10.16.0", sm="sm_90")


def test_engine_dir_without_the_record_is_refused(tmp_path):
    with pytest.raises(CompileError, match="without tensorrt.json"):
        trt_env.check_build_info(tmp_path, "10.16.0")


def test_tensorrt_stubs_alone_are_not_tensorrt(tmp_path, monkeypatch):
    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.pyi").write_text("__version__: str\n")  # what tensorrt-stubs installs
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    assert importlib.util.find_spec("tensorrt") is not None  # an empty namespace package imports
    assert not trt_env.tensorrt_installed()
    assert trt_env.unavailable_reason().startswith("TensorRT is not installed")


def test_plugin_library_name_carries_the_major():
    assert trt_env.plugin_library_name(10) == "libtrtpaged_trt_plugin_trt10.so"
    assert trt_env.plugin_library_name(11) == "libtrtpaged_trt_plugin_trt11.so"


# --- head_dim at build ---------------------------------------------------------------------------


def _attention_onnx(path: Path, head_dim: int, kv_cache_dtype: str | None = None) -> Path:
    import onnx
    from onnx import TensorProto, helper

    from trtpaged.builder.onnx_node import DOMAIN, OP_TYPE

    node = helper.make_node(OP_TYPE, ["q", "k", "v", "kv_cache", "positions", "query_start", "context_lens",
                                      "block_tables"], ["out", "kv_cache_out"], domain=DOMAIN, num_heads=2,
                            num_kv_heads=1, head_dim=head_dim, block_size=16, layer=0, scale=0.125,
                            **({"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype is not None else {}))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.input]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in node.output]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    onnx.save(model, str(path))
    return path


def test_compile_rejects_a_head_dim_without_cuda_kernels_naming_model_and_set(tmp_path):
    onnx_path = _attention_onnx(tmp_path / "model.onnx", head_dim=32)  # the CPU kernel runs it; CUDA has no kernel
    with pytest.raises(CompileError) as e:
        trt_compile.compile_engine(onnx_path, tmp_path / "engine.plan", profile=None, model="tiny-llama")
    msg = str(e.value)
    assert msg.startswith("tiny-llama: head_dim 32 has no CUDA kernel") and "64, 80, 96, 128" in msg
    assert "backend: torch" in msg


def test_head_dim_check_passes_supported_sizes(tmp_path):
    for head_dim in (64, 80, 96, 128):
        trt_compile.check_head_dims(_attention_onnx(tmp_path / f"m{head_dim}.onnx", head_dim))


def test_compile_takes_quantized_caches_and_refuses_a_kv_cache_dtype_without_kernels(tmp_path):
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3", None):  # None: a graph from before the attribute
        trt_compile.check_kv_cache_dtypes(_attention_onnx(tmp_path / f"m_{kv_cache_dtype}.onnx", 64, kv_cache_dtype))
    onnx_path = _attention_onnx(tmp_path / "int4.onnx", 64, "int4")
    with pytest.raises(CompileError) as e:
        trt_compile.compile_engine(onnx_path, tmp_path / "engine.plan", profile=None, model="tiny-llama")
    msg = str(e.value)
    assert msg.startswith("tiny-llama: kv_cache_dtype int4 with backend tensorrt") and "backend: torch" in msg
    assert "int8, fp8_e4m3" in msg


def test_python_and_the_plugin_agree_on_the_kv_cache_dtypes():
    # compile.py's list against the CUDA dispatch (with_kv_cache_dtype) and the plugin's kv_cache_dtype field spellings
    dispatch = (REPO / "plugins/src/cuda/dispatch.h").read_text()
    fields = (REPO / "plugins/src/tensorrt/fields.cpp").read_text()
    assert "case TRTPAGED_INT8:" in dispatch and "case TRTPAGED_FP8_E4M3:" in dispatch
    named = fields[fields.index("kv_format_name(KvFormat"):fields.index("bool kv_format_quantized")]
    spelled = set(re.findall(r'return "(\w+)";', named))
    assert spelled == {"auto", "int8", "fp8_e4m3", "float32", "float16", "bfloat16"}  # floats: kv_pool address
    assert set(trt_compile.TENSORRT_KV_CACHE_DTYPES) == spelled - {"auto"}


def test_tensorrt_runner_binds_an_int8_pool():
    from trtpaged.runtime.runners.tensorrt_runner import _torch_dtype

    fake = types.SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16", int32="i32", int8="i8", uint8="u8",
                                 int64="i64")
    assert _torch_dtype(fake, "i8") == torch.int8  # a quantized pool's bytes
    with pytest.raises(ValueError, match="not one trtpaged binds"):
        _torch_dtype(fake, "fp8")


def test_python_and_cuda_agree_on_the_head_dims():
    from trtpaged.models.dims import CUDA_HEAD_DIMS

    header = (REPO / "plugins/src/cuda/head_dims.h").read_text()
    listed = re.search(r"kHeadDims\[\] = \{([^}]*)\}", header).group(1)
    assert tuple(int(x) for x in listed.split(",")) == CUDA_HEAD_DIMS
    dispatched = re.findall(r"case (\d+):", (REPO / "plugins/src/cuda/dispatch.h").read_text())
    assert tuple(sorted(int(x) for x in dispatched)) == CUDA_HEAD_DIMS


# --- the profile is made from the one table of step inputs ---------------------------------------


def test_profile_and_export_axes_come_from_one_table():
    from trtpaged.builder.export import dynamic_shapes
    from trtpaged.step_io import INPUT_NAMES

    profile = trt_compile.ShapeProfile(num_tokens=(1, 4, 64), num_seqs=(1, 4, 8), max_blocks_per_seq=(1, 5, 5),
                                       num_outputs=(1, 4, 64), num_kv_blocks=(1, 40, 40))
    assert profile.shapes("query_start", (-1,)) == ((2,), (5,), (9,))
    assert profile.shapes("block_tables", (-1, -1)) == ((1, 1), (4, 5), (8, 5))
    assert profile.shapes("kv_cache", (-1, 2, 2, 1, 16, 64)) == ((1, 2, 2, 1, 16, 64), (40, 2, 2, 1, 16, 64),
                                                                  (40, 2, 2, 1, 16, 64))
    assert tuple(dynamic_shapes()) == INPUT_NAMES
    with pytest.raises(CompileError, match="without a profile range"):
        profile.shapes("logits", (-1, 11))


# --- which CUDA kernels a call launches (host code of plugins/src/cuda) --------------------------

_LAUNCH_PARTS_PROGRAM = r"""
#include <cstdio>
#include "cuda/paged_args.h"
int main() {
  int cases[][2] = {{0, 0}, {8, 8}, {1, 1}, {54, 1}, {2, 1}, {40, 3}, {9, 8}};  // {num_tokens, num_seqs}
  for (auto& c : cases) {
    trtpaged_attention_params p{};
    p.num_tokens = c[0];
    p.num_seqs = c[1];
    trtpaged::cuda::LaunchParts parts = trtpaged::cuda::launch_parts(p);
    std::printf("%d %d %d %d\n", c[0], c[1], parts.decode ? 1 : 0, parts.prefill ? 1 : 0);
  }
}
"""


def test_decode_and_prefill_kernels_launch_only_for_their_part(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (tmp_path / "t.cpp").write_text(_LAUNCH_PARTS_PROGRAM)
    exe = tmp_path / "t"
    subprocess.run([cxx, "-std=c++17", f"-I{REPO / 'plugins/src'}", f"-I{REPO / 'plugins/include'}",
                    str(tmp_path / "t.cpp"), "-o", str(exe)], check=True, capture_output=True)
    rows = {tuple(map(int, line.split()[:2])): tuple(map(int, line.split()[2:]))
            for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()}
    assert rows[(0, 0)] == (0, 0)    # nothing to do
    assert rows[(8, 8)] == (1, 0)    # decode-only: no prefill CTAs
    assert rows[(1, 1)] == (1, 0)
    assert rows[(54, 1)] == (0, 1)   # one prompt chunk: no decode CTAs
    assert rows[(2, 1)] == (0, 1)
    assert rows[(40, 3)] == (1, 1)   # mixed: both may have work
    assert rows[(9, 8)] == (1, 1)


# --- mypy with tensorrt-stubs ----------------------------------------------------------------------


def _tensorrt_stubs() -> Path | None:
    """A dir holding tensorrt/__init__.pyi: $TRTPAGED_TENSORRT_STUBS, or where pip installed tensorrt-stubs."""
    env = os.environ.get("TRTPAGED_TENSORRT_STUBS")
    if env:
        return Path(env)
    return next((Path(p) for p in sys.path if p and (Path(p) / "tensorrt" / "__init__.pyi").is_file()), None)


def test_mypy_is_clean_on_the_tensorrt_modules():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy)")
    stubs = _tensorrt_stubs()
    if stubs is None:
        pytest.skip("tensorrt-stubs not found (pip install --no-deps --target DIR tensorrt-stubs; "
                    "TRTPAGED_TENSORRT_STUBS=DIR)")
    files = ["trtpaged/builder/compile.py", "trtpaged/tensorrt_env.py", "trtpaged/runtime/runners/tensorrt_runner.py"]
    r = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                        "--no-incremental", "--python-version", "3.11", *files], cwd=REPO, capture_output=True,
                       text=True, env={**os.environ, "MYPYPATH": str(stubs)})
    if "errors prevented further checking" in r.stdout:
        first = next(line for line in r.stdout.splitlines() if "error" in line)
        pytest.skip(f"the tensorrt stubs in {stubs} do not parse, so mypy checks nothing: {first}")
    # the stubs have errors of their own
    ours = [line for line in r.stdout.splitlines() if line.startswith("trtpaged/")]
    assert not ours, "\n".join(ours)
