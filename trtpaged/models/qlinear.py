"""Weight-only quantized linear and embedding modules of the step model.

Each holds a `QuantizedWeight` (trtpaged.models.quant) as buffers `codes`,
`scales` and, for int4, `offsets`, so that the engine dir's safetensors and the
ONNX graph carry the quantized form. Three ways to run:

- eager on the CPU: the kernel library's kernels over a packed copy made
  once, with the engine's `quantization.activations`: "float" keeps x in
  float32 (weight-only proper, W4A16/W8A16: as accurate as F.linear on the
  de-quantized weight), "int8" quantizes x per 32 inputs on the fly for
  integer dot products (W4A8, llama.cpp's way: faster, less accurate);
- eager on a CUDA device: the weight stays quantized there (models/qlinear_cuda.py:
  int4 through PyTorch's int4 weight-only GEMM, int8 de-quantized per call), packed
  at load (`prepare_cuda`) or at the first call;
- eager elsewhere (CPU with another dtype), or where the library lacks the kernels:
  a de-quantized float copy of the weight, made once, and `F.linear`
  (full-precision activations; no memory saving);
- ONNX export: not these modules; the builder turns them into the TensorRT
  graph's forms first (builder/tensorrt_graph.py: signed int4 blocks, int8 per
  channel, a float embedding table), since this layout (uint4 codes, group 32,
  int8 rows gathered) is not what TensorRT's parser takes.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trtpaged.models.quant import QuantizedWeight, unpack_int4


ACTIVATIONS = ("float", "int8")


def set_activations(model: nn.Module, activations: str) -> None:
    """Sets how every quantized linear of `model` treats its input x on the CPU kernels: "float" or "int8"."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: got {activations!r}; allowed: {', '.join(ACTIVATIONS)}")
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.activations = activations
    set_plan = getattr(model, "set_execution_plan", None)
    if set_plan is not None:  # a step model's one-call layer runner holds the modes it was built with
        set_plan(model.execution_plan)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """W [N, K] float32 = scales (per group of `group_size` inputs) * codes; int4 codes come packed [N, K/2]."""
    q = (unpack_int4(codes) if bits == 4 else codes).to(torch.float32)
    n, k = q.shape
    return (q.view(n, k // group_size, group_size) * scales[:, :, None]).view(n, k)


@torch.library.custom_op("trtpaged::dequantize_weight", mutates_args=())
def dequantize_weight(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """dequantize as one op of a traced graph."""
    return dequantize(codes, scales, bits, group_size)


@dequantize_weight.register_fake
def _dequantize_weight_fake(codes, scales, bits, group_size):
    k = codes.shape[1] * (2 if bits == 4 else 1)
    return codes.new_empty((codes.shape[0], k), dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def _cpu_kernels() -> Optional[Any]:
    """The kernel library when it has the quantized kernels, else None (de-quantized fallback)."""
    try:
        from trtpaged import kernels

        kernels.library()
    except Exception:  # noqa: BLE001  (missing or older library: the fallback is correct, only slower)
        return None
    return kernels if hasattr(kernels, "qlinear") else None


def uses_int8_activations(model: nn.Module) -> bool:
    """True when the model's quantized linears quantize their inputs to int8 here (the CPU kernels with
    activations "int8"); False where they compute with float activations."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    return bool(linears) and _cpu_kernels() is not None and all(
        m.codes.device.type == "cpu" and m.cuda_op is None and m.in_features % 32 == 0 and m.activations == "int8"
        for m in linears)


def prepare_cuda(model: nn.Module) -> int:
    """Packs every quantized linear of a model on a CUDA device for its CUDA op now (not at the first step), so
    that memory is what serving holds before the KV pool is sized; returns the weights' device bytes."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.codes.is_cuda:
            module.make_cuda_op(module.codes.device)
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.cuda_op is not None:
            total += module.cuda_op.device_bytes()
    skip = {id(t) for m in model.modules() if isinstance(m, QuantizedLinear) and m.cuda_op is not None
            for t in (m.codes, m.scales, m.offsets, m.bias) if t is not None}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t.is_cuda and id(t) not in skip}
    return total + sum(t.numel() * t.element_size() for t in tensors.values())


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W stored quantized (int8 or int4, see trtpaged.models.quant)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"group_size: {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = in_features // group_size
        code_shape = (out_features, in_features // 2) if bits == 4 else (out_features, in_features)
        self.register_buffer("codes", torch.empty(code_shape, dtype=torch.uint8 if bits == 4 else torch.int8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("offsets", torch.empty(out_features, groups, dtype=torch.float32) if bits == 4 else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._compute_dtype = dtype
        self._op: Optional[Any] = None  # kernels.QLinearOp over the packed weight, made at first CPU call
        self.cuda_op: Optional[Any] = None  # qlinear_cuda's op, made at load on a CUDA device (or first call)
        self._dense: Optional[torch.Tensor] = None
        self.activations = "int8"  # how the CPU kernels treat x: "float" or "int8" (set_activations)

    @classmethod
    def from_weight(cls, weight: QuantizedWeight, bias: Optional[torch.Tensor],
                    dtype: torch.dtype) -> "QuantizedLinear":  # fmt: skip
        module = cls(weight.in_features, weight.out_features, weight.bits, weight.group_size, bias is not None, dtype)
        module.load_weight(weight, bias)
        return module

    def load_weight(self, weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> None:
        """Adopts a QuantizedWeight (and bias) as this module's buffers."""
        self.codes, self.scales, self.offsets = weight.codes, weight.scales, weight.offsets
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(self.bias.dtype if self.bias is not None else bias.dtype),
                                     requires_grad=False)
        self._op = self._dense = self.cuda_op = None

    @property
    def weight_q(self) -> QuantizedWeight:
        return QuantizedWeight(self.bits, self.group_size, self.codes, self.scales, self.offsets)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}, group={self.group_size}"

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """`row_invariant`: with float activations on the CPU kernels, each row's result is that of the row
        computed alone (the kernels' limbs at every row count, or their float tiles where one row takes them too;
        see LlamaStepModel.forward)."""
        if torch.compiler.is_exporting():
            raise RuntimeError(f"{self.extra_repr()}: export the TensorRT graph form (builder.tensorrt_graph."
                               "to_tensorrt_graph), not the engine layout")
        if x.is_cuda:
            op = self.cuda_op if self.cuda_op is not None else self.make_cuda_op(x.device)
            return op(x)
        if x.is_cpu and x.dtype is torch.float32 and self.in_features % 32 == 0:
            op = self._op if self._op is not None else self._make_op()
            if op is not None:
                x = x.contiguous()
                return op(x, self.activations == "float", row_invariant)
        if self._dense is None:
            self._dense = self.weight_q.dequantize(x.dtype)
        return F.linear(x, self._dense, self.bias)

    def make_cuda_op(self, device: torch.device) -> Any:
        """The op this module runs on `device` (models/qlinear_cuda.py), made once. Where it holds the weight
        in its own layout (int4: the kernel's packing), the engine layout's codes and scales move to the host
        (kept for state_dict and the de-quantized reference), so the device holds one copy."""
        from trtpaged.models.qlinear_cuda import Int4TinyGemmOp, make_cuda_op

        dtype = self.bias.dtype if self.bias is not None else self._compute_dtype
        self.cuda_op = make_cuda_op(self.weight_q, self.bias.detach() if self.bias is not None else None,
                                    torch.device(device), dtype)
        if isinstance(self.cuda_op, Int4TinyGemmOp):
            self.codes, self.scales, self.offsets = self.codes.cpu(), self.scales.cpu(), self.offsets.cpu()
        return self.cuda_op

    def cpu_op(self) -> Optional[Any]:
        """The kernels.QLinearOp this module runs on the CPU (packed at first use), or None where the
        kernel library lacks the kernels or in_features is not a multiple of 32."""
        if not self.runs_on_cpu_kernels():
            return None
        return self._op if self._op is not None else self._make_op()

    def runs_on_cpu_kernels(self) -> bool:
        """Whether a CPU call runs the kernel library's kernels (what `cpu_op` packs), without packing."""
        return self.in_features % 32 == 0 and _cpu_kernels() is not None

    def _make_op(self) -> Optional[Any]:
        """Packs the weight for the CPU kernels (once); None where the library lacks them."""
        kernels = _cpu_kernels()
        if kernels is None:
            return None
        packed = kernels.qlinear_pack(self.bits, self.codes, self.scales, self.offsets, self.group_size)
        bias = self.bias.detach() if self.bias is not None else None
        self._op = kernels.QLinearOp(packed, self.bits, self.out_features, self.in_features, self.group_size, bias=bias)
        return self._op


class QuantizedEmbedding(nn.Module):
    """A token embedding stored as int8 rows (scale per row or per group); also the tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.head = QuantizedLinear(embedding_dim, num_embeddings, 8, group_size, bias=False, dtype=dtype)

    def load_weight(self, weight: QuantizedWeight) -> None:
        if weight.bits != 8:
            raise ValueError(f"embedding: int{weight.bits} tables are not supported; embeddings are int8")
        self.head.load_weight(weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            raise RuntimeError("embedding: export the TensorRT graph form (a float table), not the int8 rows")
        head = self.head
        codes, scales = head.codes.index_select(0, input_ids), head.scales.index_select(0, input_ids)
        # the plain function, not the custom op: nothing traces this, and a custom op's first call imports
        # torch._dynamo (about 2 s of an engine's load)
        return dequantize(codes, scales, 8, head.group_size).to(self.dtype)

    def linear(self, h: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """h @ E^T: the tied LM head (`row_invariant` as QuantizedLinear.forward takes it)."""
        return self.head(h, row_invariant)
