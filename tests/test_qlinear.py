"""CPU weight-only quantized linear (int8 / int4) against float64 references, on every ISA path.

Two references, both built from the same dequantized weight W (float64):
- the quantized-activation reference: x quantized per block of 32 exactly as the kernel
  documents (d = max|x| / 127, q = round(x * (1 / d)) in float32), then x_deq @ W^T. The kernel
  must match it up to fp32 accumulation rounding (tight tolerance);
- the plain reference x @ W^T, which the kernel approximates within the activation
  quantization error (each x element off by at most d / 2, so |err| <= sum_k d_block(k) / 2 * |W[n, k]|).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

from runtime_helpers import cpu_isas
from trtpaged import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")


@pytest.fixture(params=cpu_isas())
def isa(request: pytest.FixtureRequest):
    kernels.set_cpu_isa(request.param)
    yield request.param
    kernels.set_cpu_isa(None)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x dequantized, per-element block scale d) as the kernel quantizes x: float32 ops, ties to even."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    assert q.abs().max() <= 127
    deq = (q.double() * d.double()).reshape(x.shape)
    return deq, d.double().expand_as(blocks).reshape(x.shape)


def make_weight(bits: int, n: int, k: int, group: int, seed: int, codes_fill: Optional[int] = None):
    """Random codes, fp16-representable scales (and offsets); returns (codes, scales, offsets, W float64)."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.001).half().float()
    if bits == 8:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        if codes_fill is not None:
            q.fill_(codes_fill)
        codes, offsets = q, None
        w = scales.double().repeat_interleave(group, 1) * q.double()
    else:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        if codes_fill is not None:
            q.fill_(codes_fill)
        codes = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        offsets = (torch.randn(n, groups, generator=g) * 0.1).half().float()
        w = scales.double().repeat_interleave(group, 1) * q.double() + offsets.double().repeat_interleave(group, 1)
    return codes, scales, offsets, w


def check(bits: int, m: int, n: int, k: int, group: int, *, bias: bool = False, seed: int = 0,
          codes_fill: Optional[int] = None, x: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    codes, scales, offsets, w = make_weight(bits, n, k, group, seed, codes_fill)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, group)
    assert packed.data_ptr() % 64 == 0
    if x is None:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)) * 2
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    y = kernels.qlinear(x, packed, bits, n, k, group, bias=b)
    assert y.shape == (m, n) and y.dtype == torch.float32

    x_deq, d = quantize_activations(x)
    ref_q = x_deq @ w.T
    ref = x.double() @ w.T
    if b is not None:
        ref_q += b.double()
        ref += b.double()
    # fp32 accumulation over k products of magnitude |x_deq| |W|: a relative 1e-5 of that sum.
    magnitude = x_deq.abs() @ w.abs().T + 1e-30
    err_q = (y.double() - ref_q).abs()
    assert (err_q <= 1e-5 * magnitude + 1e-6).all(), f"max err vs quantized-activation reference {err_q.max()}"
    bound = (d / 2) @ w.abs().T
    err = (y.double() - ref).abs()
    assert (err <= bound * 1.0001 + 1e-5 * magnitude + 1e-6).all(), f"max err vs plain reference {err.max()}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (100, 576)])
def test_shapes(isa: str, bits: int, m: int, n: int, k: int) -> None:
    check(bits, m, n, k, 32, seed=m * 1000 + n)


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 128), (8, "k"), (4, 64), (4, 128)])
@pytest.mark.parametrize("m", [1, 5])
def test_group_sizes(isa: str, bits: int, group, m: int) -> None:
    k = 384 if group != "k" else 576
    check(bits, m, 13, k, k if group == "k" else group, seed=m)
    if group == "k":
        check(bits, m, 13, 96, 96, seed=m + 7)  # K/32 odd: the last pair of blocks is half padding


@pytest.mark.parametrize("bits", [8, 4])
def test_bias(isa: str, bits: int) -> None:
    check(bits, 3, 9, 96, 32, bias=True, seed=5)


