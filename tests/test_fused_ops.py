"""The fused CPU ops (rmsnorm, rope_qk, silu_mul, greedy_rows) against plain float64 torch, on each compiled copy
of their row loops this CPU runs (forced in-process with kernels.set_cpu_isa), and the step model's fused eager
path against its torch path."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_helpers import cpu_isas, for_each_cpu_isa
from trtpaged import kernels
from trtpaged.builder.probe import standard_probe
from trtpaged.config import parse_config
from trtpaged.models import dims_from_hf_config, llama, load_hf, step_model_from_hf
from trtpaged.models.execution_plan import ExecutionPlan

pytestmark = pytest.mark.skipif(not (kernels.available() and kernels.has_fused_ops()),
                                reason="kernel library with the fused ops not built")

ROWS = [1, 3, 130]
ROW_COPIES = ("scalar", "avx2", "avx512vnni")  # one ISA per compiled copy of the row loops


@pytest.fixture(params=cpu_isas(ROW_COPIES))
def row_isa(request: pytest.FixtureRequest):
    """The fused ops' row loops forced to one compiled copy for the test; the best is restored afterwards."""
    kernels.set_cpu_isa(request.param)
    yield request.param
    kernels.set_cpu_isa(None)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32) * scale


def _rmsnorm_ref(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb in float64: x [T, heads, D], cos/sin [T, D]."""
    x, cos, sin = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _cos_sin(rows: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(seed)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None, :]] * 2, dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rmsnorm_matches_float64(rows, hidden, row_isa):
    x, w = _randn(rows, hidden, seed=1, scale=3.0), _randn(hidden, seed=2)
    out = kernels.rmsnorm(x, w, 1e-5)
    torch.testing.assert_close(out.double(), _rmsnorm_ref(x, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rmsnorm_with_residual_writes_the_stream_and_normalizes_it(rows, hidden, row_isa):
    x, res, w = _randn(rows, hidden, seed=3), _randn(rows, hidden, seed=4, scale=5.0), _randn(hidden, seed=5)
    expected_h = x.double() + res.double()
    res_before = res.clone()
    out, h = kernels.rmsnorm(x, w, 1e-6, residual=res)
    assert h is res  # in place by default
    torch.testing.assert_close(h.double(), expected_h, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), _rmsnorm_ref(expected_h, w, 1e-6), rtol=2e-6, atol=2e-6)
    # into a separate residual_out, and into x itself: residual then stays as it was
    res = res_before.clone()
    out2, h2 = kernels.rmsnorm(x, w, 1e-6, residual=res, residual_out=x)
    assert h2 is x and torch.equal(res, res_before)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_rmsnorm_out_may_be_x(row_isa):
    x, w = _randn(5, 96, seed=6), _randn(96, seed=7)
    expected = _rmsnorm_ref(x, w, 1e-5)
    assert kernels.rmsnorm(x, w, 1e-5, out=x) is x
    torch.testing.assert_close(x.double(), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 1, 128)])
def test_rope_qk_matches_hf_rotate_half(rows, heads, kv_heads, head_dim, row_isa):
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = _randn(rows, q_size + 2 * kv_size, seed=8)
    cos, sin = _cos_sin(rows, head_dim, seed=9)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q_ref = _rotate_ref(q.reshape(rows, heads, head_dim), cos, sin)
    k_ref = _rotate_ref(k.reshape(rows, kv_heads, head_dim), cos, sin)
    v_ref = v.reshape(rows, kv_heads, head_dim).clone()
    before = qkv.clone()

    dq, dk, dv = kernels.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim, dense=True)
    assert torch.equal(qkv, before)  # dense outputs leave qkv alone
    assert dq.is_contiguous() and dk.is_contiguous() and dv.is_contiguous()
    assert dq.shape == (rows, heads, head_dim) and dk.shape == dv.shape == (rows, kv_heads, head_dim)
    torch.testing.assert_close(dq.double(), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk.double(), k_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(dv, v_ref)

    assert kernels.rope_qk(qkv, cos, sin, heads, kv_heads, head_dim) is qkv  # in place
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    assert torch.equal(q.reshape(rows, heads, head_dim), dq) and torch.equal(k.reshape(rows, kv_heads, head_dim), dk)
    assert torch.equal(v.reshape(rows, kv_heads, head_dim), v_ref)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("intermediate", [64, 1536, 11008])
def test_silu_mul_matches_float64(rows, intermediate, row_isa):
    gate_up = _randn(rows, 2 * intermediate, seed=10, scale=4.0)
    gate_up[0, :8] = torch.tensor([-200.0, -88.5, -87.0, -30.0, 30.0, 87.5, 200.0, 0.0])  # the exp's range ends
    g, u = gate_up.double().split(intermediate, dim=-1)
    expected = g * torch.sigmoid(g) * u
    torch.testing.assert_close(kernels.silu_mul(gate_up).double(), expected, rtol=1e-5, atol=1e-5)
    out = torch.empty(rows, intermediate)
    assert kernels.silu_mul(gate_up, out=out) is out


def test_zero_rows_are_a_no_op(row_isa):
    w = torch.ones(64)
    assert kernels.rmsnorm(torch.empty(0, 64), w, 1e-5).shape == (0, 64)
    assert kernels.silu_mul(torch.empty(0, 128)).shape == (0, 64)
    q, k, v = kernels.rope_qk(torch.empty(0, 4 * 64), torch.empty(0, 64), torch.empty(0, 64), 2, 1, 64, dense=True)
    assert q.shape == (0, 2, 64) and k.shape == v.shape == (0, 1, 64)


@pytest.mark.parametrize("call,name", [
    (lambda: kernels.rmsnorm(torch.zeros(2, 64, dtype=torch.float64), torch.ones(64), 1e-5), "x"),
    (lambda: kernels.rmsnorm(torch.zeros(2, 64), torch.ones(63), 1e-5), "weight"),
    (lambda: kernels.rmsnorm(torch.zeros(2, 64), torch.ones(64), 1e-5, residual=torch.zeros(3, 64)), "residual"),
    (lambda: kernels.rmsnorm(torch.zeros(2, 64), torch.ones(64), 1e-5, out=torch.zeros(64, 2).t()), "out"),
    (lambda: kernels.rmsnorm(torch.zeros(2, 64), torch.ones(64), 1e-5, residual_out=torch.zeros(2, 64)),
     "residual_out"),
    (lambda: kernels.rmsnorm(torch.zeros(2, 64), torch.ones(64), float("nan")), "eps"),
    (lambda: kernels.rmsnorm(torch.zeros(64), torch.ones(64), 1e-5), "x"),
    (lambda: kernels.rope_qk(torch.zeros(2, 255), torch.zeros(2, 64), torch.zeros(2, 64), 2, 1, 64), "qkv"),
    (lambda: kernels.rope_qk(torch.zeros(2, 256), torch.zeros(1, 64), torch.zeros(2, 64), 2, 1, 64), "cos"),
    (lambda: kernels.rope_qk(torch.zeros(2, 256), torch.zeros(2, 64), torch.zeros(2, 32), 2, 1, 64), "sin"),
    (lambda: kernels.rope_qk(torch.zeros(2, 4 * 63), torch.zeros(2, 63), torch.zeros(2, 63), 2, 1, 63), "head_dim"),
    (lambda: kernels.rope_qk(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), 0, 0, 0), "num_heads"),
    (lambda: kernels.silu_mul(torch.zeros(2, 7)), "gate_up"),
    (lambda: kernels.silu_mul(torch.zeros(4, 2).t()), "gate_up"),
    (lambda: kernels.silu_mul(torch.zeros(2, 8), out=torch.zeros(2, 8)), "out"),
])
def test_bad_arguments_are_refused_naming_the_argument(call, name):
    with pytest.raises((ValueError, kernels.KernelError), match=rf"\b{name}\b"):
        call()


def test_rope_qk_refuses_a_strided_qkv():
    qkv = torch.zeros(2, 512)[:, :256]
    with pytest.raises(ValueError, match="qkv: expected a contiguous"):
        kernels.rope_qk(qkv, torch.zeros(2, 64), torch.zeros(2, 64), 2, 1, 64)


# --- the step model: fused eager path vs the torch path --------------------------------------------

def _tiny(**overrides):
    config = parse_config({"model": {"tiny": {"num_hidden_layers": 3, **overrides}}})
    hf = load_hf(config.model)
    return hf, dims_from_hf_config(hf.config)


def _probe_logits(model, dims, block_size: int = 8) -> list[torch.Tensor]:
    _, steps, num_kv_blocks = standard_probe(dims.vocab_size, block_size, seed=5, all_rows=True)
    cache = model.new_kv_cache(num_kv_blocks, block_size)
    with torch.no_grad():
        return [model(*step.args(cache))[0] for step in steps]


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
                                       {"num_key_value_heads": 4, "head_dim": 32}])
def test_step_model_fused_path_equals_torch_path(monkeypatch, overrides, row_isa):
    hf, dims = _tiny(**overrides)
    model = step_model_from_hf(hf.model, dims)
    calls = {"rmsnorm": 0, "rope_qk": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, counted)
    fused = _probe_logits(model, dims)
    assert calls["rope_qk"] > 0 and calls["silu_mul"] == calls["rope_qk"]  # the fused path ran
    assert calls["rmsnorm"] == 2 * calls["rope_qk"] + len(fused)  # two per layer, one final
    assert model.execution_plan.layers == "fused"  # decided at the first step: float linears
    model.set_execution_plan(ExecutionPlan("torch", "the test's plain torch path"))
    plain = _probe_logits(model, dims)
    assert len(fused) == len(plain)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["phi3", "phi3-longrope", "llama-yarn", "gemma2", "gemma3", "gemma3-one-kv-head"])
def test_family_fused_path_equals_torch_path(family):
    """Other families' features in the fused form (Gemma's (1 + w) norms through the rmsnorm kernel, the norms after
    attention and around the MLP, GeGLU in float64, partial rotary in torch ops, Gemma 3's local RoPE tables, the
    attention's scale and soft-cap) compute what the torch form computes."""
    from test_families import _config

    hf = load_hf(_config(family).model)
    dims = dims_from_hf_config(hf.config, 256)
    model = step_model_from_hf(hf.model, dims)
    fused = _probe_logits(model, dims)
    assert model.execution_plan.layers == "fused", model.execution_plan
    model.set_execution_plan(ExecutionPlan("torch", "the test's plain torch path"))
    plain = _probe_logits(model, dims)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_step_model_uses_the_torch_path_for_other_dtypes(monkeypatch):
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims).to(torch.bfloat16)
    for name in ("rmsnorm", "rope_qk", "silu_mul"):
        monkeypatch.setattr(kernels, name, lambda *a, _name=name, **k: pytest.fail(f"fused {_name} on bfloat16"))
    _, steps, num_kv_blocks = standard_probe(dims.vocab_size, 8, seed=5, all_rows=True)
    cache = model.new_kv_cache(num_kv_blocks, 8)
    with torch.no_grad():
        logits, _ = model(*steps[0].args(cache))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_module_torch_path_matches_float64(dtype):
    norm = llama.RMSNorm(576, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(576, seed=11))
    x = _randn(3, 576, seed=12, scale=2.0).to(dtype)
    expected = _rmsnorm_ref(x.float(), norm.weight.float(), 1e-5)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm(x).double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_greedy_rows_match_argmax_and_float64_logsumexp(vocab, row_isa):
    logits = _randn(6, vocab, seed=vocab, scale=4.0)
    if vocab > 20:  # a tie for the maximum: the first index wins, as in torch.argmax
        logits[2, 7] = logits[2, vocab - 3] = logits[2].max() + 1.0
    rows = torch.tensor([5, 2, 0, 2], dtype=torch.int64)
    argmax, lse = kernels.greedy_rows(logits, rows)
    assert torch.equal(argmax, logits[rows].argmax(dim=1))
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits[rows].double(), dim=1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [40, 47, 64, 49152])
def test_greedy_rows_first_maximum_wherever_the_ties_fall(vocab, row_isa):
    """Ties within one vector, across vectors (the copies' widths: 16, 8 or 4 lanes, and two sets of them), in the
    tail past the last full vector, at index 0; a row of -inf takes index 0 as torch.argmax does (its log-sum-exp
    is not finite: the sampler gives such a row no token)."""
    base = _randn(1, vocab, seed=100 + vocab)
    top = float(base.max()) + 1.0
    last = vocab - 1
    ties = [(3, 19), (20, 35), (9, 16), (13, 24), (5, last), (0, vocab // 2), (last,), (vocab - 2, last)]
    logits = base.repeat(len(ties) + 1, 1)
    for r, where in enumerate(ties):
        for i in where:
            logits[r, i] = top
    logits[len(ties)] = float("-inf")
    rows = torch.arange(logits.shape[0], dtype=torch.int64)
    argmax, lse = kernels.greedy_rows(logits, rows)
    assert argmax.tolist() == logits.argmax(dim=1).tolist() == [min(w) for w in ties] + [0]
    torch.testing.assert_close(lse[:-1].double(), torch.logsumexp(logits[:-1].double(), dim=1), rtol=1e-6,
                               atol=1e-6)  # fmt: skip
    assert not math.isfinite(lse[-1].item())


def test_greedy_rows_of_every_length_with_many_ties_and_minus_inf(row_isa):
    """Rows of 1 to 80 elements (every tail length of every lane width, one and two sets of lanes) holding small
    integers, so the maximum repeats at random places, with some -inf: the first maximum and the log-sum-exp of
    torch."""
    g = torch.Generator().manual_seed(23)
    for n in range(1, 81):
        logits = torch.randint(-3, 4, (6, n), generator=g).float()
        logits[logits == -3] = float("-inf")
        logits[0, :] = float("-inf")  # a whole row of -inf: index 0, as torch.argmax
        rows = torch.arange(6, dtype=torch.int64)
        argmax, lse = kernels.greedy_rows(logits, rows)
        assert argmax.tolist() == logits.argmax(dim=1).tolist(), n
        finite = torch.isfinite(logits.amax(dim=1))
        torch.testing.assert_close(lse[finite].double(), torch.logsumexp(logits[finite].double(), dim=1), rtol=1e-6,
                                   atol=1e-6)  # fmt: skip


def test_greedy_rows_give_a_row_with_nan_a_non_finite_logsumexp(row_isa):
    logits = _randn(3, 100, seed=7)
    logits[0, 40] = float("nan")
    logits[1, 0] = float("nan")
    logits[2] = float("nan")
    argmax, lse = kernels.greedy_rows(logits, torch.arange(3, dtype=torch.int64))
    assert not torch.isfinite(lse).any()
    assert ((0 <= argmax) & (argmax < 100)).all()


def test_silu_mul_carries_a_non_finite_gate_to_its_own_output_only(row_isa):
    """The exponential takes 2^n from the rounding constant's bits, not from a float-to-int conversion (undefined for
    a NaN): a NaN gate gives NaN where it is, +inf gives inf, and every other element is torch's."""
    gate_up = _randn(3, 2 * 40, seed=11) * 6
    gate_up[0, 5], gate_up[1, 39] = float("nan"), float("inf")
    out = kernels.silu_mul(gate_up)
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    want = gate * torch.sigmoid(gate) * up
    assert torch.isnan(out[0, 5]) and torch.isnan(out).sum() == 1
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-6, equal_nan=True)


def test_greedy_rows_refuses_rows_out_of_range():
    with pytest.raises(ValueError, match=r"rows: indices must be in \[0, 3\)"):
        kernels.greedy_rows(torch.zeros(3, 8), torch.tensor([0, 3]))


@pytest.mark.parametrize("weights,activations", [("int4", "float"), ("int4", "int8"), ("int8", "float")])
def test_quantized_step_model_runs_all_layers_in_one_call_with_the_same_logits(monkeypatch, weights, activations):
    # The one-call layer runner (kernels.LlamaLayers) makes the per-layer loop's kernel calls in the
    # same order on the same values: the logits must be bit-identical, prefill and decode steps alike.
    from trtpaged.builder.quantize import quantized_step_model

    config = parse_config({"model": {"tiny": {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 96,
                                              "attention_bias": weights == "int8"}},
                           "quantization": {"weights": weights, "group_size": 32, "activations": activations}})
    hf = load_hf(config.model)
    dims = dims_from_hf_config(hf.config)
    model = quantized_step_model(hf.model, config.model, dims, config.quantization, torch.float32)[0]
    calls = []
    real = kernels.LlamaLayers.__call__
    monkeypatch.setattr(kernels.LlamaLayers, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    one_call = _probe_logits(model, dims)
    assert len(calls) == len(one_call)  # every step ran its layers in one call
    assert model.execution_plan.layers == "c_layers"
    model.set_execution_plan(ExecutionPlan("fused", "the test's per-layer loop"))
    per_layer = _probe_logits(model, dims)
    assert len(calls) == len(one_call)
    for a, b in zip(one_call, per_layer):
        assert torch.equal(a, b)


def _assert_step_rows_are_rows_alone(activations: str, cases, plan: str | None = None,
                                     row_invariant: bool = False):  # fmt: skip
    """A tiny int4-weight model's step of one sequence at 28 keys gives each row the logits of decoding it alone,
    bit for bit, on every CPU ISA, for each (KV cache dtype, rows) of `cases`. The context puts a row at 31
    keys: one short of a vector (16 or 8 lanes) alone, inside a full group with the next row (the attention's
    tail case); head_dim 64 takes the fused attention loops. 3 query heads per KV head: with 3 rows, the last
    row's last head is scored alone in a group (of up to 4 query rows), while alone its 3 heads share one. An
    fp16 KV cache is converted by the fused loops. `row_invariant`: how the multi-row step runs (the one-row
    steps never need it)."""
    from trtpaged.builder.quantize import quantized_step_model

    config = parse_config({"model": {"tiny": {"num_hidden_layers": 2, "hidden_size": 192, "intermediate_size": 96,
                                              "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64}},
                           "quantization": {"weights": "int4", "group_size": 32, "activations": activations}})
    hf = load_hf(config.model)
    dims = dims_from_hf_config(hf.config)
    model = quantized_step_model(hf.model, config.model, dims, config.quantization, torch.float32)[0]
    if plan is not None:
        model.set_execution_plan(ExecutionPlan(plan, "the test's plan"))
    tokens = torch.randint(0, dims.vocab_size, (34,), generator=torch.Generator().manual_seed(9)).tolist()
    ctx, i32 = 28, torch.int32

    def step(cache, first: int, count: int, invariant: bool = False) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor(tokens[first : first + count], dtype=i32), torch.arange(first, first + count,
                         dtype=i32), torch.tensor([0, count], dtype=i32), torch.tensor([first + count], dtype=i32),
                         torch.tensor([[0, 1, 2]], dtype=i32), torch.arange(count, dtype=i32), cache,
                         row_invariant=invariant)[0]  # fmt: skip

    def check(isa: str) -> None:
        for kv_dtype, rows in cases:
            cache = model.new_kv_cache(3, 16, dtype=kv_dtype)
            step(cache, 0, ctx)
            prefilled = cache.clone()
            together = step(cache, ctx, rows, row_invariant)
            cache.copy_(prefilled)
            for i in range(rows):
                assert torch.equal(step(cache, ctx + i, 1)[0], together[i]), (isa, kv_dtype, rows, i)

    for_each_cpu_isa(check)


def test_int8_activation_step_rows_do_not_depend_on_the_rows_run_with_them():
    # What keeps greedy outputs the same with speculation on (w4a8: int4 weights, int8 activations): a 6-row
    # verification step gives each row the logits of that row decoded alone, with no help from the runtime.
    _assert_step_rows_are_rows_alone("int8", ((None, 6), ("float16", 6), ("float16", 3), (None, 3)))


@pytest.mark.parametrize("plan", ["c_layers", "fused", "torch"])
def test_float_activation_one_sequence_step_rows_are_those_of_decoding_each_alone(plan: str):
    # What keeps an int4 engine's (float activations) greedy outputs the same with speculation on: the CPU
    # kernels run one row as int8 limbs and several as float tiles, which round differently, so a step that
    # decodes one sequence is run `row_invariant` (the runtime's batch_builder marks it), and then each row of
    # its 6-row verification step gets the logits (and the LM head's) of that row decoded alone, in every
    # execution plan.
    _assert_step_rows_are_rows_alone("float", ((None, 6), ("float16", 3)), plan, row_invariant=True)
