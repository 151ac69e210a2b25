"""trtpaged's own Llama-family step model (Llama, SmolLM2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3).

The families differ from Llama in a few switches of ModelDims (models/dims.py maps each HF config):
per-layer sliding windows, q/k norms, layers without RoPE, partial rotary, GeGLU, Gemma's (1 + w)
norms around attention and MLP, embedding scale and logit soft-caps.

One `forward` is one packed step of the engine I/O contract (docs/architecture.md):
prefill chunks and decode tokens of many sequences together, each layer's
attention through the trtpaged paged-attention op, and only the
`logits_index` rows through the final norm and LM head.

Parameter names are the HF names without the leading `model.` (so HF weights
load with a prefix strip); a tied LM head has no parameter of its own and
reuses `embed_tokens.weight`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from trtpaged import kv_pool_memory, kv_quant
from trtpaged.attention_options import AttentionOptions
from trtpaged.manifest import ModelDims
from trtpaged.models import attention_op  # noqa: F401  (registers torch.ops.trtpaged.*)
from trtpaged.models.all_reduce import RankReduce
from trtpaged.models.execution_plan import ExecutionPlan, c_layers_blocker, decide_execution_plan
from trtpaged.models.qlinear import QuantizedEmbedding, QuantizedLinear
from trtpaged.models.rope import inv_frequencies, rotate

# module name (e.g. "layers.0.self_attn.qkv_proj", "embed_tokens", "lm_head") -> (bits, group_size)
QuantPlan = dict[str, tuple[int, int]]


def make_linear(name: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                quant: Optional[QuantPlan]) -> nn.Module:
    """nn.Linear, or QuantizedLinear where the quantization plan names the module."""
    scheme = (quant or {}).get(name)
    if scheme is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    bits, group_size = scheme
    return QuantizedLinear(in_features, out_features, bits, group_size, bias, dtype)


def project(linear: nn.Module, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
    """linear(x); a quantized linear computes each row as if alone when `row_invariant` (LlamaStepModel.forward)."""
    return linear(x, row_invariant) if row_invariant and isinstance(linear, QuantizedLinear) else linear(x)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as HF Llama does; `gemma`: scaled by (1 + weight) in float32,
    then cast, as HF Gemma does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == self.weight.dtype == torch.float32 and not torch.compiler.is_exporting():
            # the same float32 arithmetic in one op (a third faster eagerly); the exported graph keeps the
            # explicit form
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # no cast where x is float32 already: each would be two more nodes per norm for the exporter to trace
        h = x if x.dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))

    def kernel_weight(self) -> torch.Tensor:
        """The weight the rmsnorm kernel scales by: Gemma's (1 + weight), in float32 as its forward computes it."""
        return 1.0 + self.weight if self.gemma else self.weight

    def forward_fused(self, x: torch.Tensor, residual: Optional[torch.Tensor], ops: ModuleType):
        """One kernel call: rmsnorm(x), or (rmsnorm(x + residual), x + residual) written into residual."""
        return ops.rmsnorm(x, self.kernel_weight(), self.eps, residual)


