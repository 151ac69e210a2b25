"""ONNX export of the step model: one TrtpagedPagedAttention node per layer, weights shared with safetensors.

The dynamo exporter traces the step model with its functional attention op
(`trtpaged::paged_attention`), which the custom translation turns into one
node per layer. Every dimension that varies between steps is dynamic:
num_tokens, num_seqs, max_blocks_per_seq, num_outputs and num_kv_blocks.
Initializers that are model parameters become external data pointing into the
weights safetensors file (no second copy of the weights).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch

from trtpaged.builder import onnx_allreduce, onnx_quant
from trtpaged.builder.onnx_node import translation_table
from trtpaged.builder.probe import standard_probe
from trtpaged.step_io import INPUT_NAMES, STEP_INPUT_AXES
from trtpaged.builder.weights import tensor_offsets, write_safetensors
from trtpaged.kv_quant import is_quantized
from trtpaged.models.llama import LlamaStepModel

OUTPUT_NAMES = ("logits", "kv_cache_out")
_INLINE_LIMIT = 1 << 20  # exporter-made constants above this size would duplicate weights


class ExportError(RuntimeError):
    """The ONNX export failed or produced a graph that breaks the contract."""


def dynamic_shapes() -> dict[str, dict[int, object]]:
    """torch.export dynamic dims of each input (names as in the engine I/O contract)."""
    names = {dim for axes in STEP_INPUT_AXES.values() for dim, _ in axes.values()}
    dims = {name: torch.export.Dim(name, min=1) for name in names}
    return {name: {axis: dims[dim] + offset if offset else dims[dim] for axis, (dim, offset) in axes.items()}
            for name, axes in STEP_INPUT_AXES.items()}


def graph_weights_path(onnx_path: Path) -> Path:
    """Where the graph's own tensors go (those not in the weights file: the TensorRT forms of quantized weights)."""
    return onnx_path.with_name(f"{onnx_path.stem}-tensorrt.safetensors")


