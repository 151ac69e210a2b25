"""CUDA paged attention, copy_blocks and swap_blocks against the plain PyTorch reference.

Every test runs the CUDA kernel on a GPU copy of a random packed batch and the float64
reference on a CPU copy, then compares the output (dtype tolerance) and the whole pool
(exactly: every layer, every slot). Skipped without a GPU or without the CUDA kernels.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import pytest
import torch

from kernel_cases import MIXED_SPECS, Batch, make_batch, tie_rows, tolerance, write_rows
from trtpaged.attention_options import AttentionOptions
from trtpaged.reference import paged_attention_reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 80, 96, 128]


def _skip_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        from trtpaged import kernels

        if not kernels.has_cuda():
            return "the kernel library was built without CUDA kernels"
    except Exception as exc:  # library missing or not loadable
        return f"kernel library unavailable: {exc}"
    return None


@pytest.fixture(scope="module")
def kernels():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from trtpaged import kernels as k

    return k


def gpu_tolerance(io_dtype: torch.dtype) -> float:
    # fp32 output: leave room for fp32 accumulation order over thousands of keys.
    return max(tolerance(io_dtype), 5e-5)


def run_both(kernels, batch: Batch, layer: int, max_context_len: Optional[int],
             options: Optional[AttentionOptions] = None):
    """One call on the GPU and on the reference (CPU): (the GPU batch, the kernel's output, the reference's
    pool after the call, max |kernel - reference| of the outputs). `options` (default: `layer`, no window,
    no soft-cap) go to both."""
    assert options is None or options.layer == layer, "options name another layer than the call's"
    gpu = batch.to("cuda")
    ref_cache = batch.kv_cache.clone()
    options = options or AttentionOptions(layer, batch.scale)
    out = kernels.paged_attention(*gpu.args(), options, max_context_len=max_context_len)
    args = batch.args()
    ref = paged_attention_reference(*args[:3], ref_cache, *args[4:], options)
    torch.cuda.synchronize()
    err = (out.cpu().double() - ref.double()).abs().max().item() if out.numel() else 0.0
    return gpu, out, ref_cache, err


def assert_matches(kernels, batch: Batch, layer: int = 1, max_context_len: Optional[int] = None,
                   options: Optional[AttentionOptions] = None) -> None:
    gpu, out, ref_cache, err = run_both(kernels, batch, layer, max_context_len, options)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    # Slot by slot: the new K/V landed where the reference put them, nothing else changed.
    assert torch.equal(gpu.kv_cache.cpu(), ref_cache)
    assert err <= gpu_tolerance(batch.q.dtype), f"max abs error {err}"


# ---- paged attention ---------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", DTYPES, ids=str)
def test_mixed_batch_every_block_size_and_kv_cache_dtype(kernels, block_size: int, kv_cache_dtype: torch.dtype) -> None:
    io_dtype = DTYPES[(block_size.bit_length() + DTYPES.index(kv_cache_dtype)) % 3]
    batch = make_batch(MIXED_SPECS, block_size=block_size, io_dtype=io_dtype, kv_cache_dtype=kv_cache_dtype,
                       seed=block_size)
    assert_matches(kernels, batch)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("io_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_cache_dtype", DTYPES, ids=str)
def test_head_dims_and_dtypes(kernels, head_dim: int, io_dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> None:
    specs = [(0, 7), (30, 1), (5, 20), (0, 1), (61, 3)]
    batch = make_batch(specs, head_dim=head_dim, io_dtype=io_dtype, kv_cache_dtype=kv_cache_dtype, seed=head_dim,
                       num_layers=2)
    assert_matches(kernels, batch, layer=1)


# Ratios 1, 3, 4, and groups larger than one CTA holds (decode: 16 heads, prefill: 8).
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (16, 4), (20, 2), (40, 2)])
def test_gqa_ratios(kernels, num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch(MIXED_SPECS, num_heads=num_heads, num_kv_heads=num_kv_heads, io_dtype=torch.float16,
                       kv_cache_dtype=torch.float16, seed=num_heads)  # fmt: skip
    assert_matches(kernels, batch, layer=2)


def test_decodes_before_and_between_prefills(kernels) -> None:
    # The contract packs prefills first, but the kernels must not depend on the order.
    specs = [(30, 1), (0, 54), (12, 1), (40, 97), (0, 1), (129, 2), (7, 1)]
    assert_matches(kernels, make_batch(specs, block_size=32, seed=21))


def test_long_decodes_split_and_reduce(kernels) -> None:
    # A few sequences over thousands of cached tokens: the decode kernel splits each context
    # across CTAs (partials in the workspace) and the reduce kernel merges them.
    specs = [(3001, 1), (4095, 1), (5000, 1), (255, 1), (256, 1), (0, 1), (1023, 1)]
    for kv_cache_dtype in DTYPES:
        batch = make_batch(specs, num_layers=1, io_dtype=torch.float16, kv_cache_dtype=kv_cache_dtype, seed=22)
        assert_matches(kernels, batch, layer=0)


def test_split_plan_from_a_loose_max_context_len(kernels) -> None:
    # max_context_len only bounds context_lens: a larger bound changes the split plan, not the result.
    batch = make_batch([(2000, 1), (90, 1), (700, 13)], num_layers=1, block_size=64, seed=23)
    assert_matches(kernels, batch, layer=0, max_context_len=2001)
    assert_matches(kernels, batch, layer=0, max_context_len=2001 * 4)


def test_long_decode_with_prefill_and_gqa4(kernels) -> None:
    specs = [(0, 300), (2500, 5), (3333, 1), (1, 1)]
    batch = make_batch(specs, num_heads=16, num_kv_heads=4, head_dim=128, io_dtype=torch.bfloat16,
                       kv_cache_dtype=torch.bfloat16, num_layers=2, seed=24)  # fmt: skip
    assert_matches(kernels, batch, layer=1)


def test_decode_batch_of_32(kernels) -> None:
    gen = torch.Generator().manual_seed(25)
    specs = [(int(n), 1) for n in torch.randint(0, 2000, (32,), generator=gen)]
    batch = make_batch(specs, io_dtype=torch.float16, kv_cache_dtype=torch.float16, num_layers=1, seed=25)
    assert_matches(kernels, batch, layer=0)


def test_long_prefill_and_continuing_chunk(kernels) -> None:
    assert_matches(kernels, make_batch([(0, 333), (0, 1)], block_size=32, seed=26))
    assert_matches(kernels, make_batch([(1500, 300), (3, 2)], block_size=16, num_layers=1, seed=27), layer=0)


def test_layers_of_one_pool_are_independent(kernels) -> None:
    batch = make_batch([(10, 6), (0, 3), (70, 1)], num_layers=4, seed=28)
    for layer in range(4):
        assert_matches(kernels, batch, layer=layer)


def test_empty_step_is_a_no_op(kernels) -> None:
    batch = make_batch([(4, 0)], seed=29).to("cuda")
    before = batch.kv_cache.clone()
    out = kernels.paged_attention(*batch.args(), AttentionOptions(0, batch.scale))
    torch.cuda.synchronize()
    assert out.shape == (0, 9, 64)
    assert torch.equal(batch.kv_cache, before)


def test_chained_steps_match_one_prefill(kernels) -> None:
    whole = make_batch([(0, 40)], seed=30).to("cuda")
    out_whole = kernels.paged_attention(*whole.args()[:3], whole.kv_cache.clone(), *whole.args()[4:],
                                        AttentionOptions(0, whole.scale))  # fmt: skip
    cache = whole.kv_cache.clone()
    for lo, hi in [(0, 17), (17, 34), (34, 39), (39, 40)]:
        sl = slice(lo, hi)
        out = kernels.paged_attention(
            whole.q[sl].contiguous(), whole.k[sl].contiguous(), whole.v[sl].contiguous(), cache,
            whole.positions[sl].contiguous(), torch.tensor([0, hi - lo], dtype=torch.int32, device="cuda"),
            torch.tensor([hi], dtype=torch.int32, device="cuda"), whole.block_tables, AttentionOptions(0, whole.scale),
        )  # fmt: skip
        torch.testing.assert_close(out, out_whole[sl], atol=1e-5, rtol=0)


def test_bad_device_indices_never_fault(kernels) -> None:
    # Index contents live on the device, so the CUDA path cannot reject them: it must skip or
    # clamp them without touching memory outside the pool, and leave the context usable.
    batch = make_batch([(20, 5), (3, 1), (0, 9)], seed=31)
    gpu = batch.to("cuda")
    num_kv_blocks = gpu.kv_cache.shape[0]
    gpu.block_tables[0, 0] = num_kv_blocks + 5
    gpu.block_tables[0, 1] = -7
    gpu.block_tables[2, 0] = 2**30
    gpu.positions[3] = 10**6  # beyond the block table
    gpu.positions[5] = -3
    gpu.context_lens[1] = 10**6  # clamped to max_context_len and the table
    kernels.paged_attention(*gpu.args(), AttentionOptions(1, batch.scale), max_context_len=64)
    torch.cuda.synchronize()
    assert_matches(kernels, make_batch(MIXED_SPECS, seed=32))  # the context still works


def test_unsupported_head_dim(kernels) -> None:
    batch = make_batch([(0, 3)], head_dim=72, seed=33).to("cuda")
    with pytest.raises(kernels.KernelError, match="head_dim: 72"):
        kernels.paged_attention(*batch.args(), AttentionOptions(0, batch.scale))


def test_workspace_is_checked(kernels) -> None:
    batch = make_batch([(4000, 1)], num_layers=1, seed=34).to("cuda")
    lib = kernels.library()
    q = batch.q
    params = kernels._AttentionParams(q.shape[0], 1, batch.block_tables.shape[1], q.shape[1], 3, q.shape[2],
                                      batch.kv_cache.shape[0], 1, 0, 16, batch.scale, 0, 0)  # fmt: skip
    needed = lib.trtpaged_paged_attention_cuda_workspace_size(ctypes.byref(params), 4001)
    assert needed > 0, "a 4000-token decode of one sequence should split"
    out = torch.empty_like(q)
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (*batch.args(), out)]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    status = lib.trtpaged_paged_attention_cuda(ctypes.byref(params), *ptrs, 4001, None, 0, stream)
    assert status == 1 and b"workspace" in lib.trtpaged_last_error()


# ---- copy_blocks / swap_blocks -----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_exact(kernels, dtype: torch.dtype) -> None:
    pool = torch.randn(12, 3, 2, 2, 16, 8).to(dtype)
    pairs = [(1, 7), (2, 8), (3, 9), (0, 5), (1, 11)]  # a run of three is one memcpy
    expected = pool.clone()
    for src, dst in pairs:
        expected[dst] = pool[src]
    gpu = pool.cuda()
    kernels.copy_blocks(gpu, pairs)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), expected)


@pytest.mark.parametrize("pin", [False, True])
def test_swap_blocks_between_devices(kernels, pin: bool) -> None:
    device_pool = torch.randn(8, 2, 2, 3, 16, 8, device="cuda")
    host = torch.zeros(6, 2, 2, 3, 16, 8)
    host = host.pin_memory() if pin else host
    kernels.swap_blocks(device_pool, host, [(6, 0), (2, 4), (3, 5)])
    torch.cuda.synchronize()
    assert torch.equal(host[0], device_pool[6].cpu()) and torch.equal(host[4], device_pool[2].cpu())
    assert torch.equal(host[5], device_pool[3].cpu()) and not host[1:4].any()

    back = torch.zeros_like(device_pool)
    kernels.swap_blocks(host, back, [(0, 3), (4, 5)])
    torch.cuda.synchronize()
    assert torch.equal(back[3], device_pool[6]) and torch.equal(back[5], device_pool[2])

    other = torch.zeros_like(device_pool)
    kernels.swap_blocks(device_pool, other, [(1, 1), (7, 0)])
    torch.cuda.synchronize()
    assert torch.equal(other[1], device_pool[1]) and torch.equal(other[0], device_pool[7])


def test_bad_block_pairs_are_rejected_on_the_host(kernels) -> None:
    pool = torch.randn(4, 1, 2, 1, 8, 16, device="cuda")
    before = pool.clone()
    with pytest.raises(kernels.KernelError, match="destination block 4 out of range"):
        kernels.copy_blocks(pool, [(0, 4)])
    with pytest.raises(kernels.KernelError, match="both a source and a destination"):
        kernels.copy_blocks(pool, [(0, 1), (1, 2)])
    torch.cuda.synchronize()
    assert torch.equal(pool, before)


# ---- sliding window and logit soft-cap (Mistral, Gemma 2 and 3) ---------------------------
#
# The same reference, which masks densely in float64: a query at position p reads p - window + 1 .. p;
# with a soft-cap, scores become cap * tanh(score / cap) before the softmax.


@pytest.mark.parametrize("window", [1, 5, 16, 37, 300])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_sliding_window_mixed_batch(kernels, window: int, block_size: int) -> None:
    batch = make_batch(MIXED_SPECS, block_size=block_size, io_dtype=torch.float16, kv_cache_dtype=torch.float16,
                       seed=window + block_size)
    assert_matches(kernels, batch, options=AttentionOptions(1, batch.scale, sliding_window=window))


@pytest.mark.parametrize("window", [700, 1100, 2600, 6000])
def test_sliding_window_over_long_decodes_split_across_ctas(kernels, window: int) -> None:
    # thousands of cached keys: the split decode starts at the window's first tile, and splits wholly
    # before the window must add nothing when the reduce merges them; a window longer than every context
    specs = [(3001, 1), (5000, 1), (2500, 40), (255, 1)]
    batch = make_batch(specs, num_layers=1, io_dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, seed=window)
    assert_matches(kernels, batch, layer=0, options=AttentionOptions(0, batch.scale, sliding_window=window))


@pytest.mark.parametrize("softcap", [0.5, 50.0])
@pytest.mark.parametrize("window", [0, 37])
def test_logit_softcap_with_and_without_window(kernels, softcap: float, window: int) -> None:
    batch = make_batch(MIXED_SPECS + [(3001, 1)], num_layers=2, seed=11)
    batch.q.mul_(6.0)  # large scores, so that the cap changes the softmax
    options = AttentionOptions(1, batch.scale, sliding_window=window, logit_softcap=softcap)
    assert_matches(kernels, batch, options=options)


# ---- quantized KV cache (int8, fp8_e4m3) --------------------------------------------------
#
# Truths: the pool bytes the CUDA write makes equal PyTorch's own quantization (trtpaged.kv_quant:
# torch.round, torch's float8_e4m3fn cast), which the CPU kernel equals too (tests/test_kv_quant.py),
# scales included; the output equals float64 attention over the same pool de-quantized with the same
# scales (trtpaged.reference), within fp32 rounding.

QUANT_KV = ["int8", "fp8_e4m3"]


def quantized(batch: Batch, kv_cache_dtype: str) -> Batch:
    """The batch with its random float pool quantized row by row into kv_cache_dtype's layout."""
    from trtpaged.kv_quant import pack_rows, quantize_rows

    pool = pack_rows(*quantize_rows(batch.kv_cache, kv_cache_dtype))
    return Batch(batch.q, batch.k, batch.v, pool, *batch.args()[4:], scale=batch.scale)


