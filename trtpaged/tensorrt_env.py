"""TensorRT on this machine: is it installed and new enough, where is the plugin library, can an engine.plan run.

Shared by the builder (the compile stage) and the runtime (the tensorrt backend); it imports
neither. Nothing here imports TensorRT at module level: `tensorrt_installed()` only looks.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any, Optional

PLAN_FILE = "engine.plan"
BUILD_INFO_FILE = "tensorrt.json"  # next to engine.plan: the TensorRT version and plugin it was built with
MIN_TENSORRT = (10, 3)  # aliased plugin I/O (PreviewFeature.ALIASED_PLUGIN_IO_10_03)
PLUGIN_HINT = (
    "build it with TensorRT's headers: `TENSORRT_ROOT=/path/to/TensorRT pip install -e .` "
    "(or cmake -DTENSORRT_ROOT=...), or point TRTPAGED_PLUGIN_LIB at libtrtpaged_trt_plugin_trt<major>.so"
)
_PLUGIN_TAG = re.compile(rb"trtpaged-plugin-tensorrt-major=(\d+);")  # plugins/src/tensorrt/entry_points.cpp
_PLUGIN_CREATOR = ("TrtpagedPagedAttention", "1", "trtpaged")  # name, version, namespace (fields.h)
_loaded_library: Optional[Path] = None  # TensorRT's plugin registry is per process: one trtpaged plugin in it


class CompileError(RuntimeError):
    """TensorRT could not parse the ONNX graph or build the plan; the message has its errors."""


def dims_tuple(dims: Any) -> tuple[int, ...]:
    """A trt.Dims (or any sequence of ints) as a tuple of ints."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def plugin_library_name(major: int) -> str:
    """File name of the plugin library built for TensorRT `major` (10 and 11 are not binary-compatible)."""
    return f"libtrtpaged_trt_plugin_trt{major}.so"


def tensorrt_installed() -> bool:
    """True when the `tensorrt` Python package can be imported (not imported here).

    tensorrt-stubs installs a `tensorrt` dir of .pyi files alone, which imports as an empty
    namespace package: that is not TensorRT."""
    spec = importlib.util.find_spec("tensorrt")
    return spec is not None and spec.origin is not None


def tensorrt_version() -> Optional[str]:
    """`tensorrt.__version__` of the installed TensorRT, or None without one."""
    if not tensorrt_installed():
        return None
    import tensorrt as trt

    return str(trt.__version__)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def tensorrt_version_reason(version: str) -> Optional[str]:
    """Why TensorRT `version` cannot build or run trtpaged engines, or None when it can."""
    if _version_tuple(version)[:2] < MIN_TENSORRT:
        need = ".".join(map(str, MIN_TENSORRT))
        return (f"TensorRT {version} is older than {need}: trtpaged's plugin updates the KV pool through "
                f"aliased plugin I/O, which TensorRT has from {need}; install TensorRT >= {need}")
    return None


def plugin_library_major(path: Path) -> Optional[int]:
    """The TensorRT major the plugin library at `path` was compiled for (read from its bytes), or None."""
    match = _PLUGIN_TAG.search(Path(path).read_bytes())
    return int(match.group(1)) if match else None


def check_plugin_library(path: Path, version: str) -> None:
    """Raises CompileError (one line) unless the library at `path` was built for TensorRT `version`'s major."""
    built_for, running = plugin_library_major(path), _version_tuple(version)[0]
    if built_for is None:
        raise CompileError(f"{path} is not a trtpaged TensorRT plugin library (no TensorRT major recorded in it)")
    if built_for != running:
        raise CompileError(f"{Path(path).name} was built for TensorRT {built_for}, "
                           f"but TensorRT {version} is installed; "
                           f"build {plugin_library_name(running)} against TensorRT {running}'s headers")


