"""The TensorRT compile stage: model.onnx + the plugin library -> engine.plan.

TensorRT parses the ONNX graph (each TrtpagedPagedAttention node becomes our
IPluginV3 from libtrtpaged_trt_plugin.so, found by op_type, plugin_version and
plugin_namespace), one optimization profile covers every step shape the
manifest limits allow, and the plan is serialized. The network is strongly
typed: the ONNX graph already carries the build dtype (fp32/fp16/bf16), which
is how TensorRT 10.12+ wants precision expressed and the only mode of 11.x.

Without TensorRT, a GPU or the plugin library, `unavailable_reason()` says why
and the builder skips the stage (the engine dir then serves with torch).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from trtpaged.manifest import KVCacheBudget, Limits

PLAN_FILE = "engine.plan"
PLUGIN_LIBRARY_NAME = "libtrtpaged_trt_plugin.so"
PLUGIN_HINT = (
    "build it with TensorRT's headers: `TENSORRT_ROOT=/path/to/TensorRT pip install -e .` "
    "(or cmake -DTENSORRT_ROOT=...), or point TRTPAGED_PLUGIN_LIB at libtrtpaged_trt_plugin.so"
)
_loaded_libraries: dict[str, object] = {}  # plugin library path -> registry handle (TensorRT's registry is per process)


class CompileError(RuntimeError):
    """TensorRT could not parse the ONNX graph or build the plan; the message has its errors."""


def tensorrt_installed() -> bool:
    """True when the `tensorrt` Python package can be imported (not imported here)."""
    return importlib.util.find_spec("tensorrt") is not None


def plugin_library_path() -> Optional[Path]:
    """The plugin library: $TRTPAGED_PLUGIN_LIB, the installed package's _lib, or a local CMake build dir."""
    from trtpaged.kernels import library_candidates

    candidates = library_candidates(PLUGIN_LIBRARY_NAME, "TRTPAGED_PLUGIN_LIB")
    return next((p for p in candidates if p.is_file()), None)


def unavailable_reason() -> Optional[str]:
    """Why no engine.plan can be built (or run) on this machine, or None when it can."""
    if not tensorrt_installed():
        return "TensorRT is not installed (pip install 'trtpaged[tensorrt]' on a machine with an NVIDIA GPU)"
    import torch

    if not torch.cuda.is_available():
        return "TensorRT is installed but no CUDA GPU is available"
    if plugin_library_path() is None:
        return f"the TensorRT plugin library ({PLUGIN_LIBRARY_NAME}) is not built; {PLUGIN_HINT}"
    return None


def load_plugin_library(registry, path: Optional[Path] = None) -> Path:
    """Registers the plugin library's creators with TensorRT's plugin registry (once per process)."""
    path = path or plugin_library_path()
    if path is None:
        raise CompileError(f"{PLUGIN_LIBRARY_NAME} not found; {PLUGIN_HINT}")
    key = str(Path(path).resolve())
    if key not in _loaded_libraries:
        handle = registry.load_library(key)
        if handle is None:
            raise CompileError(f"TensorRT could not load the plugin library {key}")
        _loaded_libraries[key] = handle
    return Path(key)


@dataclass(frozen=True)
class ShapeProfile:
    """(min, opt, max) of every dynamic dimension of the engine I/O contract."""

    num_tokens: tuple[int, int, int]
    num_seqs: tuple[int, int, int]
    max_blocks_per_seq: tuple[int, int, int]
    num_outputs: tuple[int, int, int]
    num_blocks: tuple[int, int, int]

    @classmethod
    def from_limits(cls, limits: Limits, kv_cache: KVCacheBudget, kv_bytes_per_block: int) -> "ShapeProfile":
        """Steps up to max_num_tokens tokens of max_batch_size sequences of max_seq_len, over the budgeted pool."""
        blocks_per_seq = limits.max_blocks_per_seq
        useful_blocks = limits.max_batch_size * blocks_per_seq
        if kv_cache.num_blocks is not None:
            budget = int(kv_cache.num_blocks)
        elif kv_cache.memory_bytes is not None:
            budget = int(kv_cache.memory_bytes) // kv_bytes_per_block
        else:  # a fraction of free memory: the runtime caps it at useful_blocks
            budget = useful_blocks
        blocks = max(budget, useful_blocks, 1)
        batch, tokens = limits.max_batch_size, limits.max_num_tokens
        return cls(
            num_tokens=(1, min(batch, tokens), tokens),
            num_seqs=(1, batch, batch),
            max_blocks_per_seq=(1, blocks_per_seq, blocks_per_seq),
            num_outputs=(1, batch, tokens),
            num_blocks=(1, blocks, blocks),
        )

    def dims(self, name: str) -> dict[int, tuple[int, int, int]]:
        """The dynamic axes of input `name` and their (min, opt, max)."""
        seqs_plus_one = tuple(s + 1 for s in self.num_seqs)
        return {
            "input_ids": {0: self.num_tokens},
            "positions": {0: self.num_tokens},
            "query_start": {0: seqs_plus_one},
            "context_lens": {0: self.num_seqs},
            "block_tables": {0: self.num_seqs, 1: self.max_blocks_per_seq},
            "logits_index": {0: self.num_outputs},
            "kv_cache": {0: self.num_blocks},
        }.get(name, {})

    def shapes(self, name: str, static: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """(min, opt, max) shapes of input `name` whose network shape is `static` (-1 where dynamic)."""
        dynamic = self.dims(name)
        out = []
        for k in range(3):
            shape = tuple(dynamic[axis][k] if axis in dynamic else int(d) for axis, d in enumerate(static))
            if any(d < 0 for d in shape):
                raise CompileError(f"input {name}: dynamic dimension without a profile range in {static}")
            out.append(shape)
        return tuple(out)


def compile_engine(
    onnx_path: Path,
    plan_path: Path,
    profile: ShapeProfile,
    *,
    echo: Callable[[str], None] = print,
    plugin_library: Optional[Path] = None,
) -> Path:
    """Parses `onnx_path` with the plugin library loaded and writes the serialized plan to `plan_path`."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    library = load_plugin_library(builder.get_plugin_registry(), plugin_library)
    echo(f"compile  TensorRT {trt.__version__}, plugin {library.name}")

    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # accepted and implied in TensorRT 11
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(parser.get_error(i).desc() for i in range(parser.num_errors))
        raise CompileError(f"TensorRT could not parse {Path(onnx_path).name}: {errors}")
    echo(f"compile  parsed {Path(onnx_path).name}: {network.num_layers} layers, "
         f"{network.num_inputs} inputs, {network.num_outputs} outputs")

    config = builder.create_builder_config()
    # The pool is updated in place: the plugin aliases its kv_cache output to its input.
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    opt_profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        lo, opt, hi = profile.shapes(tensor.name, tuple(tensor.shape))
        opt_profile.set_shape(tensor.name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    monitor = _progress_monitor(trt, echo)
    config.progress_monitor = monitor

    echo("compile  building the plan (TensorRT tunes kernels; this can take minutes)")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise CompileError("TensorRT failed to build the plan (see the TensorRT errors above)")
    plan_path = Path(plan_path)
    with open(plan_path, "wb") as f:
        f.write(serialized)
    return plan_path


def _progress_monitor(trt, echo: Callable[[str], None]):
    """A trt.IProgressMonitor that echoes TensorRT's top-level build phases."""

    class ProgressMonitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                echo(f"compile  {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            pass

    return ProgressMonitor()
