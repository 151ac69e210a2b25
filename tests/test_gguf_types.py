"""GGUF files in the weight types llama.cpp's quantizer writes (K-quants, IQ4, Q5, F16, BF16, mixed in one file as
its Q4_K_M and others mix them) against transformers' own load of the same file (the truth: gguf's `dequantize`)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

gguf = pytest.importorskip("gguf")

# every weight type of llama.cpp's usual downloads (and its 1- to 3-bit ones), one per tensor of a 3-layer Llama
_TYPES = {
    "blk.0.attn_q": "Q4_K", "blk.0.attn_k": "Q6_K", "blk.0.attn_v": "Q5_K", "blk.0.attn_output": "Q3_K",
    "blk.0.ffn_gate": "Q2_K", "blk.0.ffn_up": "IQ4_XS", "blk.0.ffn_down": "IQ4_NL", "blk.1.attn_q": "Q5_0",
    "blk.1.attn_k": "Q5_1", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q4_0", "blk.1.ffn_gate": "Q4_1",
    "blk.1.ffn_up": "F16", "blk.1.ffn_down": "BF16", "blk.2.attn_q": "IQ2_XXS", "blk.2.attn_k": "IQ2_XS",
    "blk.2.attn_v": "IQ2_S", "blk.2.attn_output": "IQ3_XXS", "blk.2.ffn_gate": "IQ3_S", "blk.2.ffn_up": "IQ1_S",
    "blk.2.ffn_down": "TQ2_0", "token_embd": "Q6_K", "output": "TQ1_0",
}


def _build(tmp_path: Path, path: Path, quantization: dict | None = None) -> Path:
    from click.testing import CliRunner

    from trtpaged.cli import main

    data = {"model": {"gguf": str(path)}, "dtype": "float32", "max_seq_len": 128, "kv_cache": {"num_kv_blocks": 32},
            "backend": "torch", **({"quantization": quantization} if quantization else {})}  # fmt: skip
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    engine = tmp_path / "engine"
    r = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(engine)])
    assert r.exit_code == 0, r.output
    return engine


def test_a_gguf_of_every_llama_cpp_weight_type_runs_as_transformers_loads_it(tmp_path):
    """K-quants (Q2_K to Q6_K), IQ4_NL/IQ4_XS, Q4/Q5/Q8, F16/BF16 and the 1- to 3-bit IQ/TQ weights side by side in
    one file, as llama.cpp's mixes are: the header reader takes each type's block size as gguf's reader does, and the
    built engine's log-probs over every vocabulary entry and its greedy tokens are those of transformers' model of
    the file."""
    from gguf_writer import write_typed_llama_gguf
    from runtime_helpers import hf_greedy
    from transformers import AutoModelForCausalLM

    from trtpaged import LLM
    from trtpaged.models.gguf_header import read_layout
    from trtpaged.runtime.sampling_params import SamplingParams

    path = write_typed_llama_gguf(tmp_path / "mixed.gguf", _TYPES, layers=3)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type.name for t in reader.tensors} == set(_TYPES.values()) | {"F32"}
    assert [(t.name, t.ggml_type, t.nbytes) for t in read_layout(path).tensors] == [
        (t.name, int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(_build(tmp_path, path), device="cpu", max_logprobs=-1)
    prompt = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                         prompt_logprobs=-1))  # fmt: skip
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        got = torch.tensor([v.logprob for v in entry.values()], dtype=torch.float64)
        assert (got - want[i, list(entry)]).abs().max() < 1e-4, i
    assert list(out.outputs[0].token_ids) == hf_greedy(types.SimpleNamespace(model=hf), prompt, 16, 2)


@pytest.mark.parametrize("type_name", ["Q8_K", "I32", "F64"])
def test_a_tensor_of_a_type_transformers_cannot_load_is_named_at_the_check_stage(tmp_path, type_name):
    """A tensor of a type gguf does not de-quantize (transformers' loader reads every tensor through it) is refused
    before the load, naming the tensor and the type (was: a NotImplementedError from gguf naming the type alone,
    after transformers had parsed the whole file)."""
    from click.testing import CliRunner

    from gguf_writer import write_typed_llama_gguf
    from trtpaged.cli import main

    path = write_typed_llama_gguf(tmp_path / "odd.gguf", {"blk.1.ffn_down": type_name, "blk": "Q4_K"})
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"model": {"gguf": str(path)}, "backend": "torch"}))
    r = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "engine")])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "check    failed" in r.output, r.output
    assert (f"tensor 'blk.1.ffn_down.weight' is ggml type {type_name} ({int(gguf.GGMLQuantizationType[type_name])}), "
            "which transformers' GGUF loader cannot read") in r.output, r.output
    assert not (tmp_path / "engine").exists()
    with pytest.raises(NotImplementedError, match=type_name):  # what transformers' loader meets
        gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1], np.uint8),
                               gguf.GGMLQuantizationType[type_name])