class Rotary(nn.Module):
    """cos/sin tables of the packed positions (angles in float32, cast to the model dtype).

    `local`: the table of windowed layers where the model gives them their own RoPE base (Gemma 3)."""

    def __init__(self, dims: ModelDims, local: bool = False):
        super().__init__()
        rotary_dim = int(dims.head_dim * dims.partial_rotary_factor)
        if local:
            inv_freq, self.attention_scaling = inv_frequencies(rotary_dim, dims.local_rope_theta, None,
                                                               theta_name="local_rope_theta")
        else:
            inv_freq, self.attention_scaling = inv_frequencies(rotary_dim, dims.rope_theta, dims.rope_scaling,
                                                               dims.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if torch.compiler.is_exporting() or freqs.device.type != "cpu":
            cos, sin = freqs.cos(), freqs.sin()
        else:  # correctly rounded, as the C runtime's libm gives them (torch's float32 cos/sin: 5% of them 1 ulp off,
            # which int8 activations can turn into different tokens)
            wide = freqs.double()
            cos, sin = wide.cos().float(), wide.sin().float()
        # each half of head_dim takes the same angles: computed once, then repeated
        cos = torch.cat((cos, cos), dim=-1) * self.attention_scaling
        sin = torch.cat((sin, sin), dim=-1) * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


class PagedSelfAttention(nn.Module):
    """Fused q/k/v projection, RoPE, paged attention (writes this step's K/V), output projection.

    `qkv_proj` holds HF's q_proj, k_proj and v_proj stacked along the outputs (one matmul, not three).
    With tensor parallelism (`reduce`), dims are one rank's and `o_proj`'s partial output is all-reduced.
    """

    def __init__(self, dims: ModelDims, layer: int, dtype: torch.dtype, quant: Optional[QuantPlan] = None,
                 reduce: Optional[RankReduce] = None):
        super().__init__()
        self.layer, self.reduce = layer, reduce
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.scale = dims.attention_scale or self.head_dim**-0.5
        self.window, self.softcap = dims.window_of(layer), dims.attn_logit_softcap
        self.options = AttentionOptions(layer, self.scale, self.window, self.softcap)
        self.rope = layer not in dims.nope_layers
        self.partial_rotary = dims.partial_rotary_factor != 1.0
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        prefix = f"layers.{layer}.self_attn."
        self.qkv_proj = make_linear(prefix + "qkv_proj", dims.hidden_size, self.q_size + 2 * self.kv_size,
                                    dims.attention_bias, dtype, quant)
        self.o_proj = make_linear(prefix + "o_proj", self.q_size, dims.hidden_size, dims.o_proj_bias, dtype, quant)
        self.q_norm = RMSNorm(self.head_dim, dims.rms_norm_eps, dtype, dims.gemma_norms) if dims.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, dims.rms_norm_eps, dtype, dims.gemma_norms) if dims.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: "StepIndex",
        kv_cache: torch.Tensor,
        attend: Optional[Callable[..., torch.Tensor]],
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attend: the step's eager attention (attention_op.eager_attention), or attention_op.Functional
        for the functional op (export)."""
        q, k, v = self._heads(project(self.qkv_proj, x, row_invariant))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, k, cos, sin)
        if isinstance(attend, attention_op.Functional):
            out, kv_cache = torch.ops.trtpaged.paged_attention(
                q, k, v, kv_cache, *step,
                self.num_heads, self.num_kv_heads, self.head_dim, kv_cache.shape[4], self.layer, self.scale,
                attend.kv_cache_dtype, self.window, self.softcap,
            )
        else:
            out = attend(q, k, v, self.options)
        return self._output(out.reshape(-1, self.num_heads * self.head_dim), row_invariant), kv_cache

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] of the fused projection's rows (v dense: the kernel takes it)."""
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        return q, k, v.contiguous().view(-1, self.num_kv_heads, self.head_dim)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if self.rope:
            return rotate(q, cos, sin), rotate(k, cos, sin)
        return q.contiguous(), k.contiguous()

    def _norm_heads_fused(self, qkv: torch.Tensor, ops: ModuleType) -> None:
        """q_norm and k_norm on qkv's heads in place, each head a row of the rmsnorm kernel (as the C runtime
        calls it, so that both give the same bits)."""
        assert self.q_norm is not None and self.k_norm is not None
        for start, size, norm in ((0, self.q_size, self.q_norm), (self.q_size, self.kv_size, self.k_norm)):
            slot = qkv[:, start : start + size]
            # dense: a copy, or with one row a view of qkv (one head over several rows: a strided view, copied)
            heads = slot.reshape(-1, self.head_dim).contiguous()
            ops.rmsnorm(heads, norm.kernel_weight(), norm.eps, out=heads)
            if heads.data_ptr() != slot.data_ptr():  # a copy: written back
                slot.copy_(heads.view(-1, size))

    def _output(self, out: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        y = project(self.o_proj, out, row_invariant)
        return y if self.reduce is None else self.reduce(y)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attend: Callable[..., torch.Tensor], ops: ModuleType,
                      row_invariant: bool = False) -> torch.Tensor:  # fmt: skip
        """The eager float32 CPU form of forward: RoPE and the dense q/k/v copies in one kernel call (a layer without
        RoPE: with the tables of no rotation, cos 1 and sin 0, which copy q and k exactly). Partial rotary, which the
        kernel does not do (it rotates whole heads), takes torch's element-wise ops, each exactly rounded, as the C
        runtime's loop is."""
        qkv = project(self.qkv_proj, x, row_invariant)
        if self.q_norm is not None and self.k_norm is not None:
            self._norm_heads_fused(qkv, ops)
        if self.partial_rotary:
            q, k, v = self._heads(qkv)
            q, k = self._rotate(q, k, cos, sin)
        else:
            if not self.rope:
                cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
            q, k, v = ops.rope_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, dense=True)
        out = attend(q, k, v, self.options)
        return self._output(out.view(-1, self.num_heads * self.head_dim), row_invariant)


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-GELU (Gemma's GeGLU); `gate_up_proj` holds HF's
    gate_proj and up_proj stacked along the outputs.

    With tensor parallelism (`reduce`), `down_proj`'s partial output is all-reduced."""

    def __init__(self, dims: ModelDims, layer: int, dtype: torch.dtype, quant: Optional[QuantPlan] = None,
                 reduce: Optional[RankReduce] = None):
        super().__init__()
        self.reduce, self.act = reduce, dims.hidden_act
        h, self.intermediate, bias = dims.hidden_size, dims.intermediate_size, dims.mlp_bias
        prefix = f"layers.{layer}.mlp."
        self.gate_up_proj = make_linear(prefix + "gate_up_proj", h, 2 * self.intermediate, bias, dtype, quant)
        self.down_proj = make_linear(prefix + "down_proj", self.intermediate, h, bias, dtype, quant)

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, row_invariant).split(self.intermediate, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else F.silu(gate)
        return self._down(gate * up, row_invariant)

    def forward_fused(self, x: torch.Tensor, ops: ModuleType, row_invariant: bool = False) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, row_invariant)
        if self.act == "silu":
            return self._down(ops.silu_mul(gate_up), row_invariant)
        # tanh GELU computed in float64 and rounded once, as the C runtime computes it: in float32, torch's vectorized
        # tanh and libm's differ in the last bit now and then, which int8 activations round into other codes
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self._down(F.gelu(gate.double(), approximate="tanh").float() * up, row_invariant)

    def _down(self, x: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        y = project(self.down_proj, x, row_invariant)
        return y if self.reduce is None else self.reduce(y)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, dims: ModelDims, layer: int, dtype: torch.dtype, quant: Optional[QuantPlan] = None,
                 reduce: Optional[RankReduce] = None):
        super().__init__()
        gemma = dims.gemma_norms
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, gemma)
        self.self_attn = PagedSelfAttention(dims, layer, dtype, quant, reduce)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, gemma)
        self.mlp = SwiGLU(dims, layer, dtype, quant, reduce)
        # Gemma 2/3: post_attention_layernorm normalizes the attention output, and the MLP has its own pre/post norms
        self.pre_feedforward_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, gemma) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, gemma) if gemma else None
        # which cos/sin table the layer rotates with: windowed layers of a model with a local RoPE base have their own
        self.rope_table = "local" if dims.local_rope_theta and dims.window_of(layer) else "global"

    def forward(self, h, cos, sin, step, kv_cache, attend, row_invariant: bool = False):
        attn, kv_cache = self.self_attn(self.input_layernorm(h), cos, sin, step, kv_cache, attend, row_invariant)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h = h + self.post_attention_layernorm(attn)
            mlp = self.mlp(self.pre_feedforward_layernorm(h), row_invariant)
            return h + self.post_feedforward_layernorm(mlp), kv_cache
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h), row_invariant)
        return h, kv_cache

    def forward_fused(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos: torch.Tensor,
                      sin: torch.Tensor, attend: Callable[..., torch.Tensor], ops: ModuleType,
                      row_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager float32 CPU form of forward, with the residual adds inside the norms: takes and
        returns (block output, residual stream), the stream being h + residual (just h when residual is
        None, at the first layer). The stream tensor is updated in place."""
        if residual is None:
            x, residual = self.input_layernorm.forward_fused(h, None, ops), h
        else:
            x, residual = self.input_layernorm.forward_fused(h, residual, ops)
        attn = self.self_attn.forward_fused(x, cos, sin, attend, ops, row_invariant)
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:  # Gemma
            attn = self.post_attention_layernorm.forward_fused(attn, None, ops)
            x, residual = self.pre_feedforward_layernorm.forward_fused(attn, residual, ops)
            mlp = self.mlp.forward_fused(x, ops, row_invariant)
            return self.post_feedforward_layernorm.forward_fused(mlp, None, ops), residual
        x, residual = self.post_attention_layernorm.forward_fused(attn, residual, ops)
        return self.mlp.forward_fused(x, ops, row_invariant), residual


# positions, query_start, context_lens, block_tables
StepIndex = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LlamaStepModel(nn.Module):
    """A Llama-family decoder whose forward is one packed, paged step.

    `functional_cache=False` (eager, the torch backend): the pool is updated in
    place and the very tensor passed in is returned. `functional_cache=True`
    (ONNX export): each layer returns an updated pool, so the graph is pure.
    `graph_kv_cache_dtype` ("int8" or "fp8_e4m3", set by the export) names the format of
    an int8-byte pool in the functional form; None: the pool's own dtype says.

    Tensor parallelism: `dims` are one rank's (models/tensor_parallel.py:
    shard_dims) and `reduce` sums the row-parallel layers' partial outputs over
    the ranks; the embedding, norms and LM head are whole on every rank.

    Eager steps run the way `execution_plan` says (models/execution_plan.py); a runner
    sets it when it loads the model, else the first eager step decides it.
    """

    def __init__(self, dims: ModelDims, dtype: torch.dtype = torch.float32, functional_cache: bool = False,
                 quant: Optional[QuantPlan] = None, reduce: Optional[RankReduce] = None):
        super().__init__()
        self.dims, self.dtype, self.functional_cache, self.reduce = dims, dtype, functional_cache, reduce
        self.graph_kv_cache_dtype: Optional[str] = None
        self.quant: QuantPlan = dict(quant or {})
        embed_scheme = self.quant.get("embed_tokens")
        self.embed_tokens: nn.Module = (
            nn.Embedding(dims.vocab_size, dims.hidden_size, dtype=dtype) if embed_scheme is None
            else QuantizedEmbedding(dims.vocab_size, dims.hidden_size, embed_scheme[1], dtype)
        )
        self.layers = nn.ModuleList(DecoderLayer(dims, i, dtype, self.quant, reduce) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, dims.gemma_norms)
        self.rotary = Rotary(dims)
        self.local_rotary = Rotary(dims, local=True) if dims.local_rope_theta else None
        self.execution_plan: Optional[ExecutionPlan] = None
        self._layer_runner: Optional[Any] = None  # kernels.LlamaLayers under a c_layers plan
        self.lm_head = (
            None if dims.tie_word_embeddings
            else make_linear("lm_head", dims.hidden_size, dims.vocab_size, False, dtype, self.quant)
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
        row_invariant: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: returns (logits float32 [num_outputs, vocab], kv_cache).

        `row_invariant`: the quantized linears with float activations (and the LM head) compute each row as a
        step of that row alone would. The CPU kernels run one row as int8 limbs and several as float tiles,
        which round differently; this takes the limbs at every row count (where one row runs as float tiles too,
        plain AVX2 int8 weights, the float tiles). The runtime sets it for a step
        that decodes one sequence, so that a speculative verification step gives each row the logits of a
        plain decode step (docs/speculative.md). Other steps (and int8-activation engines, whose rows never
        depend on the others) are unaffected.
        """
        h = self.embed_tokens(input_ids.long())
        if self.dims.embed_scale != 1.0:  # Gemma: the normalizer rounded to the activations' dtype, as HF does
            h = h * torch.tensor(self.dims.embed_scale, dtype=h.dtype)
        tables = {"global": self.rotary(positions, h.dtype)}
        if self.local_rotary is not None:
            tables["local"] = self.local_rotary(positions, h.dtype)
        step = (positions, query_start, context_lens, block_tables)
        if self.functional_cache:
            pool_format = self.graph_kv_cache_dtype or kv_quant.pool_kv_cache_dtype(kv_cache) or "auto"
            attend = attention_op.Functional(pool_format)
            return self._torch_layers(h, tables, step, logits_index, kv_cache, attend, row_invariant)
        cos, sin = tables["global"]
        plan = self.execution_plan or self._decide_execution_plan()
        # once per step, not per layer: on CUDA the kernel would otherwise sync to find it in every layer
        max_context_len = int(context_lens.max()) if context_lens.numel() else 0
        attend = attention_op.eager_attention(kv_cache, positions, query_start, context_lens, block_tables,
                                              self.dims.num_heads, max_context_len, plan.attention == "reference")
        if plan.layers == "torch" or torch.compiler.is_exporting():
            return self._torch_layers(h, tables, step, logits_index, kv_cache, attend, row_invariant)
        from trtpaged import kernels as ops

        # h is this step's fresh embedding output: the fused layers may update it in place
        residual = None
        if self._layer_runner is not None:
            h, residual = self._layer_runner(h, cos, sin, attend, row_invariant), h
        else:
            for layer in self.layers:
                h, residual = layer.forward_fused(h, residual, *tables[layer.rope_table], attend, ops, row_invariant)
        rows = logits_index.long()
        if residual is None:  # no layers
            h = self.norm.forward_fused(h.index_select(0, rows), None, ops)
        else:
            h, _ = self.norm.forward_fused(h.index_select(0, rows), residual.index_select(0, rows), ops)
        return self._head(h, row_invariant).float(), kv_cache

    def _torch_layers(self, h, tables, step, logits_index, kv_cache, attend,
                      row_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        for layer in self.layers:
            h, kv_cache = layer(h, *tables[layer.rope_table], step, kv_cache, attend, row_invariant)
        h = self.norm(h.index_select(0, logits_index.long()))
        return self._head(h, row_invariant).float(), kv_cache

    def _decide_execution_plan(self) -> ExecutionPlan:
        self.set_execution_plan(decide_execution_plan(self))
        assert self.execution_plan is not None
        return self.execution_plan

    def set_execution_plan(self, plan: Optional[ExecutionPlan]) -> None:
        """Runs the following eager steps as `plan` says (None: decide again at the next step). Also call it
        again with the same plan after the quantized linears' modes change (qlinear.set_activations): the
        one-call runner holds the modes it was built with."""
        self._layer_runner = None
        if plan is not None and plan.layers == "c_layers":
            blocker = c_layers_blocker(self) or ("the one-call runner needs the kernels' attention"
                                                 if plan.attention != "kernels" else None)
            if blocker is not None:
                raise ValueError(f"execution plan c_layers: {blocker}")
            self._layer_runner = self._build_layer_runner()
        self.execution_plan = plan

    def _build_layer_runner(self) -> Any:
        from trtpaged import kernels

        described = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
            described.append((*norms, [(m.cpu_op(), m.activations == "float") for m in linears]))
        return kernels.LlamaLayers(described, self.dims.hidden_size, self.dims.intermediate_size,
                                   self.layers[0].input_layernorm.eps, self.layers[0].self_attn.scale)

    def _head(self, h: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        if self.lm_head is not None:
            logits = project(self.lm_head, h, row_invariant)
        elif isinstance(self.embed_tokens, QuantizedEmbedding):
            logits = self.embed_tokens.linear(h, row_invariant)
        else:
            logits = F.linear(h, self.embed_tokens.weight)
        cap = self.dims.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def new_kv_cache(
        self, num_kv_blocks: int, block_size: int, dtype: torch.dtype | str | None = None, device="cpu"
    ) -> torch.Tensor:
        """A zeroed pool [num_kv_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]; dtype "int8" or
        "fp8_e4m3" gives a quantized pool (rows of head_dim + 2 bytes, trtpaged.kv_quant). On the CPU its
        memory is advised for huge pages (trtpaged.kv_pool_memory)."""
        d = self.dims
        if isinstance(dtype, str) and kv_quant.is_quantized(dtype):
            shape = (num_kv_blocks, d.num_layers, 2, d.num_kv_heads, block_size, d.head_dim + kv_quant.SCALE_BYTES)
            return kv_pool_memory.zeros(shape, kv_quant.STORAGE_DTYPES[dtype], device)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        shape = (num_kv_blocks, d.num_layers, 2, d.num_kv_heads, block_size, d.head_dim)
        return kv_pool_memory.zeros(shape, dtype or self.dtype, device)
