"""Quantized KV cache (int8, fp8_e4m3): CPU kernels against plain references.

Three truths: (1) the rows the kernel writes equal PyTorch's own quantization (torch.round,
torch's float8_e4m3fn cast) byte for byte, scales included; (2) attention over a quantized pool
equals float64 attention over the same pool de-quantized with the same scales, within fp32
rounding; (3) against attention over the full-precision values it stays within the documented
bound (docs/quantization.md, "KV cache").
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernel_cases import MIXED_SPECS, Batch, make_batch, tie_rows, write_rows
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_quant import (
    STORAGE_DTYPES,
    dequantize_rows,
    pack_rows,
    quantize_rows,
    split_rows,
)
from trtpaged.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")

KV_CACHE_DTYPES = ["int8", "fp8_e4m3"]
# Max abs error of attention over the quantized cache against attention over the full-precision
# values, for unit-normal K/V (docs/quantization.md); measured 0.017-0.023 (int8), 0.10-0.12 (fp8).
FULL_PRECISION_BOUND = {"int8": 0.04, "fp8_e4m3": 0.25}


def quantized(batch: Batch, kv_cache_dtype: str) -> Batch:
    """The batch with its (random float) pool quantized row by row into kv_cache_dtype's layout."""
    pool = pack_rows(*quantize_rows(batch.kv_cache, kv_cache_dtype))
    return Batch(batch.q, batch.k, batch.v, pool, *batch.args()[4:], scale=batch.scale)


