"""The KV cache formats, one row per `kv_cache_dtype`: the one table manifest, config, kernels, codec, runners,
benchmarks and the build read (the plugin's `kv_cache_dtype` field spells the quantized names the same way,
plugins/src/tensorrt/fields.cpp; the compile stage keeps its own list of the formats TensorRT engines take,
`builder.compile.TENSORRT_KV_CACHE_DTYPES`).

A float format stores head_dim values per token row of one head; a quantized one stores head_dim
one-byte codes followed by the row's fp16 scale (`trtpaged.kv_quant`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVFormat:
    """One `kv_cache_dtype`: how a token row of one head is stored."""

    name: str
    element_bytes: int  # bytes per value (float) or per code (quantized)
    scale_bytes: int  # bytes of the row's scale after the codes (0: a float format)
    abi_code: int  # its `trtpaged_dtype` in the C ABI (plugins/include/trtpaged/trtpaged.h)

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def row_elements(self, head_dim: int) -> int:
        """Elements in the pool's last dimension: head_dim, plus the scale's bytes when quantized."""
        return head_dim + self.scale_bytes if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) for one head."""
        return head_dim * self.element_bytes + self.scale_bytes


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float32", 4, 0, 0),
    KVFormat("float16", 2, 0, 1),
    KVFormat("bfloat16", 2, 0, 2),
    KVFormat("int8", 1, 2, 3),
    KVFormat("fp8_e4m3", 1, 2, 4),
)}
KV_CACHE_DTYPES = tuple(KV_FORMATS)
FLOAT_KV_CACHE_DTYPES = tuple(name for name, f in KV_FORMATS.items() if not f.quantized)
QUANTIZED_KV_CACHE_DTYPES = tuple(name for name, f in KV_FORMATS.items() if f.quantized)
SCALE_BYTES = KV_FORMATS["int8"].scale_bytes  # every quantized format's: one fp16 per row


def kv_format(name: str) -> KVFormat:
    """The format named `name`; ValueError naming the allowed ones otherwise."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: got {name!r}; allowed: {', '.join(KV_CACHE_DTYPES)}") from None
