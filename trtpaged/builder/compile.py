"""The TensorRT compile stage: model.onnx + the plugin library -> engine.plan.

TensorRT parses the ONNX graph (each TrtpagedPagedAttention node becomes our
IPluginV3 from libtrtpaged_trt_plugin_trt<major>.so, found by op_type, plugin_version and
plugin_namespace), one optimization profile covers every step shape the
manifest limits allow, and the plan is serialized. The network is strongly
typed: the ONNX graph already carries the build dtype (fp32/fp16/bf16), which
is how TensorRT 10.12+ wants precision expressed and the only mode of 11.x.

Without TensorRT, a GPU or the plugin library, `unavailable_reason()` says why
and the builder skips the stage (the engine dir then serves with torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from trtpaged.kv_budget import budget_blocks, useful_blocks
from trtpaged.manifest import KVCacheBudget, Limits
from trtpaged.models.dims import CUDA_HEAD_DIMS, HEAD_DIM_MULTIPLE, MAX_HEAD_DIM
from trtpaged.step_io import STEP_INPUT_AXES
from trtpaged.tensorrt_env import (
    CompileError,
    dims_tuple,
    load_plugin_library,
    tensorrt_version_reason,
    write_build_info,
)

# kv_cache_dtype values the CUDA kernels and the plugin have (plugins/src/cuda/dispatch.h with_kv_cache_dtype;
# the plugin's kv_cache_dtype field, plugins/src/tensorrt/fields.cpp). A quantized pool is int8 bytes in the
# engine I/O, rows of head_dim + 2: codes and the row's fp16 scale.
TENSORRT_KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3")


def check_head_dims(onnx_path: Path, model: Optional[str] = None) -> None:
    """Raises CompileError unless every paged-attention node of the graph has a head_dim the CUDA kernels have."""
    import onnx

    from trtpaged.builder.onnx_node import OP_TYPE

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    head_dims = {attr.i for node in graph.node if node.op_type == OP_TYPE
                 for attr in node.attribute if attr.name == "head_dim"}
    unsupported = sorted(head_dims - set(CUDA_HEAD_DIMS))
    if unsupported:
        raise CompileError(
            f"{model or Path(onnx_path).name}: head_dim {', '.join(map(str, unsupported))} has no CUDA kernel; "
            f"TensorRT engines support head_dim {', '.join(map(str, CUDA_HEAD_DIMS))} (the torch backend on CPU "
            f"runs multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}: build with backend: torch)"
        )


def kv_cache_dtype_reason(kv_cache_dtype: str) -> Optional[str]:
    """Why a TensorRT engine cannot have a KV cache of kv_cache_dtype (naming it and the backend), or None."""
    if kv_cache_dtype in TENSORRT_KV_CACHE_DTYPES:
        return None
    return (f"kv_cache_dtype {kv_cache_dtype} with backend tensorrt: the CUDA kernels and the TensorRT plugin have "
            f"{', '.join(TENSORRT_KV_CACHE_DTYPES)}; build with backend: torch")


def check_kv_cache_dtypes(onnx_path: Path, model: Optional[str] = None) -> None:
    """Raises CompileError (kv_cache_dtype_reason) unless every paged-attention node's kv_cache_dtype attribute
    ("auto": the pool tensor's float type) is one the CUDA kernels and the plugin have."""
    import onnx

    from trtpaged.builder.onnx_node import OP_TYPE

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    kv_cache_dtypes = {attr.s.decode() for node in graph.node if node.op_type == OP_TYPE
                 for attr in node.attribute if attr.name == "kv_cache_dtype"}
    for kv_cache_dtype in sorted(kv_cache_dtypes - {"auto"}):
        reason = kv_cache_dtype_reason(kv_cache_dtype)
        if reason:
            raise CompileError(f"{model or Path(onnx_path).name}: {reason}")


def check_conformance(onnx_path: Path, model: Optional[str] = None) -> None:
    """Raises CompileError (one line: the first violation, its rule's source, how many more) unless the graph
    keeps every rule of TensorRT's ONNX parser that builder/tensorrt_rules.py encodes."""
    from trtpaged.builder.tensorrt_rules import check_graph

    violations = check_graph(Path(onnx_path))
    if violations:
        more = f" (+{len(violations) - 1} more)" if len(violations) > 1 else ""
        raise CompileError(f"{model or Path(onnx_path).name}: TensorRT's parser would refuse the graph: "
                           f"{violations[0]}{more}")


@dataclass(frozen=True)
class ShapeProfile:
    """(min, opt, max) of every dynamic dimension of the engine I/O contract."""

    num_tokens: tuple[int, int, int]
    num_seqs: tuple[int, int, int]
    max_blocks_per_seq: tuple[int, int, int]
    num_outputs: tuple[int, int, int]
    num_kv_blocks: tuple[int, int, int]

    @classmethod
    def from_limits(cls, limits: Limits, kv_cache: KVCacheBudget, kv_bytes_per_block: int) -> "ShapeProfile":
        """Steps up to max_num_tokens tokens of max_batch_size sequences of max_seq_len, over the budgeted pool."""
        blocks_per_seq = limits.max_blocks_per_seq
        useful = useful_blocks(limits)
        budget = budget_blocks(limits, kv_cache, kv_bytes_per_block)  # None for a fraction: capped at `useful`
        blocks = max(budget or useful, useful, 1)
        batch, tokens = limits.max_batch_size, limits.max_num_tokens
        return cls(
            num_tokens=(1, min(batch, tokens), tokens),
            num_seqs=(1, batch, batch),
            max_blocks_per_seq=(1, blocks_per_seq, blocks_per_seq),
            num_outputs=(1, batch, tokens),
            num_kv_blocks=(1, blocks, blocks),
        )

    def dims(self, name: str) -> dict[int, tuple[int, int, int]]:
        """The dynamic axes of input `name` (probe.STEP_INPUT_AXES) and their (min, opt, max)."""
        out: dict[int, tuple[int, int, int]] = {}
        for axis, (dim, offset) in STEP_INPUT_AXES.get(name, {}).items():
            lo, opt, hi = getattr(self, dim)
            out[axis] = (lo + offset, opt + offset, hi + offset)
        return out

    def shapes(self, name: str, static: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(min, opt, max) shapes of input `name` whose network shape is `static` (-1 where dynamic)."""
        dynamic = self.dims(name)
        out: list[tuple[int, ...]] = []
        for k in range(3):
            shape = tuple(dynamic[axis][k] if axis in dynamic else int(d) for axis, d in enumerate(static))
            if any(d < 0 for d in shape):
                raise CompileError(f"input {name}: dynamic dimension without a profile range in {static}")
            out.append(shape)
        lo, opt, hi = out
        return lo, opt, hi


def compile_engine(
    onnx_path: Path,
    plan_path: Path,
    profile: ShapeProfile,
    *,
    echo: Callable[[str], None] = print,
    plugin_library: Optional[Path] = None,
    model: Optional[str] = None,
) -> Path:
    """Parses `onnx_path` with the plugin library loaded, writes the serialized plan to `plan_path`
    and records the TensorRT version next to it (BUILD_INFO_FILE). `model` names the model in errors."""
    check_head_dims(onnx_path, model)
    check_kv_cache_dtypes(onnx_path, model)
    check_conformance(onnx_path, model)
    import tensorrt as trt

    version = str(trt.__version__)
    too_old = tensorrt_version_reason(version)
    if too_old:
        raise CompileError(too_old)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    library = load_plugin_library(builder.get_plugin_registry(), version, plugin_library)
    echo(f"compile  TensorRT {version}, plugin {library.name}")

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
        lo, opt, hi = profile.shapes(tensor.name, dims_tuple(tensor.shape))
        opt_profile.set_shape(tensor.name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
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
    write_build_info(plan_path.parent, version, library)
    return plan_path


def _progress_monitor(trt: Any, echo: Callable[[str], None]) -> Any:
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
