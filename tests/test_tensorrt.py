"""The TensorRT plugin library and backend.

- The plugin library builds against TensorRT's headers alone (TENSORRT_ROOT, no
  libnvinfer) and exports only TensorRT's plugin-library entry points.
- Marked `tensorrt`: a tiny engine compiled to engine.plan gives the torch
  backend's logits over the two-step probe (prefill chunks, a continuing chunk,
  a decode) on scattered blocks. Skipped without TensorRT, a GPU or the plugin.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from conftest import save_manifest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ENTRY_POINTS = {"getCreators", "setLoggerFinder"}


# --- the plugin library (headers only) -----------------------------------------------------------


def _tensorrt_root_reason() -> str | None:
    root = os.environ.get("TENSORRT_ROOT")
    if not root:
        return "TENSORRT_ROOT is not set (a dir with include/NvInfer.h, e.g. TensorRT's public headers)"
    if not (Path(root) / "include" / "NvInfer.h").is_file():
        return f"TENSORRT_ROOT={root} has no include/NvInfer.h"
    for tool in ("cmake", "nvcc", "nm"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


def _header_major(root: Path) -> int:
    text = (root / "include" / "NvInferVersion.h").read_text()
    match = (re.search(r"#define TRT_MAJOR_ENTERPRISE (\d+)", text)
             or re.search(r"#define NV_TENSORRT_MAJOR (\d+)", text))
    assert match, "no major version in NvInferVersion.h"
    return int(match.group(1))


@pytest.fixture(scope="module")
def plugin_build(tmp_path_factory) -> tuple[Path, int]:
    """(build dir, TensorRT major of the headers) of the plugin target built from this checkout."""
    why_not = _tensorrt_root_reason()
    if why_not:
        pytest.skip(why_not)
    build = tmp_path_factory.mktemp("build_trt")
    root = Path(os.environ["TENSORRT_ROOT"])
    configure = ["cmake", "-S", str(REPO), "-B", str(build), "-DTRTPAGED_CUDA=ON", f"-DTENSORRT_ROOT={root}",
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                 f"-DTRTPAGED_CUDA_ARCHS={os.environ.get('TRTPAGED_CUDA_ARCHS', '80;90')}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "trtpaged_trt_plugin", "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return build, _header_major(root)


@pytest.fixture(scope="module")
def plugin_library(plugin_build) -> Path:
    from trtpaged.tensorrt_env import plugin_library_name

    build, major = plugin_build
    lib = build / plugin_library_name(major)
    assert lib.is_file(), f"{lib} was not built"
    return lib


def test_plugin_library_records_the_tensorrt_major_it_was_built_for(plugin_build, plugin_library):
    from trtpaged.tensorrt_env import plugin_library_major

    assert plugin_library_major(plugin_library) == plugin_build[1]


def test_plugin_glue_host_checks(plugin_build):
    """head_dim refused at createPlugin, workspace recorded and serialized, enqueue checks it (no GPU needed)."""
    build, _ = plugin_build
    r = subprocess.run(["cmake", "--build", str(build), "--target", "trtpaged_trt_plugin_host_test", "-j2"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    run = subprocess.run([str(build / "trtpaged_trt_plugin_host_test")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "head_dim: 32 has no CUDA kernel (supported: 64, 80, 96, 128)" in run.stderr
    assert "this step needs" in run.stderr and "TensorRT reserved 64" in run.stderr


def test_code_linked_into_the_plugin_is_built_portably(plugin_build):
    build, _ = plugin_build
    commands = json.loads((build / "compile_commands.json").read_text())
    objects = [(c["command"].split(" -o ")[1].split()[0], c["command"]) for c in commands]
    linked = [(o, cmd) for o, cmd in objects if "trtpaged_kernels_static.dir" in o or "trtpaged_trt_plugin.dir" in o]
    assert linked, "no compile commands of the plugin or its static kernels"
    native = [o for o, cmd in linked if "march=native" in cmd]
    assert not native, native
    shared = [cmd for o, cmd in objects if "trtpaged_kernels.dir" in o and o.endswith(".cpp.o")]
    assert any("march=native" in cmd for cmd in shared), "the Python package's CPU kernels lost native tuning"


def test_plugin_library_exports_only_the_entry_points(plugin_library):
    out = subprocess.run(["nm", "-D", "--defined-only", str(plugin_library)], capture_output=True, text=True,
                         check=True)
    symbols = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert symbols == ENTRY_POINTS, out.stdout


def test_plugin_library_does_not_link_tensorrt(plugin_library):
    needed = subprocess.run(["readelf", "-d", str(plugin_library)], capture_output=True, text=True, check=True).stdout
    assert "libnvinfer" not in needed and "libcudart.so" not in needed, needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(plugin_library)],
                               capture_output=True, text=True, check=True).stdout
    assert "nvinfer1" not in undefined and "cuda" not in undefined.lower(), undefined


# --- engine.plan vs the torch backend ------------------------------------------------------------


def _runtime_reason() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT (the `tensorrt` Python package) is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    from trtpaged import kernels
    from trtpaged.tensorrt_env import unavailable_reason

    if not kernels.available() or not kernels.has_cuda():
        return "the kernel library is not built with CUDA"
    why_not = unavailable_reason()
    if why_not:
        return why_not
    return None


@pytest.fixture(scope="module", params=["float32", "float16"])
def trt_engine_dir(request, tmp_path_factory) -> Path:
    """A tiny GQA Llama (head_dim 64, which the CUDA kernels compile) with engine.plan next to its ONNX."""
    why_not = _runtime_reason()
    if why_not:
        pytest.skip(why_not)
    from trtpaged.builder import build_engine
    from trtpaged.builder.compile import PLAN_FILE, ShapeProfile, compile_engine
    from trtpaged.config import load_config
    from trtpaged.manifest import MANIFEST_NAME, read_manifest

    data = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    data["model"]["tiny"].update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    data.update(dtype=request.param, kv_cache_dtype="auto", backend="torch")
    data.pop("output", None)
    tmp = tmp_path_factory.mktemp(f"trt_{request.param}")
    (tmp / "model.yaml").write_text(yaml.safe_dump(data))
    out = tmp / "engine"
    build_engine(load_config(tmp / "model.yaml"), out, skip_verify=True, echo=lambda _: None)
    manifest = read_manifest(out)
    profile = ShapeProfile.from_limits(manifest.limits, manifest.kv_cache, manifest.kv_bytes_per_block)
    compile_engine(out / manifest.onnx_file, out / PLAN_FILE, profile, echo=print)
    raw = json.loads((out / MANIFEST_NAME).read_text())
    from trtpaged.engine_files import sha256_file

    raw.update(plan_file=PLAN_FILE, backends=["torch", "tensorrt"])
    raw["files"][PLAN_FILE] = sha256_file(out / PLAN_FILE)  # an engine dir lists every file it holds
    save_manifest(out, raw)
    return out


def _probe_batches(vocab_size: int, block_size: int):
    from trtpaged.builder.probe import standard_probe
    from trtpaged.runtime.runners import StepBatch

    _, steps, num_kv_blocks = standard_probe(vocab_size, block_size)
    return [StepBatch(**step.inputs) for step in steps], num_kv_blocks


@pytest.mark.tensorrt
def test_tensorrt_logits_match_the_torch_backend(trt_engine_dir):
    from trtpaged.manifest import read_manifest
    from trtpaged.runtime.runners import TorchRunner
    from trtpaged.runtime.runners.tensorrt_runner import TensorRTRunner

    manifest = read_manifest(trt_engine_dir)
    batches, num_kv_blocks = _probe_batches(manifest.dims.vocab_size, manifest.limits.block_size)
    trt_engine = TensorRTRunner.from_engine_dir(trt_engine_dir, num_kv_blocks, device="cuda")
    torch_runner = TorchRunner.from_engine_dir(trt_engine_dir, num_kv_blocks, device="cuda")
    tol = 2e-3 if manifest.dtype == "float32" else 3e-2
    for i, batch in enumerate(batches, 1):  # step 2 reads the K/V step 1 wrote in place
        got, want = trt_engine.step(batch), torch_runner.step(batch)
        torch.cuda.synchronize()
        assert got.shape == want.shape == (batch.logits_index.shape[0], manifest.dims.vocab_size)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= tol * max(scale, 1.0), f"step {i}"
    torch.testing.assert_close(trt_engine.kv_cache.float(), torch_runner.kv_cache.float(),
                               atol=tol * 10, rtol=tol * 10)


@pytest.mark.tensorrt
def test_auto_selects_tensorrt_and_copies_blocks(trt_engine_dir):
    from trtpaged.manifest import read_manifest
    from trtpaged.runtime.runners import load_runner, select_backend

    manifest = read_manifest(trt_engine_dir)
    assert select_backend(trt_engine_dir, manifest, "auto") == "tensorrt"
    engine = load_runner(trt_engine_dir, manifest, 8, "auto", num_host_blocks=2)
    assert engine.backend == "tensorrt"
    engine.kv_cache[1].normal_()
    engine.copy_blocks([(1, 5)])
    engine.swap_out([(5, 0)])
    engine.swap_in([(0, 6)])
    torch.cuda.synchronize()
    assert torch.equal(engine.kv_cache[6], engine.kv_cache[1])