def plugin_library_path(major: Optional[int] = None) -> Optional[Path]:
    """The plugin library for TensorRT `major` (default: the installed one's): $TRTPAGED_PLUGIN_LIB,
    the installed package's _lib, or a local CMake build dir."""
    from trtpaged.kernels import library_candidates

    if major is None:
        version = tensorrt_version()
        if version is None:
            return None
        major = _version_tuple(version)[0]
    candidates = library_candidates(plugin_library_name(major), "TRTPAGED_PLUGIN_LIB")
    return next((p for p in candidates if p.is_file()), None)


def unavailable_reason() -> Optional[str]:
    """Why no engine.plan can be built (or run) on this machine, or None when it can."""
    version = tensorrt_version()
    if version is None:
        return "TensorRT is not installed (pip install 'trtpaged[tensorrt]' on a machine with an NVIDIA GPU)"
    too_old = tensorrt_version_reason(version)
    if too_old:
        return too_old
    import torch

    if not torch.cuda.is_available():
        return "TensorRT is installed but no CUDA GPU is available"
    if plugin_library_path() is None:
        name = plugin_library_name(_version_tuple(version)[0])
        return f"the TensorRT plugin library ({name}) is not built; {PLUGIN_HINT}"
    return None


def load_plugin_library(registry: Any, version: str, path: Optional[Path] = None) -> Path:
    """Registers the plugin library's creators with TensorRT's plugin registry, once per process.

    The library must be built for TensorRT `version`'s major. A trtpaged plugin already in the
    registry (loaded earlier from another path, or by the host application) is used as it is.
    """
    global _loaded_library
    if _loaded_library is not None:
        return _loaded_library
    path = path or plugin_library_path(_version_tuple(version)[0])
    if path is None:
        raise CompileError(f"{plugin_library_name(_version_tuple(version)[0])} not found; {PLUGIN_HINT}")
    resolved = Path(path).resolve()
    check_plugin_library(resolved, version)
    if registry.load_library(str(resolved)) is None and registry.get_creator(*_PLUGIN_CREATOR) is None:
        raise CompileError(f"TensorRT could not load the plugin library {resolved} (see its errors above)")
    _loaded_library = resolved
    return resolved


def gpu_sm(device: int = 0) -> Optional[str]:
    """The CUDA GPU's compute capability as "sm_90" (None without a CUDA GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def write_build_info(engine_dir: Path, version: str, library: Path, sm: Optional[str] = None) -> Path:
    """Records next to engine.plan the full TensorRT version, the GPU's SM (default: this machine's) and the
    plugin library it was built with: a plan runs only on the TensorRT version and GPU it was built for."""
    info = {"tensorrt_version": version, "tensorrt_major": _version_tuple(version)[0],
            "gpu_sm": sm if sm is not None else gpu_sm(), "plugin_library": library.name}
    path = Path(engine_dir) / BUILD_INFO_FILE
    path.write_text(json.dumps(info, indent=2) + "\n")
    return path


def check_build_info(engine_dir: Path, version: str, sm: Optional[str] = None) -> None:
    """Raises CompileError (one line) unless engine.plan in `engine_dir` was built with TensorRT `version`
    (every component) for this GPU's SM (`sm`, default: this machine's)."""
    path = Path(engine_dir) / BUILD_INFO_FILE
    if not path.is_file():
        raise CompileError(f"{engine_dir}: engine.plan without {BUILD_INFO_FILE} (built by an older trtpaged); "
                           "rebuild it")
    built = json.loads(path.read_text())
    built_version = str(built["tensorrt_version"])
    if _full_version(built_version) != _full_version(version):
        raise CompileError(f"{engine_dir}: engine.plan was built with TensorRT {built_version}, but "
                           f"TensorRT {version} is installed; rebuild it or install TensorRT {built_version}")
    built_sm = built.get("gpu_sm")
    running_sm = sm if sm is not None else gpu_sm()
    if built_sm is None:
        raise CompileError(f"{engine_dir}: {BUILD_INFO_FILE} does not record the GPU (SM) the plan was built for "
                           "(built by an older trtpaged); rebuild it")
    if running_sm is not None and built_sm != running_sm:
        raise CompileError(f"{engine_dir}: engine.plan was built for {built_sm}, but this GPU is {running_sm}; "
                           "rebuild it on this GPU")


def _full_version(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))
