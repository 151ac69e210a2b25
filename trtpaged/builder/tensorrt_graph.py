"""The quantized weights of the TensorRT graph (model.onnx): forms TensorRT's parser takes (builder/tensorrt_rules.py).

The engine's own layout (weights.safetensors, run by the torch backend) stays as
it is: int4 codes 0..15 with a float offset per group (GGUF Q4_1 bit for bit at
group 32), int8 per channel or per group (GGUF Q8_0). The graph holds:

- int4, block 64 or 128: signed codes q - 8 (each nibble ^ 8, i.e. byte ^ 0x88 of
  the engine's packing), laid out [K, N] as the MatMul's weight, scales [K/B, N]
  in the compute dtype, and the offset term `group sums of x times offsets`
  with offsets + 8 * scales, so W = s * (q - 8) + (o + 8s) = s * q + o exactly;
- int4, group 32 (GGUF Q4_1), exactly, in twice the int4 bytes: every 64 inputs
  become two blocks of 64, the first holding the chunk's first group of 32 and
  zero codes, the second zero codes and its second group, so that each block
  has one scale; the MatMul takes x with each 64-input chunk repeated twice
  ([M, 2K]), and the offset term sums x per group of 32 (`SPLIT_GROUPS`);
- int8 per channel: codes [K, N], 1-D scales [N] in the compute dtype, axis 1;
- the embedding table as a float (compute dtype) table: Gather of a float
  constant, no de-quantization after a Gather.

Where the engine's layout has no such form (int4 groups of 16, or of 32 where K is
no multiple of 64; int8 per group, as GGUF Q8_0 is), `graph_weights` re-quantizes
that tensor for the graph from the source (float) weights: int4 block 64 (or
int8 per channel where K is no multiple of 64), int8 per channel; the build log
names each such tensor. A tied LM head is untied in the graph for that (the
embedding table stays exact). Verification then runs the graph against HF with
the graph's own de-quantized weights (`reference_hf`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from trtpaged.builder.quantize import QuantizedState, dequantized_hf_model
from trtpaged.manifest import ModelDims
from trtpaged.models.qlinear import QuantizedEmbedding, QuantizedLinear, set_activations
from trtpaged.models.quant import QuantizedWeight, quantize, unpack_int4

INT4_BLOCKS = (64, 128)  # what TensorRT's INT4 block quantization takes (tensorrt_rules.INT4_BLOCK_SIZES)
# int4 group sizes the graph holds exactly by spreading each block of 64 inputs over several blocks, one group
# in each (module docstring): group size -> copies of x. Only 2: group 16 would take as many bytes as fp16.
SPLIT_GROUPS = {32: 2}
REQUANTIZED = "re-quantized for the TensorRT graph"


def expressible(bits: int, group_size: int, in_features: int) -> bool:
    """True when the graph can hold a weight of this layout exactly (int4 block 64/128, int4 group 32 spread
    over blocks of 64, int8 per channel)."""
    if bits != 4:
        return group_size == in_features
    return group_size in INT4_BLOCKS or (group_size in SPLIT_GROUPS and in_features % INT4_BLOCKS[0] == 0)


def _graph_layout(bits: int, in_features: int) -> tuple[int, Optional[int]]:
    """(bits, group_size or None for per channel) a re-quantized weight gets in the graph."""
    if bits == 4 and in_features % INT4_BLOCKS[0] == 0:
        return 4, INT4_BLOCKS[0]
    return 8, None


def _weight(state: dict[str, torch.Tensor], prefix: str, bits: int, group: int) -> QuantizedWeight:
    return QuantizedWeight(bits, group, state[f"{prefix}.codes"], state[f"{prefix}.scales"],
                           state.get(f"{prefix}.offsets"))


def graph_weights(quantized: QuantizedState, dims: ModelDims,
                  source: dict[str, torch.Tensor]) -> tuple[QuantizedState, ModelDims, list[str]]:
    """(the graph's quantized state, its dims, one line per re-quantized tensor).

    source: float weights under the step model's names (`<module>.weight`, `embed_tokens.weight`,
    `lm_head.weight` where untied), which re-quantized tensors are made from. The state is in the
    engine's stored layout; `to_tensorrt_graph` turns a model of it into the graph form, exactly."""
    state, plan, origin = dict(quantized.state), dict(quantized.plan), dict(quantized.origin)
    notes: list[str] = []
    graph_dims = dims

    def requantize(module: str, prefix: str, weight: QuantizedWeight, float_weight: torch.Tensor) -> None:
        bits, group = _graph_layout(weight.bits, weight.in_features)
        new = quantize(float_weight.to(torch.float32), bits, group)
        for kind in ("codes", "scales", "offsets"):
            state.pop(f"{prefix}.{kind}", None)
        state[f"{prefix}.codes"], state[f"{prefix}.scales"] = new.codes, new.scales
        if new.offsets is not None:
            state[f"{prefix}.offsets"] = new.offsets
        plan[module], origin[module] = (new.bits, new.group_size), REQUANTIZED
        diff = float((new.dequantize() - weight.dequantize()).abs().max())
        scale = float(weight.dequantize().abs().max()) or 1.0
        was = "per channel" if weight.group_size == weight.in_features else f"group {weight.group_size}"
        now = "per channel" if group is None else f"block {group}"
        notes.append(f"{module}: int{weight.bits} {was} -> int{new.bits} {now}, re-quantized from the source weights "
                     f"(max |W_graph - W_engine| {diff:.3g}, {diff / scale:.2%} of max |W|)")

    for module, (bits, group) in quantized.plan.items():
        if module == "embed_tokens":
            continue
        weight = _weight(quantized.state, module, bits, group)
        if not expressible(bits, group, weight.in_features):
            requantize(module, module, weight, source[f"{module}.weight"])
    head = quantized.plan.get("embed_tokens")
    if head is not None and dims.tie_word_embeddings:
        weight = _weight(quantized.state, "embed_tokens.head", *head)
        if not expressible(*head, weight.in_features):
            # the table is exact as a float table; only the head needs a per-channel form: untie it
            graph_dims = replace(dims, tie_word_embeddings=False)
            for kind in ("codes", "scales"):
                state[f"lm_head.{kind}"] = state[f"embed_tokens.head.{kind}"]
            plan["lm_head"] = head
            requantize("lm_head", "lm_head", weight, source["embed_tokens.weight"])
            notes[-1] = notes[-1].replace("lm_head:", "lm_head (tied to embed_tokens; untied in the graph):")
    return QuantizedState(state, plan, origin), graph_dims, notes


