"""A Llama model's decoder layers in one C call per step (trtpaged_llama_layers_cpu)."""

from __future__ import annotations

from typing import Sequence

import torch

from trtpaged.kernels._library import _DTYPE_CODES, _LlamaLayer, _QLinearWeight, _check, _dense_f32, library
from trtpaged.kernels.attention import AttentionStep
from trtpaged.kernels.qlinear import QLinearOp, activations_code


def has_llama_layers() -> bool:
    """True when the library has trtpaged_llama_layers_cpu (a step's decoder layers in one call)."""
    return hasattr(library(), "trtpaged_llama_layers_cpu")


class LlamaLayers:
    """A Llama model's decoder layers bound for trtpaged_llama_layers_cpu: weights described once,
    then one C call per step runs every layer (float32 CPU, quantized linears given as QLinearOps).

    `layers`: per layer (input_norm, post_attention_norm, (qkv, o, gate_up, down)), the norms float32
    [hidden] tensors and each linear a (QLinearOp, float_activations) pair; `scale`: the softmax scale.
    The tensors must not be
    modified or freed while this object lives (it keeps references). The layers are described twice: as
    given, and with float activations as limbs at every row count (`__call__`'s `limbs`).
    """

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[tuple[QLinearOp, bool]]]],
                 hidden: int, intermediate: int, eps: float, scale: float) -> None:  # fmt: skip
        self._fn = library().trtpaged_llama_layers_cpu
        self.hidden, self.intermediate, self.eps, self.scale = hidden, intermediate, eps, scale
        self._array = (_LlamaLayer * len(layers))()
        self._limb_array = (_LlamaLayer * len(layers))()
        self._keep: list[object] = []
        for i, (input_norm, post_norm, linears) in enumerate(layers):
            for name, t in (("input_norm", input_norm), ("post_attention_norm", post_norm)):
                _dense_f32(t, f"layers[{i}].{name}", (hidden,))
                setattr(self._array[i], name, t.data_ptr())
                setattr(self._limb_array[i], name, t.data_ptr())
                self._keep.append(t)
            for field, (op, float_activations) in zip(("qkv", "o", "gate_up", "down"), linears):
                packed, bits, n, k, group, bias = op._args
                for array, limbs in ((self._array, False), (self._limb_array, True)):
                    setattr(array[i], field, _QLinearWeight(packed, bias, n, k, bits, group,
                                                            activations_code(float_activations, limbs)))  # fmt: skip
                self._keep.append(op)

    def __call__(self, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: AttentionStep, limbs: bool = False) -> torch.Tensor:  # fmt: skip
        """Runs every layer: `stream` [rows, hidden] (the embeddings) becomes the residual stream in
        place; returns the last layer's MLP output (the final norm takes their sum). `limbs`: the float-
        activation linears take the limbs at every row count (each row computed as if alone)."""
        rows = attention.num_tokens
        _dense_f32(stream, "stream", (rows, self.hidden))
        head_dim = attention._params.head_dim
        _dense_f32(cos, "cos", (rows, head_dim))
        _dense_f32(sin, "sin", (rows, head_dim))
        if attention.device.type != "cpu":
            raise ValueError("attention: a CPU AttentionStep expected")
        params = attention._params
        params.io_dtype, params.scale = _DTYPE_CODES[torch.float32], self.scale
        last = torch.empty_like(stream)
        cache, positions, query_start, context_lens, block_tables = attention._pointers
        array = self._limb_array if limbs else self._array
        status = self._fn(array, len(array), self.hidden, self.intermediate, self.eps,
                          stream.data_ptr(), last.data_ptr(), cos.data_ptr(), sin.data_ptr(), attention._params_ref,
                          cache, positions, query_start, context_lens, block_tables)  # fmt: skip
        if status:
            _check("llama_layers", status)
        return last