@pytest.mark.parametrize("bits,fill", [(8, 127), (8, -128), (8, -127), (8, 0), (4, 0), (4, 15)])
def test_edge_codes(isa: str, bits: int, fill: int) -> None:
    # Saturated activations too: every block has an element at exactly +-max, the int8 extremes.
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(9))
    x[:, ::32] = 1000.0
    x[:, 1::32] = -1000.0
    check(bits, 4, 10, 96, 32, codes_fill=fill, x=x)


def test_zero_and_tiny_activations(isa: str) -> None:
    x = torch.zeros(2, 64)
    x[1, 32:] = 1e-30  # one all-zero block (d = 0) and one of denormal-scale values
    for bits in (8, 4):
        check(bits, 2, 5, 64, 32, x=x)


def test_leading_dimensions_and_out() -> None:
    codes, scales, offsets, w = make_weight(4, 6, 64, 32, seed=3)
    packed = kernels.qlinear_pack(4, codes, scales, offsets, 32)
    x = torch.randn(2, 3, 64)
    out = torch.full((2, 3, 6), float("nan"))
    y = kernels.qlinear(x, packed, 4, 6, 64, 32, out=out)
    assert y is out
    flat = kernels.qlinear(x.reshape(6, 64), packed, 4, 6, 64, 32)
    assert torch.equal(out.reshape(6, 6), flat)


def test_every_isa_agrees_with_the_best() -> None:
    # The paths differ only in summation order: results agree to fp32 rounding.
    codes, scales, offsets, _ = make_weight(4, 37, 576, 64, seed=11)
    packed = kernels.qlinear_pack(4, codes, scales, offsets, 64)
    x = torch.randn(9, 576)
    results = {}
    try:
        for name in cpu_isas():
            kernels.set_cpu_isa(name)
            assert kernels.cpu_isa() == name
            results[name] = kernels.qlinear(x, packed, 4, 37, 576, 64)
    finally:
        kernels.set_cpu_isa(None)
    best = results[kernels.cpu_isa()]
    for name, y in results.items():
        torch.testing.assert_close(y, best, rtol=1e-5, atol=1e-5, msg=name)


def test_isa_names() -> None:
    assert kernels.cpu_isa() in kernels.CPU_ISAS
    with pytest.raises(kernels.KernelError, match="unknown instruction set"):
        kernels.set_cpu_isa("sse9")
    if kernels.cpu_isa() != "avx512vnni":
        with pytest.raises(kernels.KernelError, match="does not support"):
            kernels.set_cpu_isa("avx512vnni")


