"""trtpaged's own Llama-family step model (Llama, SmolLM2, Mistral, Qwen2).

One `forward` is one packed step of the engine I/O contract (DESIGN.md):
prefill chunks and decode tokens of many sequences together, each layer's
attention through the trtpaged paged-attention op, and only the
`logits_index` rows through the final norm and LM head.

Parameter names are the HF names without the leading `model.` (so HF weights
load with a prefix strip); a tied LM head has no parameter of its own and
reuses `embed_tokens.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtpaged.manifest import ModelDims
from trtpaged.models import attention_op  # noqa: F401  (registers torch.ops.trtpaged.*)
from trtpaged.models.rope import inv_frequencies, rotate


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as HF Llama does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables of the packed positions (computed in float32, cast to the model dtype)."""

    def __init__(self, dims: ModelDims):
        super().__init__()
        inv_freq, self.attention_scaling = inv_frequencies(dims.head_dim, dims.rope_theta, dims.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


class PagedSelfAttention(nn.Module):
    """q/k/v projections, RoPE, paged attention (writes this step's K/V), output projection."""

    def __init__(self, dims: ModelDims, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = dims.attention_bias
        self.q_proj = nn.Linear(dims.hidden_size, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(dims.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(dims.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, dims.hidden_size, bias=dims.o_proj_bias, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: "StepIndex",
        kv_cache: torch.Tensor,
        functional: bool,
        max_context_len: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if functional:
            out, kv_cache = torch.ops.trtpaged.paged_attention(
                q, k, v, kv_cache, *step,
                self.num_heads, self.num_kv_heads, self.head_dim, kv_cache.shape[4], self.layer, self.scale,
            )
        else:
            out = torch.ops.trtpaged.paged_attention_(q, k, v, kv_cache, *step, self.layer, self.scale, max_context_len)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim)), kv_cache


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dims: ModelDims, dtype: torch.dtype):
        super().__init__()
        h, i, bias = dims.hidden_size, dims.intermediate_size, dims.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, dims: ModelDims, layer: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.self_attn = PagedSelfAttention(dims, layer, dtype)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.mlp = SwiGLU(dims, dtype)

    def forward(self, h, cos, sin, step, kv_cache, functional, max_context_len):
        attn, kv_cache = self.self_attn(self.input_layernorm(h), cos, sin, step, kv_cache, functional, max_context_len)
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv_cache


# positions, query_start, context_lens, block_tables
StepIndex = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LlamaStepModel(nn.Module):
    """A Llama-family decoder whose forward is one packed, paged step.

    `functional_cache=False` (eager, the torch backend): the pool is updated in
    place and the very tensor passed in is returned. `functional_cache=True`
    (ONNX export): each layer returns an updated pool, so the graph is pure.
    """

    def __init__(self, dims: ModelDims, dtype: torch.dtype = torch.float32, functional_cache: bool = False):
        super().__init__()
        self.dims, self.dtype, self.functional_cache = dims, dtype, functional_cache
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(dims, i, dtype) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype)
        self.rotary = Rotary(dims)
        self.lm_head = (
            None if dims.tie_word_embeddings
            else nn.Linear(dims.hidden_size, dims.vocab_size, bias=False, dtype=dtype)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_start: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        logits_index: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: returns (logits float32 [num_outputs, vocab], kv_cache)."""
        h = self.embed_tokens(input_ids.long())
        cos, sin = self.rotary(positions, h.dtype)
        step = (positions, query_start, context_lens, block_tables)
        # once per step, not per layer: on CUDA the kernel would otherwise sync to find it in every layer
        # (not when exporting: the traced graph must not depend on the probe's values)
        max_context_len = None if self.functional_cache or not context_lens.numel() else int(context_lens.max())
        for layer in self.layers:
            h, kv_cache = layer(h, cos, sin, step, kv_cache, self.functional_cache, max_context_len)
        h = self.norm(h.index_select(0, logits_index.long()))
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, head).float(), kv_cache

    def new_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None, device="cpu"
    ) -> torch.Tensor:
        """A zeroed pool [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]."""
        d = self.dims
        shape = (num_blocks, d.num_layers, 2, d.num_kv_heads, block_size, d.head_dim)
        return torch.zeros(shape, dtype=dtype or self.dtype, device=device)
