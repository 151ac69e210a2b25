"""trtpaged's step model against transformers' own forward, on packed mixed batches."""

from __future__ import annotations

import pytest
import torch

from trtpaged.builder.probe import ProbeSequence, hf_logits, pack_step, standard_probe
from trtpaged.config import parse_config
from trtpaged.models import dims_from_hf_config, load_hf, load_step_model, spec_from_manifest, step_model_from_hf
from trtpaged.models.rope import inv_frequencies

VARIANTS = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "llama-bias": {"attention_bias": True, "mlp_bias": True},
    "llama3-rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500.0},
    "mistral": {"architecture": "MistralForCausalLM"},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "num_attention_heads": 6, "num_key_value_heads": 2,
              "hidden_size": 96},
    "mha-head-dim": {"num_key_value_heads": 4, "head_dim": 32},
}


def _tiny(**overrides):
    config = parse_config({"model": {"tiny": {"num_hidden_layers": 3, **overrides}}})
    hf = load_hf(config.model)
    return hf, dims_from_hf_config(hf.config)


def _run_probe(model, hf, dims, block_size: int) -> float:
    seqs, steps, num_kv_blocks = standard_probe(dims.vocab_size, block_size, seed=3, all_rows=True)
    cache = model.new_kv_cache(num_kv_blocks, block_size)
    worst = 0.0
    for step in steps:
        with torch.no_grad():
            logits, returned = model(*step.args(cache))
        assert returned is cache  # in place, no copy of the pool
        assert logits.dtype == torch.float32 and logits.shape == (len(step.rows), dims.vocab_size)
        worst = max(worst, (logits - hf_logits(hf.model, seqs, step.rows)).abs().max().item())
    return worst


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [8, 16])
def test_step_model_matches_hf_on_packed_mixed_batches(variant, block_size):
    hf, dims = _tiny(**VARIANTS[variant])
    model = step_model_from_hf(hf.model, dims)
    assert _run_probe(model, hf, dims, block_size) < 1e-4


def test_tied_embeddings_have_one_parameter():
    hf, dims = _tiny(tie_word_embeddings=True)
    model = step_model_from_hf(hf.model, dims)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()


def test_only_logits_index_rows_are_returned():
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims)
    seqs = [ProbeSequence(tokens=list(range(40, 70)), blocks=[5, 2]),
            ProbeSequence(tokens=list(range(7, 19)), blocks=[0])]
    step = pack_step(seqs, [(0, 0, 30), (1, 0, 12)])
    assert step.inputs["logits_index"].tolist() == [29, 41]
    with torch.no_grad():
        logits, _ = model(*step.args(model.new_kv_cache(6, 16)))
    torch.testing.assert_close(logits, hf_logits(hf.model, seqs, step.rows), atol=1e-4, rtol=1e-4)


def test_functional_op_leaves_the_pool_untouched():
    hf, dims = _tiny()
    model = step_model_from_hf(hf.model, dims)
    seqs, steps, num_kv_blocks = standard_probe(dims.vocab_size, 16)
    cache = model.new_kv_cache(num_kv_blocks, 16)
    eager, _ = model(*steps[0].args(cache.clone()))
    model.functional_cache = True
    with torch.no_grad():
        functional, new_cache = model(*steps[0].args(cache))
    assert new_cache is not cache and cache.abs().sum() == 0 and new_cache.abs().sum() > 0
    torch.testing.assert_close(functional, eager)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_theta": 10000.0, "rope_type": "default", **(scaling or {})}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    if scaling is None:
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    got, scale = inv_frequencies(64, 10000.0, scaling)
    torch.testing.assert_close(got, expected)
    assert scale == 1.0


@pytest.mark.parametrize("theta, head_dim", [(10000.0, 96), (100000.0, 80), (1000000.0, 128), (500000.0, 64)])
def test_rotary_tables_are_correctly_rounded_as_the_c_runtime_takes_them(theta, head_dim):
    """The power and cos/sin rounded once to float32 from double precision (what the C runtime's libm gives):
    torch's float32 pow / cos / sin are one ulp off for some entries, which a w4a8 engine's int8 activations
    turned into different tokens between the C and the Python runtime. Against math's double-precision results."""
    import math
    import struct

    from trtpaged.manifest import ModelDims
    from trtpaged.models.llama import Rotary

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    inv, _ = inv_frequencies(head_dim, theta, None)
    expected_inv = [f32(1.0 / f32(math.pow(theta, f32(2 * i / head_dim)))) for i in range(head_dim // 2)]
    assert inv.tolist() == expected_inv
    dims = ModelDims("LlamaForCausalLM", num_layers=1, hidden_size=head_dim * 2, intermediate_size=64, num_heads=2,
                     num_kv_heads=2, head_dim=head_dim, vocab_size=16, rms_norm_eps=1e-5, rope_theta=theta)
    positions = torch.tensor([0, 1, 7, 300, 4095, 8191])
    cos, sin = Rotary(dims)(positions, torch.float32)
    for row, p in enumerate(positions.tolist()):
        angles = [f32(f32(float(p)) * f) for f in expected_inv] * 2
        assert cos[row].tolist() == [f32(math.cos(a)) for a in angles]
        assert sin[row].tolist() == [f32(math.sin(a)) for a in angles]


def test_load_step_model_from_engine_dir(tiny_engine_dir):
    model, manifest = load_step_model(tiny_engine_dir)
    assert manifest.dims.num_layers == 2 and model.dtype == torch.float32
    hf = load_hf(spec_from_manifest(manifest))
    assert _run_probe(model, hf, manifest.dims, manifest.limits.block_size) < 1e-4