def test_env_var_forces_a_lower_isa() -> None:
    code = "from trtpaged import kernels; print(kernels.cpu_isa())"
    env = {**os.environ, "TRTPAGED_CPU_ISA": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"
    assert "TRTPAGED_CPU_ISA" not in out.stderr
    best = kernels.best_cpu_isa()
    for name in ("AVX2", "bogus"):  # was: ignored without a word, so a "forced" comparison ran the best ISA
        env = {**os.environ, "TRTPAGED_CPU_ISA": name}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == best
        assert f"TRTPAGED_CPU_ISA={name} ignored (expected scalar, avx2, avxvnni or avx512vnni)" in out.stderr


def test_bad_arguments() -> None:
    codes, scales, offsets, _ = make_weight(4, 4, 64, 32, seed=0)
    with pytest.raises(kernels.KernelError, match="k: must be a positive multiple of 32"):
        kernels.qlinear_packed_bytes(8, 4, 48, 16)
    with pytest.raises(kernels.KernelError, match="group_size: 16 not supported"):
        kernels.qlinear_packed_bytes(8, 4, 64, 16)
    with pytest.raises(kernels.KernelError, match="group_size: 256 not supported"):
        kernels.qlinear_packed_bytes(4, 4, 256, 256)  # per-channel groups are int8 only
    with pytest.raises(kernels.KernelError, match="group_size: k = 96 is not a multiple of 64"):
        kernels.qlinear_packed_bytes(8, 4, 96, 64)
    with pytest.raises(kernels.KernelError, match="bits: 3 not supported"):
        kernels.qlinear_packed_bytes(3, 4, 64, 32)
    with pytest.raises(kernels.KernelError, match="n: must be >= 1"):
        kernels.qlinear_packed_bytes(8, 0, 64, 32)
    with pytest.raises(ValueError, match="offsets: required for bits 4"):
        kernels.qlinear_pack(4, codes, scales, None, 32)
    with pytest.raises(ValueError, match="scales: shape"):
        kernels.qlinear_pack(4, codes, scales[:, :1].contiguous(), offsets, 32)
    with pytest.raises(ValueError, match="codes: dtype"):
        kernels.qlinear_pack(8, codes, scales, None, 32)
    bad = scales.clone()
    bad[1, 1] = 0.1  # not an fp16 value
    with pytest.raises(kernels.KernelError, match=r"scales: value 0.1.* at \[1, 1\] is not exactly representable"):
        kernels.qlinear_pack(4, codes, bad, offsets, 32)
    bad_off = offsets.clone()
    bad_off[0, 0] = float("inf")
    with pytest.raises(kernels.KernelError, match="offsets: .* not exactly representable"):
        kernels.qlinear_pack(4, codes, scales, bad_off, 32)
    packed = kernels.qlinear_pack(4, codes, scales, offsets, 32)
    with pytest.raises(ValueError, match=r"x: expected a contiguous float32 CPU tensor \[..., k = 64\], "
                                         r"got torch.float32 \(2, 32\)"):
        kernels.qlinear(torch.randn(2, 32), packed, 4, 4, 64, 32)
    with pytest.raises(ValueError, match="x: expected a contiguous float32 .* got torch.float16"):
        kernels.qlinear(torch.randn(2, 64).half(), packed, 4, 4, 64, 32)
    with pytest.raises(ValueError, match="bias: expected"):
        kernels.qlinear(torch.randn(2, 64), packed, 4, 4, 64, 32, bias=torch.randn(5))
    with pytest.raises(ValueError, match="out: expected"):
        kernels.qlinear(torch.randn(2, 64), packed, 4, 4, 64, 32, out=torch.empty(2, 5))


def test_packed_buffer_must_match_the_shape() -> None:
    codes, scales, offsets, _ = make_weight(8, 8, 64, 32, seed=0)
    packed = kernels.qlinear_pack(8, codes, scales, None, 32)
    assert packed.numel() == kernels.qlinear_packed_bytes(8, 8, 64, 32)
    with pytest.raises(ValueError, match="packed: expected the 1-D uint8 CPU tensor of"):
        kernels.qlinear(torch.randn(1, 64), packed, 8, 800, 64, 32)  # a larger weight than the one packed
    with pytest.raises(ValueError, match="packed: expected"):
        kernels.qlinear(torch.randn(1, 64), packed.view(torch.int8), 8, 8, 64, 32)
    # a weight of fewer bytes than the one packed was read as a prefix of it: silent garbage
    with pytest.raises(ValueError, match="packed: expected the 1-D uint8 CPU tensor of .* bytes"):
        kernels.qlinear(torch.randn(1, 32), packed, 8, 8, 32, 32)
    with pytest.raises(ValueError, match="packed: expected"):
        kernels.QLinearOp(packed, 8, 8, 32, 32)


# --- float activations ------------------------------------------------------------------------------


def check_float(bits: int, m: int, n: int, k: int, group: int, *, bias: bool = False, seed: int = 0,
                codes_fill: Optional[int] = None, x: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """Float-activation path against the float64 x @ W^T: only fp32 rounding may separate them."""
    codes, scales, offsets, w = make_weight(bits, n, k, group, seed, codes_fill)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, group)
    if x is None:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)) * 2
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    y = kernels.qlinear(x, packed, bits, n, k, group, bias=b, float_activations=True)
    op_y = kernels.QLinearOp(packed, bits, n, k, group, bias=b)(x, float_activations=True)
    assert torch.equal(y, op_y)
    ref = x.double() @ w.T + (b.double() if b is not None else 0)
    # Worst-case fp32 summation bound: (k + 4) unit roundoffs of the sum of the magnitudes of the
    # terms the kernel adds (x * s * q per input; for int4, x * offset through group sums of x;
    # the bias); typical errors are far below it.
    o = offsets.double().repeat_interleave(group, 1) if offsets is not None else torch.zeros_like(w)
    magnitude = x.double().abs() @ ((w - o).abs() + o.abs()).T + (b.double().abs() if b is not None else 0)
    err = (y.double() - ref).abs()
    assert (err <= (k + 4) * 2.0**-24 * magnitude + 1e-30).all(), f"max err {err.max()}"
    # Far tighter than int8 activations: the median error is ~1e-7 of the magnitude.
    assert (err / (magnitude + 1e-30)).median() < 1e-6


