"""The weight-streaming limit `bench throughput` states for single-stream decode: the weight bytes a decode step
reads, counted from the model's shapes (and the kernel library's packed sizes), not from the modules it walks."""

from __future__ import annotations

import math

import pytest

from tests.conftest import TINY_KV4, build_from_dict
from trtpaged.bench import streaming_limit
from trtpaged.bench.throughput_bench import Request, format_throughput_report, run_throughput_bench, run_trtpaged
from trtpaged.runtime.llm import LLM
from trtpaged.runtime.sampling_params import SamplingParams

ONE = [Request(tuple(range(10, 40)), 6)]

# untied int4 linears with float activations and an int8 LM head (dims the kernels take: multiples of 32)
QUANTIZED_TINY = {
    **TINY_KV4,
    "model": {"tiny": {**TINY_KV4["model"]["tiny"], "seed": 7, "tie_word_embeddings": False}},
    "quantization": {"weights": "int4", "group_size": 32, "lm_head": "int8", "activations": "float"},
}


def _linear_shapes(dims) -> list[tuple[int, int]]:
    """(out, in) of every body linear, as the engine fuses them (qkv, o, gate_up, down per layer)."""
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    per_layer = [(q + 2 * kv, dims.hidden_size), (dims.hidden_size, q), (2 * dims.intermediate_size, dims.hidden_size),
                 (dims.hidden_size, dims.intermediate_size)]
    return per_layer * dims.num_layers


def _norm_bytes(dims) -> int:
    return (2 * dims.num_layers + 1) * dims.hidden_size * 4  # two norms a layer and the final one, float32


def _model(engine_dir) -> tuple:
    llm = LLM(str(engine_dir))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llm.engine.runner.model, llm.manifest.dims


def test_a_float_engine_reads_every_linear_and_its_own_lm_head_not_the_embedding(tiny_engine_dir) -> None:
    model, dims = _model(tiny_engine_dir)
    assert not dims.tie_word_embeddings
    linears = sum(n * k for n, k in _linear_shapes(dims)) * 4
    head = dims.vocab_size * dims.hidden_size * 4
    assert streaming_limit.decode_weight_bytes(model) == linears + head + _norm_bytes(dims)


@pytest.fixture(scope="module")
def quantized_engine(tmp_path_factory: pytest.TempPathFactory):
    from trtpaged import kernels

    if not kernels.available():
        pytest.skip("the kernel library is not built")
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config

    # random weights quantized to int4 fail the accuracy stage by design; the build is not the subject here
    out = tmp_path_factory.mktemp("limit") / "tiny-int4"
    return build_engine(parse_config(QUANTIZED_TINY), out, skip_verify=True, echo=lambda _line: None).engine_dir


def test_a_quantized_engine_reads_the_kernels_packed_weights(quantized_engine) -> None:
    from trtpaged import kernels

    model, dims = _model(quantized_engine)
    body = sum(kernels.qlinear_packed_bytes(4, n, k, 32) for n, k in _linear_shapes(dims))
    head = kernels.qlinear_packed_bytes(8, dims.vocab_size, dims.hidden_size, 32)
    assert streaming_limit.decode_weight_bytes(model) == body + head + _norm_bytes(dims)


def test_a_tied_float_head_counts_the_embedding_table_once(tmp_path) -> None:
    tied = {**TINY_KV4, "model": {"tiny": {**TINY_KV4["model"]["tiny"], "tie_word_embeddings": True}}}
    engine = build_from_dict(tied, tmp_path / "tied")
    model, dims = _model(engine)
    assert dims.tie_word_embeddings
    linears = sum(n * k for n, k in _linear_shapes(dims)) * 4
    table = dims.vocab_size * dims.hidden_size * 4
    assert streaming_limit.decode_weight_bytes(model) == linears + table + _norm_bytes(dims)


def test_the_limit_is_the_weights_over_the_bandwidth_and_the_line_states_the_fraction() -> None:
    limit = streaming_limit.StreamingLimit(weight_bytes=90_000_000, read_gbs=30.0)
    assert math.isclose(limit.limit_s, 0.003)
    line = limit.describe(0.004)
    assert "90.0 MB" in line and "30.0 GB/s" in line and "3.00 ms" in line and "0.75 of the limit" in line


def test_the_bandwidth_buffer_is_the_weights_size_within_its_bounds() -> None:
    assert streaming_limit.buffer_bytes(96_576_768) == 96_576_768
    assert streaming_limit.buffer_bytes(1_000) == streaming_limit.MIN_READ_BYTES
    assert streaming_limit.buffer_bytes(16 << 30) == streaming_limit.MAX_READ_BYTES  # a 16 GB float model


def test_a_single_stream_row_reports_its_weights_and_a_bandwidth(tiny_engine_dir) -> None:
    result = run_trtpaged(str(tiny_engine_dir), ONE)
    weights = streaming_limit.decode_weight_bytes(_model(tiny_engine_dir)[0])
    assert result.weight_bytes_per_step == weights
    assert result.read_gbs is not None and result.read_gbs > 0
    several = run_trtpaged(str(tiny_engine_dir), ONE * 2)  # two at once: not a single stream
    assert several.weight_bytes_per_step is None and several.read_gbs is None


def test_the_report_states_the_fraction_of_the_limit_for_a_single_stream(tiny_engine_dir) -> None:
    report = run_throughput_bench(str(tiny_engine_dir), ONE, baseline="none")
    row = report["systems"][0]
    expected = row["weight_bytes_per_step"] / (row["read_gbs"] * 1e9) / row["tpot_p50_s"]
    line = next(x for x in format_throughput_report(report).splitlines() if "weight-streaming limit" in x)
    assert line.startswith("trtpaged: ") and line.endswith(f"{expected:.2f} of the limit")


def test_a_tensor_parallel_row_states_no_limit(tiny_kv4_engines) -> None:
    """Rank 0's runner holds its shard only (and the ranks read theirs with their own threads): the row gave that
    shard's bytes over one rank's bandwidth as the limit; it now gives none, as for a CUDA or TensorRT runner."""
    one, two = (run_trtpaged(str(tiny_kv4_engines[n]), ONE) for n in (1, 2))
    assert one.weight_bytes_per_step and one.read_gbs  # the same model on one rank has one
    assert two.weight_bytes_per_step is None and two.read_gbs is None


def test_the_throughput_benchmark_module_imports_no_torch() -> None:
    """Every `trtpaged bench` command imports this module (through the llama.cpp row's options): it loads torch only
    where a row runs a model (the limit's torch imports are for type hints only; they cost 1.1 s at import)."""
    import subprocess
    import sys

    code = "import sys, trtpaged.bench.throughput_bench; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"