def assert_quantized_matches(kernels, batch: Batch, layer: int = 1, max_context_len: Optional[int] = None,
                             options: Optional[AttentionOptions] = None) -> None:
    gpu, _, ref_cache, err = run_both(kernels, batch, layer, max_context_len, options)
    # every byte of the pool (codes and scales, every slot and layer) as PyTorch quantizes it
    assert torch.equal(gpu.kv_cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8))
    assert err <= gpu_tolerance(batch.q.dtype), f"max abs error {err} against the de-quantizing reference"


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_mixed_batch_every_block_size(kernels, kv_cache_dtype: str, block_size: int) -> None:
    io_dtype = DTYPES[block_size.bit_length() % 3]
    batch = make_batch(MIXED_SPECS, block_size=block_size, io_dtype=io_dtype, seed=40 + block_size)
    assert_quantized_matches(kernels, quantized(batch, kv_cache_dtype))


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_cache_with_window_and_softcap(kernels, kv_cache_dtype: str) -> None:
    batch = make_batch(MIXED_SPECS + [(3001, 1)], num_layers=2, io_dtype=torch.float16, seed=12)
    batch.q.mul_(3.0)
    options = AttentionOptions(1, batch.scale, sliding_window=37, logit_softcap=30.0)
    assert_quantized_matches(kernels, quantized(batch, kv_cache_dtype), options=options)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("io_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_head_dims_and_io_dtypes(kernels, kv_cache_dtype: str, io_dtype: torch.dtype, head_dim: int) -> None:
    specs = [(0, 7), (30, 1), (5, 20), (0, 1), (61, 3)]
    batch = make_batch(specs, head_dim=head_dim, io_dtype=io_dtype, seed=head_dim, num_layers=2)
    assert_quantized_matches(kernels, quantized(batch, kv_cache_dtype), layer=1)


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_long_decodes_split_prefill_and_gqa(kernels, kv_cache_dtype: str) -> None:
    decodes = make_batch([(3001, 1), (4095, 1), (255, 1), (0, 1), (1023, 1)], num_layers=1, io_dtype=torch.float16,
                         seed=41)  # fmt: skip
    assert_quantized_matches(kernels, quantized(decodes, kv_cache_dtype), layer=0)
    mixed = make_batch([(0, 300), (2500, 5), (3333, 1), (1, 1)], num_heads=16, num_kv_heads=4, head_dim=128,
                       io_dtype=torch.bfloat16, num_layers=2, block_size=8, seed=42)  # fmt: skip
    assert_quantized_matches(kernels, quantized(mixed, kv_cache_dtype), layer=1)


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_masked_rows_holding_nan_bytes_never_leak(kernels, kv_cache_dtype: str) -> None:
    # Slots past each sequence's context (same blocks, and the padding blocks) hold NaN codes and NaN
    # scales: the tile loader zero-fills them, so masked keys add nothing (0 * NaN would be NaN).
    from trtpaged.kv_quant import split_rows

    batch = quantized(make_batch([(0, 5), (20, 1), (9, 14)], block_size=16, num_layers=1, seed=43), kv_cache_dtype)
    raw = batch.kv_cache.view(torch.uint8)  # [blocks, layers, 2, kv heads, block_size, D + 2]
    live = torch.zeros(raw.shape[0], raw.shape[4], dtype=torch.bool)  # (block, slot) inside some context
    for s, length in enumerate(batch.context_lens.tolist()):
        for p in range(length):
            live[batch.block_tables[s, p // 16], p % 16] = True
    dead = ~live[:, None, None, None, :]
    raw[dead.expand(raw.shape[:5])] = 0x7F  # codes NaN (fp8) / 127 (int8), fp16 scale 0x7f7f = NaN
    assert torch.isnan(split_rows(batch.kv_cache)[1][dead.expand(raw.shape[:5])]).all()
    out = kernels.paged_attention(*batch.to("cuda").args(), AttentionOptions(0, batch.scale))
    assert torch.isfinite(out).all()
    assert_quantized_matches(kernels, batch, layer=0)


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_write_rounds_every_tie_like_torch(kernels, kv_cache_dtype: str) -> None:
    # Rows with scale exactly 1 whose values are every midpoint between neighbouring codes and the
    # floats either side (kernel_cases.tie_rows): the codes must be torch's rounding of them. On sm_89+
    # this checks the hardware conversion, on sm_80 the software codec the CPU kernels share.
    from trtpaged.kv_quant import split_rows

    rows, expected = tie_rows(kv_cache_dtype)
    pool = torch.zeros(1, 1, 2, 1, 64, 64 + 2, dtype=expected.dtype, device="cuda")
    write_rows(kernels, rows.cuda(), pool)
    codes, scales = split_rows(pool.cpu()[0, 0, 0, 0, : rows.shape[0]])
    assert torch.all(scales == 1.0)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_write_of_nan_rows_equals_the_cpu_codec(kernels, kv_cache_dtype: str) -> None:
    # A row holding a NaN (one lane, the last lane, every lane, -NaN) gets the NaN scale and zero codes,
    # byte for byte what kv_quant (and the CPU kernels, tests/test_kv_codec_paths.py) write; finite rows
    # beside them are untouched by it.
    from trtpaged.kv_quant import STORAGE_DTYPES, pack_rows, quantize_rows

    g = torch.Generator().manual_seed(17)
    rows = torch.randn(6, 64, generator=g)
    rows[0, 3] = float("nan")
    rows[1, 63] = float("nan")
    rows[2, :] = float("nan")
    rows[3, 10] = -float("nan")
    pool = torch.zeros(1, 1, 2, 1, 8, 64 + 2, dtype=STORAGE_DTYPES[kv_cache_dtype], device="cuda")
    write_rows(kernels, rows.cuda(), pool)
    expected = pack_rows(*quantize_rows(rows, kv_cache_dtype))
    got = pool.cpu()[0, 0, 0, 0, : rows.shape[0]]
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_quantized_blocks_copy_and_swap_as_bytes(kernels, kv_cache_dtype: str) -> None:
    # block copies are dtype-blind: a quantized pool's blocks (codes and scales) move as bytes
    pool = quantized(make_batch([(0, 5), (7, 1)], num_layers=2), kv_cache_dtype).kv_cache
    gpu_pool = pool.to("cuda")
    kernels.copy_blocks(gpu_pool, [(0, 1), (2, 3)])
    host = torch.zeros_like(pool)
    kernels.swap_blocks(gpu_pool, host, [(1, 0)])
    torch.cuda.synchronize()
    assert torch.equal(gpu_pool[1].cpu().view(torch.uint8), pool[0].view(torch.uint8))
    assert torch.equal(gpu_pool[3].cpu().view(torch.uint8), pool[2].view(torch.uint8))
    assert torch.equal(host[0].view(torch.uint8), pool[0].view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", QUANT_KV)
def test_step_model_on_cuda_with_a_quantized_cache_matches_the_cpu_kernels(kernels, kv_cache_dtype: str) -> None:
    # End to end through the torch backend's step model (head_dim 64, a CUDA head_dim): the probe's two
    # steps over a quantized pool on the GPU give the CPU kernels' logits and (but for codes at a rounding
    # boundary, where the two devices' matmuls differ in the last bit) the same pool bytes. Such a code moves
    # by a whole step, so the logits may differ by more than float rounding: on the CPU, weights off by 2e-7
    # relative moved the logits by up to 3.4e-3 of their largest (int8; 6.8e-4 fp8), while the quantization
    # itself (against the same model with a float32 cache) moves them by 2.8e-2 (int8) and 1.3e-1 (fp8). The
    # bound: 1e-2 of the largest logit, or half the quantization's own effect where that is smaller.
    from trtpaged.builder.probe import standard_probe
    from trtpaged.config import parse_config
    from trtpaged.models import dims_from_hf_config, load_hf, step_model_from_hf

    config = parse_config({"model": {"tiny": {"num_hidden_layers": 2, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "hidden_size": 256}}})
    hf = load_hf(config.model)
    dims = dims_from_hf_config(hf.config)
    assert dims.head_dim == 64
    cpu_model = step_model_from_hf(hf.model, dims, torch.float32)
    gpu_model = step_model_from_hf(hf.model, dims, torch.float32).to("cuda")
    _, steps, num_kv_blocks = standard_probe(dims.vocab_size, 16, seed=5, all_rows=True)
    cpu_pool = cpu_model.new_kv_cache(num_kv_blocks, 16, kv_cache_dtype)
    float_pool = cpu_model.new_kv_cache(num_kv_blocks, 16, None)
    gpu_pool = gpu_model.new_kv_cache(num_kv_blocks, 16, kv_cache_dtype, device="cuda")
    for step in steps:
        with torch.no_grad():
            ref, _ = cpu_model(*step.args(cpu_pool))
            unquantized, _ = cpu_model(*step.args(float_pool))
            out, _ = gpu_model(*(t.to("cuda") for t in step.args(gpu_pool)[:-1]), gpu_pool)
        torch.cuda.synchronize()
        scale = max(1.0, ref.abs().max().item())
        bound = max(1e-3 * scale, min(1e-2 * scale, 0.5 * (ref - unquantized).abs().max().item()))
        err = (out.cpu() - ref).abs().max().item()
        assert err <= bound, f"GPU vs CPU logits differ by {err:.3g} (bound {bound:.3g}, largest {scale:.3g})"
    differ = (gpu_pool.cpu().view(torch.uint8) != cpu_pool.view(torch.uint8)).float().mean().item()
    assert differ < 0.01, f"{differ:.2%} of the pool's bytes differ"
    assert cpu_pool.view(torch.uint8).any()


def test_bench_paged_overhead_compares_tables_of_one_block_size(kernels, monkeypatch) -> None:
    """`bench kernel --device cuda --block-size 32`: the shuffled side's blocks were 32 tokens and the identity
    table's 16 (its call left block_size at the default), so 'paged overhead' measured a block size too. Every
    step the benchmark times is built (by the real builder) with the block size asked for."""
    from trtpaged.bench import kernel_bench_gpu as bench

    built = []
    real = bench._decode_step

    def recording(context, batch, shuffle, seed=0, kv_cache_dtype="float16", block_size=bench.DEFAULT_BLOCK_SIZE):
        built.append((shuffle, block_size))
        return real(context, batch, shuffle, seed, kv_cache_dtype, block_size)

    monkeypatch.setattr(bench, "_decode_step", recording)
    bench.measure_decode(512, 1, {"read_gbs": 1.0, "moved_gbs": 2.0}, "float16", block_size=32)
    assert sorted(built) == [(False, 32), (True, 32)]