@pytest.mark.parametrize("bits", [8, 4])
# 1: the limb rows; 2..8 and 16: the float tiles, whose calls take 4 rows, and their tails (5, 7: odd); 17: a
# batch past them
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 16, 17])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (100, 576)])
def test_float_activations_shapes(isa: str, bits: int, m: int, n: int, k: int) -> None:
    check_float(bits, m, n, k, 32, seed=m * 1000 + n)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 6, 16])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_long_tiles(isa: str, bits: int, m: int, activations: str) -> None:
    # K = 1536 (down_proj's): tiles long enough that the AVX2 kernels prefetch the next tile; N = 40 is
    # three tiles, the last one half padding. M covers the limb rows (1), the float tiles' 2 and 4 rows per
    # call, 4 + 2 (a speculative verification step's 6), and a batch of 16.
    checker = check_float if activations == "float" else check
    checker(bits, m, 40, 1536, 32, bias=True, seed=m * 10 + bits)


def assert_first_and_last_rows_give(run, x: torch.Tensor, want: torch.Tensor, counts) -> None:
    """run(rows) on the first m and on the last m rows of x is bit-identical to those rows of `want`, per m."""
    for m in counts:
        assert torch.equal(run(x[:m]), want[:m]), m
        assert torch.equal(run(x[len(x) - m :]), want[len(x) - m :]), m


def test_plain_avx2_int8_weights_take_the_float_tiles_from_one_row_on() -> None:
    # On plain AVX2 one float row of int8 weights (the LM head) runs the float tiles, not three int8 limb rows (the
    # limbs' integer work costs more there): a row alone then has the bits it gets in any batch (2-8 rows: one
    # register-blocked form, 9 and more: the decoded chunks) and as limbs, without the limbs' cost.
    if "avx2" not in cpu_isas():
        pytest.skip("this CPU has no AVX2")
    codes, scales, offsets, w = make_weight(8, 40, 576, 32, seed=35)
    packed = kernels.qlinear_pack(8, codes, scales, offsets, 32)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(36)) * 2
    kernels.set_cpu_isa("avx2")
    try:
        alone = torch.cat([kernels.qlinear(x[i : i + 1], packed, 8, 40, 576, 32, float_activations=True)
                           for i in range(len(x))])  # fmt: skip
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 12):
            assert torch.equal(kernels.qlinear(x[:m], packed, 8, 40, 576, 32, float_activations=True), alone[:m]), m
        for m in (1, 6, 12):  # 6: a verification step's rows
            assert torch.equal(kernels.qlinear(x[:m], packed, 8, 40, 576, 32, float_activations=True, limbs=True),
                               alone[:m]), m  # fmt: skip
        check_float(8, 12, 40, 576, 32, seed=35, x=x)  # and the rows are right: fp32 rounding level
    finally:
        kernels.set_cpu_isa(None)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [96, 576])
