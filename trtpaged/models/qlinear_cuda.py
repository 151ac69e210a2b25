"""Weight-only quantized linears on a CUDA device (the torch backend): the weights stay quantized there.

- int4 (any group 32/64/128): PyTorch's own weight-only int4 GEMM, `torch._weight_int4pack_mm`
  (the "tinygemm" kernel that torchao's int4 weight-only and gpt-fast use, maintained in PyTorch,
  sm_80+). Our W = s * q + o (q = 0..15) is its W = (q - 8) * s + z with z = o + 8 * s, exactly
  in real numbers; s and z are held in bf16 (the kernel's type) and x runs in bf16, so the result
  is within bf16 rounding of the de-quantized reference, not bit-exact. The weight is packed once
  into the kernel's layout (`torch._convert_weight_to_int4pack`, uint8 [N, K/2] input, torch >= 2.5);
  the engine layout's codes then leave the device (they stay on the host for state_dict).
- int8 (per channel, or per group as GGUF Q8_0): the codes stay int8 on the device and each call
  de-quantizes one weight into a transient in the compute dtype for cuBLAS. PyTorch's CUDA
  `_weight_int8pack_mm` was read and not taken: a one-warp-per-output float32-only kernel,
  far from cuBLAS at batch 64, and no group scales.

Which is faster than the fp16 engine at batch 1 and 64 is a GPU measurement (scripts/gpu_check.sh's
throughput table); without a GPU this is chosen by what each kernel is, and the choice is one place
(`make_cuda_op`). Where the int4 kernel refuses a shape or torch lacks it, the int4 weight takes the
int8 path's per-call de-quantization, and `reason` says why.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from trtpaged.models.quant import QuantizedWeight

INT4_GROUPS = (32, 64, 128, 256)  # tinygemm's qGroupSize values
_INNER_K_TILES = (8, 4, 2)


def _inner_k_tiles(k: int) -> Optional[int]:
    return next((t for t in _INNER_K_TILES if k % (t * 16) == 0), None)


def int4_kernel_reason(weight: QuantizedWeight) -> Optional[str]:
    """Why torch's int4 GEMM cannot take this weight (None when it can)."""
    if not hasattr(torch, "_weight_int4pack_mm") or not hasattr(torch, "_convert_weight_to_int4pack"):
        return "this torch has no _weight_int4pack_mm"
    if weight.group_size not in INT4_GROUPS:
        return f"group {weight.group_size} (the kernel takes {', '.join(map(str, INT4_GROUPS))})"
    if weight.out_features % 8:
        return f"out_features {weight.out_features} is not a multiple of 8"
    if _inner_k_tiles(weight.in_features) is None:
        return f"in_features {weight.in_features} is not a multiple of 32"
    return None


class DequantizingOp:
    """y = x @ (codes * scales (+ offsets))^T + b, de-quantized per call into x's dtype (codes stay quantized)."""

    kind = "dequantize per call"

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor], device: torch.device,
                 dtype: torch.dtype, reason: Optional[str] = None) -> None:
        self.bits, self.group_size = weight.bits, weight.group_size
        # the module's own tensors where they are on the device already (no second copy)
        self.codes = weight.codes.to(device)
        self.scales = weight.scales.to(device)
        self.offsets = weight.offsets.to(device) if weight.offsets is not None else None
        self.bias = bias.to(device) if bias is not None else None
        self.reason = reason

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        from trtpaged.models.quant import unpack_int4

        q = unpack_int4(self.codes) if self.bits == 4 else self.codes
        n, k = q.shape
        g = self.group_size
        w = q.view(n, k // g, g).to(dtype) * self.scales.to(dtype)[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets.to(dtype)[:, :, None]
        return w.view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets, self.bias)
                   if t is not None)


class Int4TinyGemmOp:
    """y = x @ W^T + b through torch._weight_int4pack_mm (bf16 activations, bf16 scales and zeros)."""

    kind = "torch._weight_int4pack_mm"
    reason = None

    def __init__(self, weight: QuantizedWeight, bias: Optional[torch.Tensor], device: torch.device) -> None:
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.group_size = weight.group_size
        q = weight.int_codes().to(torch.uint8)  # [N, K], 0..15
        high_first = (q[:, 0::2] << 4) | q[:, 1::2]  # the kernel's uint8 [N, K/2]: element 2i in the high nibble
        self.packed = torch._convert_weight_to_int4pack(high_first.to(device), _inner_k_tiles(self.in_features))
        scales = weight.scales.to(torch.float32)
        zeros = weight.offsets.to(torch.float32) + 8 * scales  # (q - 8) * s + z = s * q + o
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(device, torch.bfloat16).contiguous()
        self.bias = bias.to(device) if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros).to(x.dtype)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.bias)
                   if t is not None)


def make_cuda_op(weight: QuantizedWeight, bias: Optional[torch.Tensor], device: torch.device, dtype: torch.dtype):
    """The op a quantized linear runs on `device` (the choice described in the module docstring)."""
    if weight.bits == 4:
        reason = int4_kernel_reason(weight)
        if reason is None:
            try:
                return Int4TinyGemmOp(weight, bias, device)
            except RuntimeError as e:  # e.g. a GPU below sm_80, an older packing format
                reason = f"torch._convert_weight_to_int4pack: {str(e).splitlines()[0]}"
        return DequantizingOp(weight, bias, device, dtype, f"int4 kernel not used: {reason}")
    return DequantizingOp(weight, bias, device, dtype)


def cuda_weight_bytes(header: dict, plan: dict[str, tuple[int, int]]) -> int:
    """Bytes the CUDA torch backend holds for the weights of a safetensors header ({name: entry with .shape and
    .start/.end}) and quantization plan ({module: (bits, group)}): int4 codes as packed (the same bytes in
    tinygemm's layout) with bf16 (scale, zero) pairs in place of float32 scales and offsets (the int4 kernel
    taking every int4 weight); int8 codes and scales and the rest as stored."""
    total = 0
    for name, entry in header.items():
        module, _, kind = name.rpartition(".")
        bits = plan.get(module, plan.get(module.removesuffix(".head"), (None, None)))[0]
        if bits == 4 and kind == "scales":
            total += entry.shape[0] * entry.shape[1] * 2 * 2
        elif not (bits == 4 and kind == "offsets"):  # int4 offsets are folded into the zeros
            total += entry.end - entry.start
    return total