def export_onnx(model: LlamaStepModel, block_size: int, kv_cache_dtype: torch.dtype | str, onnx_path: Path,
                weights_path: Path) -> Path:
    """Exports `model` to `onnx_path`; its parameters become external data inside `weights_path` (written before),
    and its tensors that file lacks (a quantized model's TensorRT graph forms, builder/tensorrt_graph.py) external
    data inside `graph_weights_path(onnx_path)`, written here.

    kv_cache_dtype: the pool's torch dtype, or "int8" / "fp8_e4m3" for a quantized pool, which the graph
    takes as int8 bytes (rows of head_dim + 2) with the format in each node's kv_cache_dtype attribute."""
    import onnx_ir as ir

    seqs, steps, num_kv_blocks = standard_probe(model.dims.vocab_size, block_size)
    pool = model.new_kv_cache(num_kv_blocks, block_size, kv_cache_dtype)
    quantized = isinstance(kv_cache_dtype, str) and is_quantized(kv_cache_dtype)
    args = steps[1].args(pool.view(torch.int8) if quantized else pool)
    model.functional_cache = True
    model.graph_kv_cache_dtype = kv_cache_dtype if quantized else None
    try:
        with _quiet(), _without_quadratic_rewrites():
            program = torch.onnx.export(
                model, args, dynamo=True, custom_translation_table={**translation_table(), **onnx_quant.translation(),
                                                             **onnx_allreduce.translation()},
                dynamic_shapes=dynamic_shapes(), input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                optimize=True, verbose=False, report=False, opset_version=onnx_quant.OPSET,
            )
    except Exception as e:  # noqa: BLE001  (the exporter raises many kinds)
        raise ExportError(f"ONNX export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    finally:
        model.functional_cache = False
        model.graph_kv_cache_dtype = None
    graph = program.model.graph
    for node in graph:  # the exporter's per-node stack traces and source paths: 80% of the file, no use downstream
        node.metadata_props.clear()
    _bind_to_files(graph, model, onnx_path, weights_path)
    onnx_quant.lower_dequantize_nodes(program.model)
    ir.save(program.model, onnx_path)
    return onnx_path


def export_other_rank(rank0_onnx_path: Path, model: LlamaStepModel, rank: int, onnx_path: Path,
                      weights_path: Path) -> Path:
    """Rank `rank`'s graph made from rank 0's (`export_onnx`'s output) instead of tracing `model` again.

    The ranks' step models differ only in their weight shards and in the rank their all-reduce nodes carry:
    the same graph, pointed at `weights_path` (this rank's shard, written before) and its own side file,
    with every all-reduce node's rank set. The build's verify stage runs the rank graphs jointly against HF.
    """
    import onnx_ir as ir

    ir_model = ir.load(rank0_onnx_path)
    graph = ir_model.graph
    rank0_files = {value.const_value.location for value in graph.initializers.values()
                   if isinstance(value.const_value, ir.ExternalTensor)}
    _bind_to_files(graph, model, onnx_path, weights_path)
    left = sorted(name for name, value in graph.initializers.items()
                  if isinstance(value.const_value, ir.ExternalTensor) and value.const_value.location in rank0_files)
    if left:
        raise ExportError(f"rank {rank}: initializers {left[:3]} are not in {weights_path.name}")
    reduces = 0
    for node in graph:
        if node.op_type == onnx_allreduce.OP_TYPE:
            node.attributes["rank"] = ir.AttrInt64("rank", rank)
            reduces += 1
    if reduces == 0:
        raise ExportError(f"{rank0_onnx_path.name} has no {onnx_allreduce.OP_TYPE} node: not a rank graph")
    ir.save(ir_model, onnx_path)
    return onnx_path


def _bind_to_files(graph, model: LlamaStepModel, onnx_path: Path, weights_path: Path) -> None:
    """Makes each initializer that is one of `model`'s tensors external data: its bytes in `weights_path`, or
    in the side file `graph_weights_path(onnx_path)` (written here) for the tensors that file lacks."""
    import onnx_ir as ir

    offsets = tensor_offsets(weights_path)
    graph_only = {name: t.detach().contiguous() for name, t in model.state_dict().items()
                  if name not in offsets and name in graph.initializers}
    external = {name: (weights_path, offset_length) for name, offset_length in offsets.items()}
    if graph_only:
        side = graph_weights_path(onnx_path)
        write_safetensors(graph_only, side, {"format": "pt", "producer": "trtpaged", "for": onnx_path.name})
        external.update({name: (side, ol) for name, ol in tensor_offsets(side).items()})
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if name in external and tensor is not None:
            path, (offset, length) = external[name]
            if length != tensor.nbytes:
                raise ExportError(f"initializer {name}: {tensor.nbytes} bytes in the graph, {length} in {path.name}")
            value.const_value = ir.ExternalTensor(
                path.name, offset, length, tensor.dtype, shape=tensor.shape, name=name,
                base_dir=str(onnx_path.parent),
            )
        elif tensor is not None and tensor.nbytes > _INLINE_LIMIT:
            raise ExportError(
                f"initializer {name} ({tensor.nbytes} bytes) is not a model parameter; it would duplicate weights"
            )


# onnxscript's rewrite rules whose matching grows with the square of the graph (a two-output pattern): SlicesSplit
# took 27.7 s of the rules' 32.8 s in a 30-layer export on a loaded 2-core machine (SmolLM2's export: 75.4 s with
# it, 57.8 s without) and never fired on the step models' graphs: Llama (30 layers), Qwen2 and Mistral export
# byte-identical graphs without it
_SLOW_REWRITE_RULES = frozenset({"SlicesSplit"})


@contextlib.contextmanager
def _without_quadratic_rewrites():
    """The exporter's optimizer without `_SLOW_REWRITE_RULES` (the rest of its passes and rules unchanged).

    The optimizer reads its rule list from onnxscript.rewriter when it runs and takes no rule argument; this swaps
    that list for the duration of one export (builds export one graph at a time). Without that list (another
    onnxscript) it changes nothing."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not isinstance(rules, tuple):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in _SLOW_REWRITE_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


@contextlib.contextmanager
def _quiet():
    """Silences the exporter's progress prints and warnings (the builder prints its own progress)."""
    names = ("torch.onnx", "torch.onnx._internal.exporter._registration", "torch._export", "torch.export", "onnxscript")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