def test_int8_activations_row_results_do_not_depend_on_the_batch(isa: str, bits: int, k: int) -> None:
    # A speculative verification step (or a batch) runs a sequence's rows together with others: with int8
    # activations each row's output must be bit-identical to that row run alone, for every register block
    # (AVX-512: 1-8 rows per call, AVX2 int8 weights: 1-4; AVX2 int4: 1-3 in one pass over both halves, 4-6 in
    # two, and from 8 rows every row of a call of
    # up to 64 over each unpacked chunk of 8 blocks, in groups of up to 5) and tail, so speculation never changes
    # what a request returns. K = 96: one short chunk; 576: two chunks and a tail of 2 blocks.
    codes, scales, offsets, _ = make_weight(bits, 40, k, 32, seed=31)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, 32)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(32)) * 2
    alone = torch.cat([kernels.qlinear(x[i : i + 1], packed, bits, 40, k, 32) for i in range(70)])
    assert_first_and_last_rows_give(lambda rows: kernels.qlinear(rows, packed, bits, 40, k, 32), x, alone,
                                    (2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 70))
    check(bits, 70, 40, k, 32, seed=31, x=x)  # and the rows are right


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [96, 576])
def test_float_activations_row_results_do_not_depend_on_the_batch(isa: str, bits: int, k: int) -> None:
    # From two rows on, float activations run the float tiles: a row's output must be bit-identical whichever rows
    # share the call (speculation's verification steps), for every row count, register block and tail (AVX2 int4:
    # 1-3 rows run both halves of the blocks at once, more rows in groups of 4-6, calls of up to 64 rows; K = 96
    # has an odd number of blocks).
    codes, scales, offsets, _ = make_weight(bits, 40, k, 32, seed=41)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, 32)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(42)) * 2
    every = kernels.qlinear(x, packed, bits, 40, k, 32, float_activations=True)
    assert_first_and_last_rows_give(lambda rows: kernels.qlinear(rows, packed, bits, 40, k, 32, float_activations=True),
                                    x, every, (2, 3, 4, 5, 7, 8, 13, 16, 17))
    check_float(bits, 70, 40, k, 32, seed=41, x=x)  # and the rows are right


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_many_rows_run_in_bands_of_rows(isa: str, bits: int, activations: str) -> None:
    # A prefill's rows are run in bands whose activations fit in the L2 (K = 1536: 64 float rows, 256 int8 rows
    # a band), each band over every tile: 613 rows make 10 float bands and 3 int8 bands, the last ones partial,
    # over 3 tiles, the last partial. Every row is right, and each band's rows are those of the rows alone.
    n, k, m = 40, 1536, 613
    float_acts = activations == "float"
    codes, scales, offsets, _ = make_weight(bits, n, k, 32, seed=51)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, 32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(52)) * 2
    every = kernels.qlinear(x, packed, bits, n, k, 32, float_activations=float_acts)
    for start in (0, 60, 250, 510, 600):  # chunks of 13 rows across band edges
        rows = x[start : start + 13]
        assert torch.equal(kernels.qlinear(rows, packed, bits, n, k, 32, float_activations=float_acts),
                           every[start : start + 13]), start
    (check_float if float_acts else check)(bits, m, n, k, 32, seed=51, x=x)


@pytest.mark.parametrize("bits", [8, 4])
def test_float_activations_as_limbs_row_results_do_not_depend_on_the_batch(isa: str, bits: int) -> None:
    # Float activations run one row as int8 limbs and several as float tiles, which round differently;
    # `limbs=True` (a one-sequence speculative verification step) gives every row, at every row count and
    # register block, the bits of that row run alone, which is the one-row call of plain float activations.
    codes, scales, offsets, w = make_weight(bits, 40, 576, 32, seed=33)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, 32)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(34)) * 2
    alone = torch.cat([kernels.qlinear(x[i : i + 1], packed, bits, 40, 576, 32, float_activations=True)
                       for i in range(17)])  # fmt: skip
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17):
        assert torch.equal(kernels.qlinear(x[:m], packed, bits, 40, 576, 32, float_activations=True, limbs=True),
                           alone[:m]), m  # fmt: skip
    op = kernels.QLinearOp(packed, bits, 40, 576, 32)
    assert torch.equal(op(x[:6], float_activations=True, limbs=True), alone[:6])
    ref = x.double() @ w.T  # and the rows are right: fp32 rounding level, as the float tiles
    tiles = kernels.qlinear(x, packed, bits, 40, 576, 32, float_activations=True).double()
    assert (alone.double() - ref).abs().max() <= 2 * (tiles - ref).abs().max() + 1e-4


@pytest.mark.parametrize("bits,group", [(8, 64), (8, 128), (8, "k"), (4, 64), (4, 128)])
def test_float_activations_group_sizes(isa: str, bits: int, group) -> None:
    k = 384 if group != "k" else 576
    check_float(bits, 3, 13, k, k if group == "k" else group, seed=4)
    if group == "k":
        check_float(bits, 2, 13, 96, 96, seed=8)  # K/32 odd: x must not be read past k