def spread_note(graph_state: QuantizedState) -> Optional[str]:
    """One build-log line on the tensors the graph holds spread over twice their inputs, or None."""
    spread = [m for m, (bits, group) in graph_state.plan.items() if bits == 4 and group in SPLIT_GROUPS]
    if not spread:
        return None
    return (f"{len(spread)} int4 group-{graph_state.plan[spread[0]][1]} tensors held exactly as blocks of "
            f"{INT4_BLOCKS[0]}, spread over twice their inputs (twice their int4 bytes in the graph)")


def graph_step_model(graph_state: QuantizedState, dims: ModelDims, dtype: torch.dtype, activations: str):
    """A LlamaStepModel of the graph's quantized state (engine layout), to shard and convert for export."""
    from trtpaged.models.loading import with_weights

    state = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith((".codes", ".scales", ".offsets")) else v)
             for k, v in graph_state.state.items()}
    model = with_weights(dims, dtype, state, "cpu", graph_state.plan)
    set_activations(model, activations)
    return model


def reference_hf(hf_model, dims: ModelDims, graph_state: QuantizedState, graph_dims: ModelDims):
    """HF with the graph's de-quantized weights (the verification reference); a head untied for the graph
    is untied in the copy too."""
    if dims.tie_word_embeddings and not graph_dims.tie_word_embeddings:
        hf_model = copy.deepcopy(hf_model)
        hf_model.lm_head.weight = nn.Parameter(hf_model.lm_head.weight.detach().clone(), requires_grad=False)
    return dequantized_hf_model(hf_model, graph_dims, graph_state)


@dataclass
class GraphPlan:
    """The TensorRT graph's weights for one build: state (engine layout), dims, the per-tensor notes and the
    verification reference (HF with the graph's de-quantized weights)."""

    state: QuantizedState
    dims: ModelDims
    notes: list[str]
    reference: Any
    dtype: torch.dtype
    activations: str

    def step_model(self):
        """A new step model of the graph's weights (tensors shared), to shard or convert in place."""
        return graph_step_model(self.state, self.dims, self.dtype, self.activations)


def plan_graph(quantized: QuantizedState, hf_model, dims: ModelDims, dtype: torch.dtype, config) -> GraphPlan:
    """The graph's weights for a quantized build (`config`: the QuantizationConfig), re-quantizing from the
    HF model's float weights where the engine's layout has no TensorRT form."""
    from trtpaged.models.loading import hf_state_dict

    source = hf_state_dict(hf_model, dims)
    state, graph_dims, notes = graph_weights(quantized, dims, source)
    reference = reference_hf(hf_model, dims, state, graph_dims) if notes else None
    return GraphPlan(state, graph_dims, notes, reference, dtype, config.activations)


# --- the graph form ----------------------------------------------------------------------------------