def run_kernel(batch: Batch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.kv_cache.clone()
    args = batch.args()
    out = kernels.paged_attention(*args[:3], cache, *args[4:], AttentionOptions(layer, batch.scale))
    return out, cache


def run_reference(batch: Batch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = batch.kv_cache.clone()
    args = batch.args()
    out = paged_attention_reference(*args[:3], cache, *args[4:], AttentionOptions(layer, batch.scale))
    return out, cache


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_codec_matches_torch_rounding(kv_cache_dtype: str) -> None:
    # magnitudes whose scales are normal fp16 numbers (max|x| >= 127 * 2^-14); below that the scale is
    # subnormal and its step, 2^-24, is what bounds the error (tiny in absolute terms)
    x = torch.randn(50, 64) * torch.logspace(-1, 3, 50)[:, None]
    x[3] = 0.0  # an all-zero row: scale 0, codes 0
    codes, scales = quantize_rows(x, kv_cache_dtype)
    assert scales[3] == 0 and torch.all(codes[3].float() == 0)
    # the fp16 scale: within 2^-11 relative of max|x| / M (M = 127 or 448)
    exact = x.abs().amax(-1) / (127.0 if kv_cache_dtype == "int8" else 448.0)
    assert torch.all((scales - exact).abs() <= exact * 2.0**-11)
    back = dequantize_rows(pack_rows(codes, scales))
    rel = ((back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30))
    # half a step of the code grid (1/254 for int8, 2^-4 relative for e4m3's 3 mantissa bits), plus
    # the clamp when the fp16 scale rounded down (at most 2^-11 of max|x|)
    assert rel.max() <= (0.5 / 127 if kv_cache_dtype == "int8" else 2.0**-4) + 2.0**-11
    c2, s2 = split_rows(pack_rows(codes, scales))
    assert same_bytes(c2, codes) and torch.equal(s2, scales)


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_write_rounds_every_tie_like_torch(kv_cache_dtype: str) -> None:
    # Rows with scale exactly 1 holding every midpoint between neighbouring codes and the floats either
    # side: the kernel's codes are torch's rounding of them (half to even). The fp8 encoder checked here
    # (plugins/src/fp8_e4m3.h) is also the CUDA kernels' on sm_80.
    rows, expected = tie_rows(kv_cache_dtype)
    pool = torch.zeros(1, 1, 2, 1, 64, 64 + 2, dtype=expected.dtype)
    write_rows(kernels, rows, pool)
    codes, scales = split_rows(pool[0, 0, 0, 0, : rows.shape[0]])
    assert torch.all(scales == 1.0)
    assert same_bytes(codes, expected)


@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_write_and_attention_match_the_dequantizing_reference(kv_cache_dtype: str, block_size: int) -> None:
    batch = quantized(make_batch(MIXED_SPECS, block_size=block_size, seed=block_size), kv_cache_dtype)
    out, cache = run_kernel(batch, layer=1)
    ref, ref_cache = run_reference(batch, layer=1)
    # every byte of the pool (codes and scales of every slot and layer) as PyTorch quantizes it
    assert same_bytes(cache, ref_cache)
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= 2e-5, f"max abs error {err} against attention on the de-quantized cache"


@pytest.mark.parametrize("io_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_half_io(kv_cache_dtype: str, io_dtype: torch.dtype) -> None:
    batch = quantized(make_batch([(0, 33), (40, 1), (17, 5)], io_dtype=io_dtype, seed=9), kv_cache_dtype)
    out, cache = run_kernel(batch, layer=0)
    ref, ref_cache = run_reference(batch, layer=0)
    assert same_bytes(cache, ref_cache)
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= {torch.float16: 4e-3, torch.bfloat16: 3e-2}[io_dtype]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_long_context_split_and_head_dims(kv_cache_dtype: str) -> None:
    # key ranges split across tasks and merged; the fused int8 loops (head_dim 64, 128) and the
    # de-quantize-into-scratch path (other head dims, and every fp8 cache)
    for batch, layer in ((make_batch([(3001, 1)], num_layers=1, seed=4), 0),
                         (make_batch([(700, 9), (0, 40)], head_dim=128, num_layers=2, seed=8), 1),
                         (make_batch([(300, 3), (0, 21)], head_dim=80, num_layers=1, seed=10), 0)):
        qb = quantized(batch, kv_cache_dtype)
        out, cache = run_kernel(qb, layer)
        ref, ref_cache = run_reference(qb, layer)
        assert same_bytes(cache, ref_cache)
        assert (out.double() - ref.double()).abs().max().item() <= 2e-5


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_against_full_precision_within_documented_bound(kv_cache_dtype: str) -> None:
    batch = make_batch(MIXED_SPECS, seed=21)
    full, _ = run_reference(batch, layer=2)
    out, _ = run_kernel(quantized(batch, kv_cache_dtype), layer=2)
    err = (out.double() - full.double()).abs().max().item()
    assert 0 < err <= FULL_PRECISION_BOUND[kv_cache_dtype], f"max abs error {err}"


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_rows_are_written_once(kv_cache_dtype: str) -> None:
    # A later token 1000x larger lands in the same block: earlier rows keep their bytes.
    batch = quantized(make_batch([(0, 5)], num_layers=1, seed=3), kv_cache_dtype)
    _, cache = run_kernel(batch, layer=0)
    block = int(batch.block_tables[0, 0])
    big = make_batch([(5, 1)], num_layers=1, seed=3)
    step = Batch(big.q, big.k * 1000, big.v * 1000, cache.clone(), big.positions, big.query_start,
                 big.context_lens, batch.block_tables, scale=batch.scale)  # fmt: skip
    _, after = run_kernel(step, layer=0)
    assert same_bytes(after[block, :, :, :, :5], cache[block, :, :, :, :5])
    assert not same_bytes(after[block, :, :, :, 5], cache[block, :, :, :, 5])


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_copy_swap_and_cow_carry_the_scales(kv_cache_dtype: str) -> None:
    batch = quantized(make_batch([(0, 21)], num_layers=2, spare_blocks=4, seed=5), kv_cache_dtype)
    out, cache = run_kernel(batch, layer=1)
    src = batch.block_tables[0, :2].tolist()
    spare = sorted(set(range(cache.shape[0])) - set(batch.block_tables[0].tolist()))[:2]
    # copy-on-write inside the pool
    kernels.copy_blocks(cache, list(zip(src, spare)))
    for s, d in zip(src, spare):
        assert same_bytes(cache[d], cache[s])
        _, scales = split_rows(cache[d])
        assert scales.abs().sum() > 0
    # the copies are readable with their scales: decode over the copied blocks equals the original
    copied_tables = batch.block_tables.clone()
    copied_tables[0, :2] = torch.tensor(spare, dtype=torch.int32)
    decode = make_batch([(21, 1)], num_layers=2, seed=6)
    outs = []
    for tables in (batch.block_tables, copied_tables):
        step = Batch(decode.q, decode.k, decode.v, cache.clone(), decode.positions, decode.query_start,
                     decode.context_lens, tables, scale=batch.scale)  # fmt: skip
        outs.append(run_kernel(step, layer=1)[0])
    assert torch.equal(outs[0], outs[1])
    # swap out to a host pool and back into other blocks
    host = torch.zeros((3, *cache.shape[1:]), dtype=cache.dtype)
    kernels.swap_blocks(cache, host, [(src[0], 2), (src[1], 0)])
    back = torch.zeros_like(cache)
    kernels.swap_blocks(host, back, [(2, 5), (0, 1)])
    assert same_bytes(back[5], cache[src[0]]) and same_bytes(back[1], cache[src[1]])
    assert torch.equal(dequantize_rows(back[5]), dequantize_rows(cache[src[0]]))


def _raw_call(io_dtype: int, kv_cache_dtype: int) -> tuple[int, str]:
    batch = make_batch([(0, 2)], num_layers=1)
    params = kernels._AttentionParams(2, 1, batch.block_tables.shape[1], 9, 3, 64, batch.kv_cache.shape[0], 1, 0,
                                      16, 0.125, io_dtype, kv_cache_dtype)  # fmt: skip
    lib = kernels.library()
    out = torch.empty_like(batch.q)
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (*batch.args(), out)]
    rc = lib.trtpaged_paged_attention_cpu(ctypes.byref(params), *ptrs)
    return rc, lib.trtpaged_last_error().decode()


def test_bad_dtypes_are_refused_with_the_allowed_values() -> None:
    rc, msg = _raw_call(0, 9)
    assert rc == 1 and msg.startswith("kv_cache_dtype:") and "int8, fp8_e4m3" in msg
    rc, msg = _raw_call(3, 3)  # int8 is a cache format, not an activation dtype
    assert rc == 1 and msg.startswith("io_dtype:") and "float32, float16, bfloat16" in msg


def test_pool_head_dim_must_leave_room_for_the_scale() -> None:
    batch = make_batch([(0, 3)], num_layers=1)
    wrong = torch.zeros(batch.kv_cache.shape, dtype=STORAGE_DTYPES["int8"])  # rows of head_dim, no scale
    with pytest.raises(ValueError, match="kv_cache: head_dim"):
        kernels.paged_attention(*batch.args()[:3], wrong, *batch.args()[4:], AttentionOptions(0, batch.scale))


# --- model.yaml, memory plan, build -----------------------------------------------------------------


def test_bytes_per_token_and_the_memory_plan() -> None:
    from trtpaged.manifest import KVCacheBudget, Limits, Manifest, ModelDims

    dims = ModelDims("LlamaForCausalLM", num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                     num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=1e5)  # fmt: skip
    # K and V x 30 layers x 3 heads x (64 codes + 2 scale bytes)
    assert dims.kv_bytes_per_token("int8") == dims.kv_bytes_per_token("fp8_e4m3") == 2 * 30 * 3 * 66
    assert dims.kv_bytes_per_token("float16") == 2 * 30 * 3 * 128
    from trtpaged.memory_plan import plan_memory

    manifest = Manifest(dims, Limits(32, 2048, 2048, 16), KVCacheBudget(memory_bytes=2**30), "float32", "int8")
    plan = plan_memory(manifest)
    assert plan.num_kv_blocks == 2**30 // (2 * 30 * 3 * 66 * 16)
    text = "\n".join(plan.lines(512))
    fits = {name: 2**30 // (2 * 30 * 3 * row * 16) // 32 for name, row in (("int8", 66), ("float16", 128),
                                                                            ("float32", 256))}  # fmt: skip
    assert f"{fits['int8']:>8,} sequences, {fits['int8'] / fits['float16']:.2f}x float16" in text
    assert f"{fits['float16']:>8,} sequences" in text and "(this engine)" in text
    assert fits["int8"] / fits["float16"] >= 1.9 and fits["int8"] / fits["float32"] >= 3.8


def test_kv_cache_dtype_blocks_in_the_same_memory() -> None:
    from trtpaged.bench.memory_bench import Budget, kv_cache_dtype_blocks

    budget = Budget(num_kv_blocks=1456, block_size=16, max_seq_len=2048, max_batch_size=256, max_num_tokens=2048)
    assert kv_cache_dtype_blocks(budget, "float16", "int8", 64) == 1456 * 128 // 66
    assert kv_cache_dtype_blocks(budget, "float16", "float32", 64) == 728
    assert kv_cache_dtype_blocks(budget, "float32", "fp8_e4m3", 128) == 1456 * 512 // 130


def test_bench_memory_kv_cache_dtype_cli() -> None:
    import json

    from click.testing import CliRunner

    from trtpaged.cli import main

    r = CliRunner().invoke(main, ["bench", "memory", "--num-requests", "40", "--prompt-len", "100:300",
                                  "--output-len", "50:200", "--num-kv-blocks", "64", "--max-batch-size", "64",
                                  "--kv-cache-dtype", "int8", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    rows = {row["kv_cache_dtype"]: row for row in json.loads(r.stdout[r.stdout.index("{"):])["kv_cache_dtypes"]["rows"]}
    assert [rows[k]["num_kv_blocks"] for k in ("float32", "float16", "int8")] == [32, 64, 64 * 128 // 66]
    # more blocks, more sequences at once while requests wait
    running = {k: rows[k]["saturated_running"] for k in ("int8", "float16", "float32")}
    assert running["int8"] > running["float16"] > running["float32"]
    bad = CliRunner().invoke(main, ["bench", "memory", "--kv-cache-dtype", "int4"])
    assert bad.exit_code != 0 and "int8" in bad.output and "fp8_e4m3" in bad.output


def test_tensorrt_backend_takes_a_quantized_cache(tmp_path) -> None:
    # int8 / fp8_e4m3 have CUDA kernels and a plugin field now: what stops this build is the machine
    from trtpaged.builder import compile as trt_compile
    from trtpaged.builder.pipeline import build_engine
    from trtpaged.config import ConfigError, parse_config

    for kv_cache_dtype in KV_CACHE_DTYPES:
        assert trt_compile.kv_cache_dtype_reason(kv_cache_dtype) is None
        config = parse_config({"model": {"tiny": {}}, "kv_cache_dtype": kv_cache_dtype, "backend": "tensorrt"})
        with pytest.raises(ConfigError) as e:
            build_engine(config, tmp_path / "e", echo=lambda s: None)
        assert "kv_cache_dtype" not in str(e.value) and "backend: 'tensorrt' cannot be built here" in str(e.value)
    reason = trt_compile.kv_cache_dtype_reason("int4")  # a format without CUDA kernels is refused by name
    assert reason.startswith("kv_cache_dtype int4 with backend tensorrt") and "backend: torch" in reason


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_tiny_build_generates_and_reports_kv_accuracy(tmp_path, kv_cache_dtype: str) -> None:
    from click.testing import CliRunner

    from trtpaged import LLM
    from trtpaged.builder.pipeline import build_engine
    from trtpaged.cli import main
    from trtpaged.config import parse_config
    from trtpaged import SamplingParams

    data = {"model": {"tiny": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "hidden_size": 64, "intermediate_size": 128, "vocab_size": 320}},
            "kv_cache_dtype": kv_cache_dtype, "max_seq_len": 256, "kv_cache": {"num_kv_blocks": 64}, "backend": "auto"}
    result = build_engine(parse_config(data), tmp_path / "e", echo=lambda s: None)
    m = result.manifest
    assert m.kv_cache_dtype == kv_cache_dtype and m.backends == ["torch"]
    assert m.kv_bytes_per_token == 2 * 2 * 2 * (16 + 2)  # K/V x layers x kv heads x (head_dim codes + scale)
    kv = m.verification["kv_cache"]
    assert kv["kv_cache_dtype"] == kv_cache_dtype and 0 <= kv["max_abs_diff"]
    assert kv["top1_agreement"] >= kv["threshold"]
    # the graph TensorRT compiles: an int8-byte pool with rows of head_dim + 2, the format a node attribute,
    # verified (onnx.reference, numpy + PyTorch's quantization) against the eager step model's kernels
    import onnx

    from trtpaged.builder import compile as trt_compile

    graph = onnx.load(str(tmp_path / "e" / "model.onnx"), load_external_data=False).graph
    pool = next(i for i in graph.input if i.name == "kv_cache").type.tensor_type
    assert pool.elem_type == onnx.TensorProto.INT8 and pool.shape.dim[-1].dim_value == 16 + 2
    attrs = [a.s.decode() for n in graph.node if n.op_type == "TrtpagedPagedAttention" for a in n.attribute
             if a.name == "kv_cache_dtype"]
    assert attrs == [kv_cache_dtype, kv_cache_dtype]
    trt_compile.check_kv_cache_dtypes(tmp_path / "e" / "model.onnx")
    assert f"{kv_cache_dtype} cache" in m.verification["method"]
    assert m.verification["max_abs_diff"] <= m.verification["tolerance"]
    llm = LLM(tmp_path / "e", device="cpu")
    pool = llm.engine.runner.kv_cache
    assert pool.dtype == STORAGE_DTYPES[kv_cache_dtype] and pool.shape[-1] == 16 + 2
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    assert f"KV cache {kv_cache_dtype} vs float32 cache: max |dlogit|" in r.output
    assert f"{kv_cache_dtype:<9}" in r.output


def test_kernel_bench_counts_the_bytes_read_and_times_the_float_caches() -> None:
    from trtpaged.bench.kernel_bench import format_report, run_kernel_bench

    report = run_kernel_bench("int8", contexts=(64,), batches=(2,), budget_s=0.02)
    row = report["decode"][0]
    assert row["kv_bytes"] == 2 * 2 * 64 * 3 * (64 + 2)  # K and V, batch, context, kv heads, codes + scale
    assert row["float32_ms"] > 0 and row["float16_ms"] > 0
    assert "fp32 ms" in format_report(report) and report["kv_cache_dtype"] == "int8"


def test_bench_kernel_on_cuda_says_why_it_cannot_run_here() -> None:
    from click.testing import CliRunner

    from trtpaged.cli import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: scripts/gpu_check.sh runs this benchmark")
    r = CliRunner().invoke(main, ["bench", "kernel", "--device", "cuda", "--kv-cache-dtype", "int8", "--quick"])
    assert r.exit_code != 0 and "no CUDA device" in r.output


_FP8_HALF_BITS_PROGRAM = r"""
#include <cstdio>
#include "fp8_e4m3.h"
int main() {  // code, e4m3_decode(code), e4m3_half_bits(code) as fp16 x 256 (_Float16: the compiler's conversion)
  for (int c = 0; c < 256; ++c) {
    _Float16 h;
    const uint16_t bits = trtpaged::e4m3_half_bits(static_cast<uint8_t>(c));
    __builtin_memcpy(&h, &bits, 2);
    std::printf("%d %.9g %.9g\n", c, trtpaged::e4m3_decode(static_cast<uint8_t>(c)), static_cast<float>(h) * 256.0f);
  }
}
"""


def test_fp8_decoders_agree_with_torch_on_every_code(tmp_path) -> None:
    # the software decoders of plugins/src/fp8_e4m3.h (the table one the CPU kernels use, and the
    # branch-free fp16-bits one the CUDA kernels use on sm_80) against torch's float8_e4m3fn, all 256 codes
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = Path(__file__).resolve().parent.parent / "plugins" / "src"
    (tmp_path / "t.cpp").write_text(_FP8_HALF_BITS_PROGRAM)
    built = subprocess.run([cxx, "-std=c++17", f"-I{src}", str(tmp_path / "t.cpp"), "-o", str(tmp_path / "t")],
                           capture_output=True, text=True)
    if built.returncode != 0 and "_Float16" in built.stderr:
        pytest.skip("the host compiler has no _Float16")
    assert built.returncode == 0, built.stderr
    rows = [line.split() for line in subprocess.run([str(tmp_path / "t")], capture_output=True, text=True,
                                                     check=True).stdout.splitlines()]
    truth = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    for code, table, half in rows:
        want = truth[int(code)].item()
        if want != want:  # NaN (0x7f, 0xff): the table decoder says NaN; the fp16-bits one +-480 (callers test)
            assert float(table) != float(table) and abs(float(half)) == 480.0
        else:
            assert float(table) == want and float(half) == want, (code, table, half, want)


def test_the_kv_format_table_matches_the_c_abi_and_the_codec() -> None:
    # trtpaged.kv_formats is the one table of KV formats: its C codes are the header's trtpaged_dtype
    # values, its row sizes what the codec and the pool allocation produce
    import re
    from pathlib import Path

    from trtpaged.kv_formats import KV_FORMATS

    header = (Path(__file__).resolve().parent.parent / "plugins/include/trtpaged/trtpaged.h").read_text()
    enum = {name.lower(): int(v) for name, v in re.findall(r"TRTPAGED_(\w+) = (\d+)", header)}
    for name, fmt in KV_FORMATS.items():
        assert enum[name] == fmt.abi_code, name
        if fmt.quantized:
            codes, scales = quantize_rows(torch.randn(3, 64), name)
            assert pack_rows(codes, scales).shape[-1] == fmt.row_elements(64) == 64 + fmt.scale_bytes
            assert fmt.row_bytes(64) == 66
        else:
            assert torch.empty(0, dtype=getattr(torch, name)).element_size() == fmt.element_bytes