@pytest.mark.parametrize("bits,fill", [(8, 127), (8, -128), (4, 0), (4, 15)])
def test_float_activations_edge_codes_and_bias(isa: str, bits: int, fill: int) -> None:
    check_float(bits, 5, 10, 96, 32, codes_fill=fill, bias=True, seed=6)


@pytest.mark.parametrize("fill", [None, 127, -128])
def test_float_activations_int8_weights_many_rows(isa: str, fill: Optional[int]) -> None:
    # AVX2, int8 weights (the LM head): from 9 rows every row of a call (up to 64) runs over chunks of 4 decoded
    # blocks, 3 or 2 rows at a time; fewer rows run the per-call kernel, which must give the same bits. K = 288:
    # 9 blocks, two chunks and a tail of one; N = 40: the last tile half padding; 67 rows: a call of 64 and a
    # 3-row tail; 9-12 rows: groups of 3 and 2; the edge codes.
    codes, scales, _, _ = make_weight(8, 40, 288, 32, seed=61, codes_fill=fill)
    packed = kernels.qlinear_pack(8, codes, scales, None, 32)
    x = torch.randn(67, 288, generator=torch.Generator().manual_seed(62)) * 2
    every = kernels.qlinear(x, packed, 8, 40, 288, 32, float_activations=True)
    assert_first_and_last_rows_give(lambda rows: kernels.qlinear(rows, packed, 8, 40, 288, 32, float_activations=True),
                                    x, every, (2, 8, 9, 10, 11, 12, 64))
    check_float(8, 67, 40, 288, 32, bias=True, seed=61, codes_fill=fill, x=x)  # and the rows are right


@pytest.mark.parametrize("float_activations", [True, False], ids=["float-acts", "int8-acts"])
def test_int8_weights_streamed(isa: str, float_activations: bool) -> None:
    # Packed int8 weights of 8 MiB or more (the LM head) have each call request the next tile while one runs
    # (past the last tile after it), with float and with int8 activations (w4a8's LM head), at any row count: the
    # outputs are those of the same rows packed as a small weight, and right. N = 16392: 1025 tiles, 10 MB, the
    # last tile half padding. (A small weight requests too in calls of up to 16 rows, decode steps: see
    # test_decode_calls_give_the_rows_of_a_larger_call for the kernels that take there.)
    n, k = 16392, 576
    g = torch.Generator().manual_seed(71)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    packed = kernels.qlinear_pack(8, codes, scales, None, 32)
    assert packed.numel() >= 8 << 20
    x = torch.randn(16, k, generator=g) * 2
    for m in (1, 2, 4, 6, 9, 16):
        y = kernels.qlinear(x[:m], packed, 8, n, k, 32, float_activations=float_activations)
        for rows in (slice(0, 40), slice(n - 40, n)):
            small = kernels.qlinear_pack(8, codes[rows].contiguous(), scales[rows].contiguous(), None, 32)
            want = kernels.qlinear(x[:m], small, 8, 40, k, 32, float_activations=float_activations)
            assert torch.equal(y[:, rows], want), (m, rows)
            w = codes[rows].double() * scales[rows].double().repeat_interleave(32, 1)
            if float_activations:
                err = (want.double() - x[:m].double() @ w.T).abs()
                assert (err <= (k + 4) * 2.0**-24 * (x[:m].double().abs() @ w.abs().T)).all()
            else:  # the quantized-activation reference, as check() holds every int8-activation path to
                x_deq, _ = quantize_activations(x[:m])
                err = (want.double() - x_deq @ w.T).abs()
                assert (err <= 1e-5 * (x_deq.abs() @ w.abs().T) + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k", [96, 576])
def test_decode_calls_give_the_rows_of_a_larger_call(isa: str, bits: int, k: int) -> None:
    # Calls of up to 16 rows (decode steps) request the next tile while one runs, whatever the weight's size (a
    # model's weights come back from memory at every step), and one row of int8 weights then runs both halves of a
    # tile in one pass on plain AVX2. Int8-activation rows do not depend on the rows that share the call, so each
    # row must equal the same row after 64 others: a call past 16 rows on a weight below 8 MiB requests nothing,
    # and its last rows are a chunk of work of their own (64 rows a chunk), run by the same kernel calls as the
    # decode call's rows (two passes for one int8 row). And right. N = 40: three tiles, the last half padding;
    # K = 96 has an odd number of blocks.
    codes, scales, offsets, _ = make_weight(bits, 40, k, 32, seed=81)
    packed = kernels.qlinear_pack(bits, codes, scales, offsets, 32)
    g = torch.Generator().manual_seed(82)
    x, others = torch.randn(16, k, generator=g) * 2, torch.randn(64, k, generator=g) * 2
    for m in (1, 2, 3, 4, 5, 6, 16):  # plain AVX2 int4: one pass at 1-3 rows, two passes at 4-6, chunks at 16
        y = kernels.qlinear(x[:m], packed, bits, 40, k, 32)
        assert torch.equal(y, kernels.qlinear(torch.cat([others, x[:m]]), packed, bits, 40, k, 32)[64:]), m
        check(bits, m, 40, k, 32, seed=81, x=x[:m])


def test_float_activations_is_more_accurate_than_int8() -> None:
    # The reason the path exists: on the same weight, float activations land much closer to x @ W^T.
    codes, scales, offsets, w = make_weight(4, 64, 576, 32, seed=12)
    packed = kernels.qlinear_pack(4, codes, scales, offsets, 32)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(13))
    ref = x.double() @ w.T
    err_f = (kernels.qlinear(x, packed, 4, 64, 576, 32, float_activations=True).double() - ref).abs().max()
    err_q = (kernels.qlinear(x, packed, 4, 64, 576, 32).double() - ref).abs().max()
    assert err_f * 100 < err_q