@torch.library.custom_op("trtpaged::dequantize_linear", mutates_args=())
def dequantize_linear(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """W^T [K, N] in scales' dtype: scales * codes, per block of `block_size` rows (0: per column, scales [N]).
    int4 codes come as signed nibbles packed two per byte along N ([K, N/2] uint8, ONNX INT4's bytes)."""
    q = _signed_int4(codes) if bits == 4 else codes
    q = q.to(torch.float32)
    s = scales.to(torch.float32)
    w = q * (s[None, :] if block_size == 0 else s.repeat_interleave(block_size, dim=0))
    return w.to(scales.dtype)


@dequantize_linear.register_fake
def _dequantize_linear_fake(codes, scales, bits, block_size):
    n = codes.shape[1] * (2 if bits == 4 else 1)
    return codes.new_empty((codes.shape[0], n), dtype=scales.dtype)


def _signed_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [K, N] values -8..7 from two's-complement nibbles packed [K, N/2] (even n in the low nibble)."""
    return (unpack_int4(packed).to(torch.int16) ^ 8).sub(8).to(torch.int8)


def _spread_groups(codes: torch.Tensor, group_size: int, copies: int) -> torch.Tensor:
    """[N, K] nibble codes -> [N, copies * K]: each chunk of copies * group_size inputs becomes `copies` such
    chunks, the r-th keeping only the chunk's r-th group and zero codes (signed 0) elsewhere."""
    n, k = codes.shape
    chunk = codes.reshape(n, k // (copies * group_size), 1, copies, group_size)
    keep = torch.eye(copies, dtype=torch.bool)[:, :, None]  # [copy, group in chunk, 1]
    return torch.where(keep, chunk, torch.zeros((), dtype=codes.dtype)).reshape(n, copies * k)


class TensorRTLinear(nn.Module):
    """y = x @ DequantizeLinear(codes) (+ group sums of x @ offsets) + b: the graph form of a QuantizedLinear.

    A group-32 int4 weight is spread over twice the inputs (`SPLIT_GROUPS`): the MatMul then takes x with each
    block of 64 inputs repeated `copies` times."""

    def __init__(self, linear: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight_q
        if not expressible(w.bits, w.group_size, w.in_features):
            raise ValueError(f"int{w.bits} group {w.group_size}: no TensorRT form (re-quantize with graph_weights)")
        self.bits, self.in_features, self.out_features = w.bits, w.in_features, w.out_features
        self.copies = SPLIT_GROUPS.get(w.group_size, 1) if w.bits == 4 else 1
        self.block_size = w.group_size * self.copies if w.bits == 4 else 0
        self.offset_group = w.group_size if w.bits == 4 else 0
        scales = w.scales.to(torch.float32)
        if w.bits == 4:
            signed = w.int_codes() ^ 8  # q - 8 as two's-complement nibbles, [N, K]
            if self.copies > 1:  # block b of the spread weight holds group b: its scale is scales[:, b] as stored
                signed = _spread_groups(signed, w.group_size, self.copies)
            signed = signed.t().contiguous()  # [K (times copies), N]
            codes = (signed[:, 0::2] | (signed[:, 1::2] << 4)).to(torch.uint8)
            offsets = (w.offsets.to(torch.float32) + 8 * scales).t()  # s*(q-8) + (o+8s) = s*q + o
            self.register_buffer("tensorrt_offsets", offsets.to(dtype).contiguous())
            self.register_buffer("tensorrt_scales", scales.t().to(dtype).contiguous())
        else:
            codes = w.codes.t()
            self.tensorrt_offsets = None
            self.register_buffer("tensorrt_scales", scales[:, 0].to(dtype).contiguous())
        self.register_buffer("tensorrt_codes", codes.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """W [N, K] float32 as the graph computes it (for tests and the reference)."""
        w = dequantize_linear(self.tensorrt_codes, self.tensorrt_scales.float(), self.bits, self.block_size)
        if self.copies > 1:  # the copies of a chunk hold disjoint groups (zeros elsewhere): their sum is exact
            w = w.reshape(-1, self.copies, self.block_size, self.out_features).sum(1).reshape(self.in_features, -1)
        if self.tensorrt_offsets is not None:
            w = w + self.tensorrt_offsets.float().repeat_interleave(self.offset_group, dim=0)
        return w.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_linear(self.tensorrt_codes, self.tensorrt_scales, self.bits, self.block_size)
        spread = x
        if self.copies > 1:
            chunks = x.reshape(x.shape[0], -1, 1, self.block_size)
            spread = torch.cat([chunks] * self.copies, dim=2).reshape(x.shape[0], -1)
        y = torch.matmul(spread, weight)
        if self.tensorrt_offsets is not None:
            sums = x.reshape(x.shape[0], -1, self.offset_group).sum(-1)
            y = y + torch.matmul(sums, self.tensorrt_offsets)
        return y if self.bias is None else y + self.bias


def to_tensorrt_graph(model: nn.Module) -> nn.Module:
    """`model` (a fresh step model, changed in place) with every quantized module in its graph form, exactly:
    QuantizedLinear -> TensorRTLinear, QuantizedEmbedding -> a float nn.Embedding of the same values."""
    dtype = model.dtype
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedEmbedding):
            if getattr(model, "lm_head", None) is None and module is model.embed_tokens:
                model.lm_head = TensorRTLinear(module.head, dtype)  # the tied head, same weights
            table = nn.Embedding(module.num_embeddings, module.embedding_dim, dtype=dtype, device="meta")
            table.weight = nn.Parameter(module.head.weight_q.dequantize(dtype), requires_grad=False)
            _set(model, name, table)
        elif isinstance(module, QuantizedLinear) and not name.endswith(".head"):
            _set(model, name, TensorRTLinear(module, dtype))
    return model


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)

