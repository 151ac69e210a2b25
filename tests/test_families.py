"""The model families beyond Llama, each a tiny random config made by transformers' own config class
(model.tiny): the step model against transformers' forward on packed mixed batches, the built engine
(ONNX export verified by the builder against transformers), and greedy generation equal to
transformers' `generate`: beyond the sliding window for windowed configs, with chunked prefill and
prefix-cache hits."""

from __future__ import annotations

import dataclasses
import json

import onnx
import pytest
import torch

from runtime_helpers import hf_greedy, run_staggered, runtime_config, step_engine
from trtpaged.attention_options import AttentionOptions
from trtpaged.builder.probe import hf_logits, standard_probe
from trtpaged.config import parse_config
from trtpaged.models import UnsupportedModelError, dims_from_hf_config, load_hf, step_model_from_hf
from trtpaged.models.dims import trained_max_seq_len
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams

EOS = 257
WINDOW = 12
BASE = {"num_hidden_layers": 4, "head_dim": 16, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96}
FAMILIES = {
    "qwen3": {"architecture": "Qwen3ForCausalLM"},
    "smollm3": {"architecture": "SmolLM3ForCausalLM", "no_rope_layer_interval": 2},
    "phi3": {"architecture": "Phi3ForCausalLM", "partial_rotary_factor": 0.5},
    "phi3-longrope": {"architecture": "Phi3ForCausalLM", "partial_rotary_factor": 0.75, "max_position_embeddings": 512,
                      "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.2, 3.1, 4.0],
                                       "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                                       "original_max_position_embeddings": 256},
                      "original_max_position_embeddings": 256},  # Phi3Config's own key wins over rope_scaling's
    "llama-yarn": {"architecture": "LlamaForCausalLM", "max_position_embeddings": 512,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    "mistral-window": {"architecture": "MistralForCausalLM", "sliding_window": WINDOW},
    "qwen2-window": {"architecture": "Qwen2ForCausalLM", "sliding_window": WINDOW, "use_sliding_window": True,
                     "max_window_layers": 1},
    "gemma2": {"architecture": "Gemma2ForCausalLM", "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3": {"architecture": "Gemma3ForCausalLM", "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
               "sliding_window_pattern": 2, "hidden_activation": "gelu_pytorch_tanh"},
    # Gemma 3 1B's heads: one KV head, whose k_norm rows are a strided view of the fused projection (was: the fused
    # CPU form's rmsnorm refused it, "expected a contiguous float32 CPU tensor", at every multi-token step)
    "gemma3-one-kv-head": {"architecture": "Gemma3ForCausalLM", "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                           "sliding_window_pattern": 2, "hidden_activation": "gelu_pytorch_tanh",
                           "num_key_value_heads": 1},
    # a soft-cap Gemma 3's config may carry and transformers' Gemma 3 never applies (was: applied, 0.07 off HF)
    "gemma3-attn-cap": {"architecture": "Gemma3ForCausalLM", "sliding_window_pattern": 2, "sliding_window": WINDOW,
                        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
}


def _config(family: str, **extra):
    return parse_config({"model": {"tiny": {**BASE, **FAMILIES[family]}}, "max_seq_len": 256, **extra})


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    config = _config(request.param)
    hf = load_hf(config.model)
    return request.param, hf, dims_from_hf_config(hf.config, config.limits.max_seq_len)


def test_dims_carry_what_makes_the_family(family):
    name, _, dims = family
    expected = {"qwen3": dims.qk_norm, "smollm3": dims.nope_layers == (1, 3),
                "phi3": dims.partial_rotary_factor == 0.5,
                "phi3-longrope": (dims.rope_scaling or {}).get("original_max_position_embeddings") == 256,
                "llama-yarn": (dims.rope_scaling or {}).get("rope_type") == "yarn",
                "mistral-window": dims.layer_windows == (WINDOW,) * 4,
                "qwen2-window": dims.layer_windows == (0, WINDOW, WINDOW, WINDOW),
                "gemma2": dims.attn_logit_softcap == 5.0 and dims.layer_windows == (WINDOW, 0, WINDOW, 0),
                "gemma3": dims.qk_norm and dims.local_rope_theta > 0 and dims.layer_windows == (WINDOW, 0, WINDOW, 0),
                "gemma3-one-kv-head": dims.qk_norm and dims.num_kv_heads == 1,
                "gemma3-attn-cap": dims.attn_logit_softcap == 0.0 and dims.final_logit_softcap == 3.0}
    assert expected[name], dims


def _max_error_against_hf(model, hf_model, vocab_size: int, block_size: int, seed: int = 3) -> float:
    """The step model against transformers' forward on packed mixed prefill/decode batches: max |logit error|."""
    seqs, steps, num_kv_blocks = standard_probe(vocab_size, block_size, seed=seed, all_rows=True)
    assert max(len(s.tokens) for s in seqs) > 2 * WINDOW  # the probe reaches beyond the window
    cache = model.new_kv_cache(num_kv_blocks, block_size)
    worst = 0.0
    for step in steps:
        with torch.no_grad():
            logits, _ = model(*step.args(cache))
        worst = max(worst, (logits - hf_logits(hf_model, seqs, step.rows)).abs().max().item())
    return worst


@pytest.mark.parametrize("block_size", [8, 16])
def test_step_model_matches_hf_forward(family, block_size):
    _, hf, dims = family
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, block_size) < 1e-4


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_fused_checkpoint_quantizes_and_matches_hf_on_its_dequantized_weights(weights):
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj fused, where quantizing looked q/k/v up by name (a
    KeyError traceback at build): the step model on the quantized weights equals transformers on the
    de-quantized ones."""
    from trtpaged.builder.quantize import dequantized_hf_model, quantized_step_model

    config = _config("phi3", quantization={"weights": weights})
    hf = load_hf(config.model)
    dims = dims_from_hf_config(hf.config, config.limits.max_seq_len)
    model, quantized = quantized_step_model(hf.model, config.model, dims, config.quantization, torch.float32)
    reference = dequantized_hf_model(hf.model, dims, quantized)
    assert reference is not hf.model and quantized.plan
    assert _max_error_against_hf(model, reference, dims.vocab_size, 16, seed=5) < 1e-3


def test_a_mistral_config_json_with_layer_types_slides_the_layers_they_mark_as_transformers_ministral(tmp_path):
    """transformers' AutoConfig reads a mistral config.json that has layer_types as Ministral's, whose model windows
    only the layers marked sliding_attention (a MistralConfig made directly windows every layer: the test above).
    Built from such an HF dir, the step model matches the model transformers loads from it."""
    from trtpaged.config import ModelSpec
    from trtpaged.models.hf import _load_tiny

    types = ["full_attention", "sliding_attention"] * 2
    tiny = parse_config({"model": {"tiny": {**BASE, "architecture": "MistralForCausalLM"}}}).model.tiny
    made = _load_tiny({**tiny, "sliding_window": WINDOW, "layer_types": types}, torch.float32)
    made.model.save_pretrained(tmp_path)
    made.tokenizer.save_pretrained(tmp_path)
    hf = load_hf(ModelSpec(kind="hf_dir", path=tmp_path))
    assert hf.config.model_type == "ministral" and hf.config.architectures == ["MistralForCausalLM"]
    dims = dims_from_hf_config(hf.config, 256)
    assert dims.layer_windows == (0, WINDOW, 0, WINDOW)
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


def test_swish_is_silu_as_transformers_reads_it():
    """hidden_act "swish" (transformers' ACT2FN: SiLU) was refused; the step model matches transformers with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="swish", max_position_embeddings=256)
    hf = LlamaForCausalLM(config).eval()
    dims = dims_from_hf_config(config, 256)
    assert dims.hidden_act == "silu"
    assert _max_error_against_hf(step_model_from_hf(hf, dims), hf, dims.vocab_size, 16) < 1e-4


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM"])
def test_mlp_bias_is_read_where_transformers_reads_it(arch):
    """transformers' Llama and SmolLM3 MLPs read mlp_bias; the other families' have no bias whatever the config
    says (was: a Qwen2 or Gemma 2 config with mlp_bias true gave the step model bias parameters the checkpoint
    lacks, a load_state_dict traceback at build). The step model matches transformers' forward either way."""
    from trtpaged.models.hf import _load_tiny

    hf = _load_tiny({**parse_config({"model": {"tiny": {**BASE, "architecture": arch}}}).model.tiny,
                     "mlp_bias": True}, torch.float32)
    with torch.no_grad():  # biases start at 0: random ones, so that a bias read or dropped shows in the logits
        for name, param in hf.model.named_parameters():
            if name.endswith("mlp.down_proj.bias") or name.endswith("mlp.up_proj.bias"):
                param.normal_(0, 0.5)
    dims = dims_from_hf_config(hf.config, 256)
    assert dims.mlp_bias == (arch == "LlamaForCausalLM")
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


ATTENTION_BIAS = {"LlamaForCausalLM": "qkvo", "Qwen2ForCausalLM": "qkv", "Qwen3ForCausalLM": "qkvo",
                  "SmolLM3ForCausalLM": "qkvo", "MistralForCausalLM": "", "Phi3ForCausalLM": "",
                  "Gemma2ForCausalLM": "qkvo", "Gemma3ForCausalLM": "qkvo"}


@pytest.mark.parametrize("arch", list(ATTENTION_BIAS))
def test_attention_bias_is_read_where_transformers_reads_it(arch):
    """attention_bias true: transformers' Llama, Qwen3, SmolLM3 and Gemma 2/3 bias q/k/v and o, Qwen2 q/k/v
    whatever the config says, Mistral and Phi-3 nothing (was: refused for Gemma 2/3, Mistral and Phi-3, "not
    implemented"). The step model, with random biases, matches transformers' forward."""
    from trtpaged.models.hf import _load_tiny

    tiny = parse_config({"model": {"tiny": {**BASE, **{"architecture": arch}}}}).model.tiny
    extra = {"query_pre_attn_scalar": 16} if arch.startswith("Gemma") else {}
    hf = _load_tiny({**tiny, **extra, "attention_bias": True}, torch.float32)
    biased = set()
    with torch.no_grad():  # transformers starts biases at 0: random ones, so a bias read or dropped shows
        for name, param in hf.model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
                biased.add(name.split(".")[-2][0])
    assert "".join(sorted(biased)) == "".join(sorted(ATTENTION_BIAS[arch]))
    dims = dims_from_hf_config(hf.config, 256)
    assert (dims.attention_bias, dims.o_proj_bias) == ("q" in biased, "o" in biased)
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Gemma2ForCausalLM"])
def test_partial_rotary_factor_is_phi3s_alone(arch):
    """Only transformers' Phi-3 rotates part of each head; the other families' default RoPE rotates whole heads
    whatever partial_rotary_factor a config carries (was: rotated a part, logits 0.1 off transformers')."""
    from trtpaged.models.hf import _load_tiny

    hf = _load_tiny({**parse_config({"model": {"tiny": {**BASE, "architecture": arch}}}).model.tiny,
                     "partial_rotary_factor": 0.5}, torch.float32)
    dims = dims_from_hf_config(hf.config, 256)
    assert dims.partial_rotary_factor == 1.0
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


@pytest.mark.parametrize("arch, windows", [("LlamaForCausalLM", ()), ("Phi3ForCausalLM", (WINDOW,) * 4),
                                           ("MistralForCausalLM", (WINDOW,) * 4)])
def test_layer_types_are_ignored_where_transformers_ignores_them(arch, windows):
    """transformers' Llama has no window and its Phi-3 and Mistral window every layer, whatever layer_types a config
    carries (was: the layers it marked sliding_attention slid, and only those: logits 0.4 to 1 off transformers'
    forward)."""
    from trtpaged.models.hf import _load_tiny

    types = ["full_attention", "sliding_attention"] * 2
    hf = _load_tiny({**parse_config({"model": {"tiny": {**BASE, "architecture": arch}}}).model.tiny,
                     "sliding_window": WINDOW, "layer_types": types}, torch.float32)
    dims = dims_from_hf_config(hf.config, 256)
    assert dims.layer_windows == windows
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


def test_greedy_equals_hf_generate_beyond_the_window_chunked_and_with_prefix_hits(family):
    _, hf, dims = family
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 256, (37,), generator=g).tolist()
    prompts = [system + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20, 1)]
    prompts.append(torch.randint(0, 256, (5,), generator=g).tolist())
    max_tokens = 3 * WINDOW  # every output runs well past the window
    reference = [hf_greedy(hf, p, max_tokens, None) for p in prompts]
    config = runtime_config(num_kv_blocks=64, block_size=8, max_num_tokens=16)  # chunked prefill: 16 tokens a step
    engine = LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = run_staggered(engine, [(p, params) for p in prompts], 3)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = engine.stats()
    assert stats["prefix_cache_hits_tokens"] >= 2 * 32  # the system prompt's 4 full blocks, for 2 later prompts
    assert engine.kv.pool.num_free == config.num_kv_blocks


@pytest.mark.parametrize("name", ["gemma3", "qwen2-window", "smollm3"])
def test_built_engine_is_verified_and_carries_the_window(tmp_path, name):
    """The builder exports the ONNX graph and verifies it against transformers (numpy reference of the node);
    each node's sliding_window / logit_softcap attributes are the layer's."""
    from trtpaged.builder import build_engine

    config = _config(name, dtype="float32", block_size=8, kv_cache={"num_kv_blocks": 64}, backend="torch")
    build_engine(config, tmp_path / name, echo=lambda line: None)
    graph = onnx.load(str(next((tmp_path / name).glob("*.onnx"))), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == "TrtpagedPagedAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    dims = dims_from_hf_config(load_hf(config.model).config)
    assert [a["sliding_window"] for a in attrs] == [dims.window_of(i) for i in range(dims.num_layers)]
    assert all(a["logit_softcap"] == dims.attn_logit_softcap for a in attrs)
    # the manifest carries only the family fields away from Llama's defaults (a Llama engine's has none)
    from trtpaged.manifest import FAMILY_FIELDS

    written = json.loads((tmp_path / name / "trtpaged.json").read_text())["dims"]
    expected = {"gemma3": {"layer_windows", "qk_norm", "hidden_act", "gemma_norms", "embed_scale", "attention_scale",
                           "local_rope_theta"},
                "qwen2-window": {"layer_windows"}, "smollm3": {"nope_layers"}}[name]
    assert set(written) & set(FAMILY_FIELDS) == expected


def test_numpy_node_reference_agrees_with_the_kernel_on_window_and_softcap():
    from kernel_cases import make_batch
    from trtpaged import kernels
    from trtpaged.builder.onnx_reference import paged_attention_numpy

    batch = make_batch([(0, 30), (40, 1), (9, 12)], seed=8)
    batch.q.mul_(5.0)

    out = kernels.paged_attention(*batch.args()[:3], batch.kv_cache.clone(), *batch.args()[4:],
                                  AttentionOptions(2, batch.scale, sliding_window=7, logit_softcap=2.0))
    ref, _ = paged_attention_numpy(*(t.numpy() for t in batch.args()), layer=2, block_size=16, scale=batch.scale,
                                   sliding_window=7, logit_softcap=2.0)
    assert (out - torch.from_numpy(ref)).abs().max().item() < 1e-4


@pytest.mark.parametrize("overrides,key", [
    ({"architecture": "Qwen3ForCausalLM", "hidden_act": "relu"}, "hidden_act"),
    ({"architecture": "Phi3ForCausalLM", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
      "long_factor": [2.0] * 8}, "original_max_position_embeddings": 64}, "max_seq_len"),
])
def test_unsupported_variants_are_refused_naming_the_key(overrides, key):
    from trtpaged.models.hf import _load_tiny

    tiny = {**parse_config({"model": {"tiny": {**BASE, "architecture": overrides["architecture"]}}}).model.tiny,
            **overrides}
    hf = _load_tiny(tiny, torch.float32)
    with pytest.raises(UnsupportedModelError, match=key):
        dims_from_hf_config(hf.config, 256)


@pytest.mark.parametrize("rope_parameters", [
    # flat keys beside the per-layer-type dicts transformers fills in: it reads the dicts alone (theta 1e6, no scaling)
    {"rope_type": "linear", "factor": 8.0, "rope_theta": 100.0},
    # the layer type's yarn truncate: transformers reads truncate from the top level (absent: true) alone
    {"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": False,
                        "beta_fast": 8.0, "rope_theta": 100.0},
     "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
])
def test_gemma3_rope_is_read_per_layer_type_as_transformers_reads_it(rope_parameters):
    """Gemma 3's rope_parameters (transformers 5's name) per layer type, as transformers reads them (was: flat keys
    beside them taken for the global layers, logits 1.0 off; a layer type's yarn truncate taken, 0.7 off)."""
    from trtpaged.models.hf import _load_tiny

    tiny = parse_config({"model": {"tiny": {**BASE, **FAMILIES["gemma3"]}}}).model.tiny
    hf = _load_tiny({**tiny, "rope_parameters": rope_parameters}, torch.float32)
    dims = dims_from_hf_config(hf.config, 256)
    assert _max_error_against_hf(step_model_from_hf(hf.model, dims), hf.model, dims.vocab_size, 16) < 1e-4


def test_a_phi3_config_json_with_its_partial_rotary_factor_in_rope_parameters_loads_and_matches_hf(tmp_path):
    """transformers 5's form of a Phi-3 config.json keeps partial_rotary_factor in rope_parameters, beside longrope's
    factors (one per rotated pair); transformers loads it without the top-level key (was: refused, "short_factor
    holds 6 factors; expected 8", the factors counted against whole heads). The loaded model's step model matches
    transformers' forward."""
    from trtpaged.config import ModelSpec

    hf = load_hf(_config("phi3-longrope").model)
    hf.model.save_pretrained(tmp_path)
    hf.tokenizer.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["partial_rotary_factor"] == raw.pop("partial_rotary_factor") == 0.75
    (tmp_path / "config.json").write_text(json.dumps(raw))
    loaded = load_hf(ModelSpec(kind="hf_dir", path=tmp_path))
    dims = dims_from_hf_config(loaded.config, 256)
    assert dims.partial_rotary_factor == 0.75
    assert _max_error_against_hf(step_model_from_hf(loaded.model, dims), loaded.model, dims.vocab_size, 16) < 1e-4


def test_a_bidirectional_gemma3_is_refused_naming_the_key():
    """use_bidirectional_attention makes transformers' Gemma 3 attend to later tokens too (EmbeddingGemma), which no
    causal step model computes (was: built causal, logits 0.86 off transformers' forward): refused naming the key."""
    from trtpaged.models.hf import _load_tiny

    tiny = parse_config({"model": {"tiny": {**BASE, **FAMILIES["gemma3"]}}}).model.tiny
    hf = _load_tiny({**tiny, "use_bidirectional_attention": True}, torch.float32)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 256
    with torch.no_grad():  # the first position's logits depend on the last token: not causal
        assert (hf.model(ids).logits[0, 0] - hf.model(changed).logits[0, 0]).abs().max() > 1e-3
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention: got True"):
        dims_from_hf_config(hf.config, 256)


@pytest.mark.parametrize("name", ["qwen2-window", "gemma2", "gemma3"])
def test_a_window_without_layer_kinds_is_refused_not_dropped(name):
    """A config with a sliding window but no layer_types (what transformers before 4.53 gives these families)
    is refused naming the key: building every layer global would answer wrongly past the window."""
    hf_config = load_hf(_config(name).model).config
    hf_config.layer_types = None
    with pytest.raises(UnsupportedModelError, match="layer_types: .* sliding_window 12 .* transformers >= 5"):
        dims_from_hf_config(hf_config, 256)


@pytest.mark.parametrize("scaling,length", [
    (None, 64),
    ({"rope_type": "linear", "factor": 4.0}, 256),
    ({"rope_type": "yarn", "factor": 2.0}, 128),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8}, 64),  # already the long length
])
def test_the_trained_length_stretches_with_linear_and_yarn_scaling(scaling, length):
    """vLLM's derived max_model_len: the length build checks max_seq_len against."""
    dims = dims_from_hf_config(load_hf(_config("qwen3").model).config, 256)
    assert trained_max_seq_len(dataclasses.replace(dims, max_position_embeddings=64, rope_scaling=scaling))[0] == length


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize("scaling", [_LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_a_scaled_llama_gguf_rotates_as_the_model_it_was_made_from(tmp_path, scaling):
    """A Llama 3.1-style GGUF carries its rope scaling only as llama.cpp's rope_freqs tensor, and a linear-scaled
    one as llama.rope.scaling.type/factor metadata; transformers' GGUF loader drops both (was: positions rotated by
    other angles, logits 1.6e-2 (llama3) and 1.9e-2 (linear) off the model the file was made from). Read into the
    config, the loaded model's logits equal the original scaled model's over 200 positions (past the 64 of its
    original context), and a built engine's greedy tokens equal the original's generate. Phi-3's length-dependent
    factors and a yarn scaling, which nothing here reads, are refused naming them."""
    import types

    import numpy as np
    import yaml
    from click.testing import CliRunner

    from gguf_writer import write_llama_gguf
    from trtpaged import LLM
    from trtpaged.cli import main
    from trtpaged.config import ConfigError, ModelSpec

    path, original = write_llama_gguf(tmp_path / "scaled.gguf", scaling)
    hf = load_hf(ModelSpec(kind="gguf", path=path))
    ids = torch.randint(3, 1000, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf.model(ids).logits - original(ids).logits).abs().max() < 1e-4
    data = {"model": {"gguf": str(path)}, "dtype": "float32", "max_seq_len": 256, "kv_cache": {"num_kv_blocks": 64},
            "backend": "torch"}  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "engine")])
    assert r.exit_code == 0, r.output
    prompt = ids[0, :120].tolist()
    (out,) = LLM(tmp_path / "engine", device="cpu").generate([{"prompt_token_ids": prompt}],
                                                            SamplingParams(max_tokens=24, temperature=0.0))
    assert list(out.outputs[0].token_ids) == hf_greedy(types.SimpleNamespace(model=original), prompt, 24, 2)
    long_factors = {"rope_factors_long.weight": np.ones(16, np.float32)}
    path, _ = write_llama_gguf(tmp_path / "longrope.gguf", extra=long_factors)
    with pytest.raises(ConfigError, match="holds rope_factors_long.weight"):
        load_hf(ModelSpec(kind="gguf", path=path))
    path, _ = write_llama_gguf(tmp_path / "yarn.gguf", {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="llama.rope.scaling.type is 'yarn'"):
        load_hf(ModelSpec(kind="gguf", path=path))

def test_a_gemma2_gguf_with_a_bpe_vocabulary_keeps_its_tokenizer_and_chat_prompt(tmp_path):
    """A gemma2 GGUF whose vocabulary is BPE (not Gemma's SentencePiece kind): its engine's tokenizer encodes and
    renders chat prompts as transformers' tokenizer from the same GGUF does, and greedy text is HF's (was: saved as
    GemmaTokenizer, which rebuilds Gemma's own pipeline when reloaded, the engine's tokenizer failed on every text
    with "Unk token `None` not found in the vocabulary" though the build had passed)."""
    import yaml
    from click.testing import CliRunner

    from gguf_writer import write_gemma2_gguf
    from trtpaged import LLM
    from trtpaged.cli import main
    from trtpaged.config import ModelSpec

    path = write_gemma2_gguf(tmp_path / "gemma2.gguf")
    hf = load_hf(ModelSpec(kind="gguf", path=path))
    data = {"model": {"gguf": str(path)}, "dtype": "float32", "max_seq_len": 128, "kv_cache": {"num_kv_blocks": 32},
            "backend": "torch"}  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    r = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "engine")])
    assert r.exit_code == 0, r.output
    llm = LLM(tmp_path / "engine", device="cpu")
    for text in ("Hello there, how are you?", "  two spaces,\ttabs\n\nÜnïcödé 日本語 🤖", "x=f(y); 12345"):
        assert llm.tokenizer.encode(text) == hf.tokenizer.encode(text), text
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    prompt = llm.chat_prompt(messages)
    assert prompt == list(hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"])  # fmt: skip
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0.0))
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12, 2)


def test_moe_is_refused_naming_the_key():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            num_experts=4, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="num_experts"):
        dims_from_hf_config(config)
