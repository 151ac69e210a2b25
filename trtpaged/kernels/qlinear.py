"""Weight-only quantized linear (CPU): packing a weight (qlinear_pack), one call (qlinear) and a
linear bound to one packed weight (QLinearOp)."""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional

import torch

from trtpaged.kernels._library import _check, _require, library


def qlinear_packed_bytes(bits: int, n: int, k: int, group_size: int) -> int:
    """Bytes of the kernel's packed form of an [n, k] weight."""
    size = ctypes.c_size_t()
    _check("qlinear_packed_bytes", library().trtpaged_qlinear_packed_bytes(bits, n, k, group_size, ctypes.byref(size)))
    return size.value


def qlinear_pack(
    bits: int, codes: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor], group_size: int
) -> torch.Tensor:
    """Packs a quantized weight W[n, k] = scales[n, k // G] * codes[n, k] + offsets[n, k // G] for qlinear.

    bits 8: codes int8 [n, k], offsets None. bits 4: codes uint8 [n, k // 2] holding two codes
    0..15 per byte (k = 2j in the low nibble, 2j + 1 in the high), offsets float32 [n, k // G].
    scales float32 [n, k // G]; scale and offset values must be exactly representable in fp16.
    Returns a 64-byte aligned uint8 CPU tensor.
    """
    cpu = torch.device("cpu")
    if bits not in (4, 8):
        raise ValueError(f"bits: {bits} not supported (4 or 8)")
    code_dtype = torch.int8 if bits == 8 else torch.uint8
    _require(codes, "codes", ndim=2, dtypes=(code_dtype,), device=cpu)
    _require(scales, "scales", ndim=2, dtypes=(torch.float32,), device=cpu)
    n = codes.shape[0]
    k = codes.shape[1] * (1 if bits == 8 else 2)
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size: {group_size} does not divide k = {k}")
    groups = (n, k // group_size)
    if tuple(scales.shape) != groups:
        raise ValueError(f"scales: shape {tuple(scales.shape)}, expected {groups} (n, k // group_size)")
    if bits == 4:
        if offsets is None:
            raise ValueError("offsets: required for bits 4")
        _require(offsets, "offsets", ndim=2, dtypes=(torch.float32,), device=cpu)
        if tuple(offsets.shape) != groups:
            raise ValueError(f"offsets: shape {tuple(offsets.shape)}, expected {groups} (n, k // group_size)")
    elif offsets is not None:
        raise ValueError("offsets: must be None for bits 8")
    size = qlinear_packed_bytes(bits, n, k, group_size)
    raw = torch.empty(size + 64, dtype=torch.uint8)
    start = -raw.data_ptr() % 64
    packed = raw[start : start + size]
    status = library().trtpaged_qlinear_pack(
        bits, n, k, group_size, codes.data_ptr(), scales.data_ptr(),
        offsets.data_ptr() if offsets is not None else None, packed.data_ptr(),
    )  # fmt: skip
    _check("qlinear_pack", status)
    return packed


QLINEAR_INT8_ACTIVATIONS = 0  # TRTPAGED_QLINEAR_INT8_ACTIVATIONS
QLINEAR_FLOAT_ACTIVATIONS = 1  # TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS
QLINEAR_FLOAT_LIMB_ACTIVATIONS = 2  # TRTPAGED_QLINEAR_FLOAT_LIMB_ACTIVATIONS


def activations_code(float_activations: bool, limbs: bool) -> int:
    """The C `activations` value: int8, float (limbs or float tiles by the row count), or float as limbs at
    every row count (each row's result that of the row run alone)."""
    if not float_activations:
        return QLINEAR_INT8_ACTIVATIONS
    return QLINEAR_FLOAT_LIMB_ACTIVATIONS if limbs else QLINEAR_FLOAT_ACTIVATIONS


@functools.lru_cache(maxsize=None)
def _qlinear_call(bits: int, n: int, k: int, group_size: int) -> tuple[int, Callable[..., int]]:
    """(packed bytes, the C function) for one weight shape: validated once, then a dict lookup per call."""
    return qlinear_packed_bytes(bits, n, k, group_size), library().trtpaged_qlinear_cpu_ex


def qlinear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    n: int,
    k: int,
    group_size: int,
    bias: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    float_activations: bool = False,
    limbs: bool = False,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a weight packed by qlinear_pack; x float32 [..., k] on the CPU.

    float_activations=False quantizes x to int8 per block of 32 (integer dot products, fastest
    for many rows); True keeps x in float32 (exact de-quantized weights, fp32 FMA: as accurate
    as F.linear on them, about as fast at a few rows). With float activations, one row runs as int8
    limbs and several as float tiles, which round differently; `limbs=True` takes the limbs at every
    row count, so each row's result is bit-identical to that row run alone (plain AVX2 runs int8
    weights as float tiles at every row count, which gives the same). Returns out (float32
    [..., n], allocated when None). For repeated calls on one weight, QLinearOp checks its arguments once.
    """
    packed_bytes, fn = _qlinear_call(bits, n, k, group_size)
    if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(
            f"x: expected a contiguous float32 CPU tensor [..., k = {k}], got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if packed.dtype is not torch.uint8 or not packed.is_cpu or packed.dim() != 1 or packed.numel() != packed_bytes:
        raise ValueError(f"packed: expected the 1-D uint8 CPU tensor of {packed_bytes} bytes qlinear_pack returns "
                         f"for this shape, got {packed.dtype} {tuple(packed.shape)} on {packed.device}")
    m = x.numel() // k
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32)
    elif out.dtype is not torch.float32 or not out.is_cpu or not out.is_contiguous() or out.numel() != m * n:
        raise ValueError(f"out: expected a contiguous float32 CPU tensor of {m * n} elements")
    if bias is not None and (
        bias.dtype is not torch.float32 or not bias.is_cpu or bias.shape != (n,) or not bias.is_contiguous()
    ):
        raise ValueError(f"bias: expected a contiguous float32 CPU tensor of shape ({n},)")
    status = fn(x.data_ptr(), m, packed.data_ptr(), bits, n, k, group_size,
                bias.data_ptr() if bias is not None else None, out.data_ptr(),
                activations_code(float_activations, limbs))  # fmt: skip
    if status:
        _check("qlinear", status)
    return out


class QLinearOp:
    """qlinear bound to one packed weight (and bias): everything about the weight is checked once,
    so a call checks only x (dtype, device, contiguity, last dim) before the C call.

    Holds references to packed and bias, which must not be modified in place afterwards.
    """

    __slots__ = ("packed", "bias", "n", "k", "_fn", "_args")

    def __init__(self, packed: torch.Tensor, bits: int, n: int, k: int, group_size: int,
                 bias: Optional[torch.Tensor] = None) -> None:  # fmt: skip
        packed_bytes, fn = _qlinear_call(bits, n, k, group_size)
        if packed.dtype is not torch.uint8 or not packed.is_cpu or packed.dim() != 1 or packed.numel() != packed_bytes:
            raise ValueError(
                f"packed: expected the 1-D uint8 CPU tensor of {packed_bytes} bytes returned by qlinear_pack"
            )
        if bias is not None and (
            bias.dtype is not torch.float32 or not bias.is_cpu or bias.shape != (n,) or not bias.is_contiguous()
        ):
            raise ValueError(f"bias: expected a contiguous float32 CPU tensor of shape ({n},)")
        self.packed, self.bias, self.n, self.k, self._fn = packed, bias, n, k, fn
        self._args = (packed.data_ptr(), bits, n, k, group_size, bias.data_ptr() if bias is not None else None)

    def __call__(self, x: torch.Tensor, float_activations: bool = False, limbs: bool = False) -> torch.Tensor:
        """y = x @ W^T (+ bias), float32 [..., n], for x float32 [..., k] contiguous on the CPU (activations
        as `qlinear` takes them)."""
        k = self.k
        if x.dtype is not torch.float32 or not x.is_cpu or not x.is_contiguous() or x.dim() == 0 or x.shape[-1] != k:
            raise ValueError(
                f"x: expected a contiguous float32 CPU tensor [..., k = {k}], "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        out = x.new_empty(x.shape[:-1] + (self.n,))  # float32 CPU, as x
        packed, bits, n, _, group, bias = self._args
        status = self._fn(x.data_ptr(), x.numel() // k, packed, bits, n, k, group, bias, out.data_ptr(),
                          activations_code(float_activations, limbs))  # fmt: skip
        if status:
            _check("qlinear", status)
        return out