def test_qlinear_op_checks() -> None:
    codes, scales, offsets, w = make_weight(8, 5, 64, 32, seed=1)
    packed = kernels.qlinear_pack(8, codes, scales, None, 32)
    op = kernels.QLinearOp(packed, 8, 5, 64, 32)
    x = torch.randn(2, 3, 64)
    assert torch.equal(op(x), kernels.qlinear(x, packed, 8, 5, 64, 32))
    assert op(x).shape == (2, 3, 5)
    with pytest.raises(ValueError, match="x: expected a contiguous float32"):
        op(torch.randn(64, 2).T)
    with pytest.raises(ValueError, match="x: expected a contiguous float32"):
        op(torch.randn(2, 64).double())
    with pytest.raises(ValueError, match="packed: expected"):
        kernels.QLinearOp(packed, 8, 500, 64, 32)
    with pytest.raises(ValueError, match="bias: expected"):
        kernels.QLinearOp(packed, 8, 5, 64, 32, bias=torch.randn(4))


def test_activations_value_is_checked() -> None:
    codes, scales, _, _ = make_weight(8, 4, 64, 32, seed=0)
    packed = kernels.qlinear_pack(8, codes, scales, None, 32)
    x, y = torch.randn(1, 64), torch.empty(1, 4)
    status = kernels.library().trtpaged_qlinear_cpu_ex(x.data_ptr(), 1, packed.data_ptr(), 8, 4, 64, 32, None,
                                                       y.data_ptr(), 3)  # fmt: skip
    assert status != 0
    assert ("activations: must be 0 (int8), 1 (float32) or 2 (float32 as limbs), got 3"
            in kernels.library().trtpaged_last_error().decode())


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_module_runs_the_kernel_of_its_activations(activations: str) -> None:
    from trtpaged.models import qlinear as qlinear_module
    from trtpaged.models.quant import QuantizedWeight

    codes, scales, offsets, w = make_weight(4, 24, 96, 32, seed=21)
    bias = torch.randn(24)
    module = qlinear_module.QuantizedLinear.from_weight(QuantizedWeight(4, 32, codes, scales, offsets), bias,
                                                        torch.float32)  # fmt: skip
    qlinear_module.set_activations(module, activations)
    packed = kernels.qlinear_pack(4, codes, scales, offsets, 32)
    for m in (1, 2, 3, 6):
        x = torch.randn(1, m, 96)
        want = kernels.qlinear(x, packed, 4, 24, 96, 32, bias=bias, float_activations=activations == "float")
        assert torch.equal(module(x), want), m
    # A transposed (non-contiguous) x is made contiguous, not rejected.
    xt = torch.randn(96, 2).T
    assert torch.equal(module(xt), module(xt.contiguous()))
