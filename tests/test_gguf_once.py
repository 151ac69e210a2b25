"""load_hf parses a GGUF once, and gives exactly what transformers' own three-parse load gives.

The truth is transformers itself (AutoConfig, AutoTokenizer, AutoModelForCausalLM on the same file,
unpatched); the file is a tiny Llama GGUF written here with the gguf package's writer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from trtpaged.config import parse_config  # noqa: E402
from trtpaged.models import gguf_once, load_hf  # noqa: E402

TOKENS = ["<s>", "</s>", "<unk>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab", "abc", "Ġa"]


def _write_tiny_llama(path: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                      ffn: int = 128) -> Path:
    """A Llama GGUF with random float32 weights and a small byte-level BPE vocabulary."""
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.05, shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny test llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 2] + [1] * (len(TOKENS) - 3))
    w.add_token_merges(["a b", "ab c", "Ġ a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_unk_token_id(2)
    w.add_tensor("token_embd.weight", weight(len(TOKENS), hidden))
    w.add_tensor("output_norm.weight", 1 + weight(hidden))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape) + (1 if len(shape) == 1 else 0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class _CountingReader(gguf.GGUFReader):
    built = 0

    def __init__(self, *args, **kwargs):
        type(self).built += 1
        super().__init__(*args, **kwargs)


def test_load_hf_parses_the_gguf_once_and_equals_transformers_own_load(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = _write_tiny_llama(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf, "GGUFReader", _CountingReader)
    where = {"gguf_file": path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(tmp_path, **where)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, **where)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float32, **where)
    plain_reads = _CountingReader.built
    assert plain_reads >= 3  # config, tokenizer and weights each read the file: what parsed_once removes

    _CountingReader.built = 0
    hf = load_hf(parse_config({"model": {"gguf": str(path)}}).model)
    assert _CountingReader.built == 1
    assert gguf.GGUFReader is _CountingReader  # the names are back once the load is over

    assert hf.config.to_dict() == config.to_dict()
    got, want = hf.model.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert hf.tokenizer.get_vocab() == tokenizer.get_vocab()
    text = "abc a zab abcabc"
    assert hf.tokenizer.encode(text) == tokenizer.encode(text) and len(tokenizer.encode(text)) < len(text)


def test_the_patched_names_are_restored_after_a_raise():
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    before = (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint)
    with pytest.raises(RuntimeError, match="inside"):
        with gguf_once.parsed_once():
            assert gguf.GGUFReader is not before[0] and hf_gguf.load_gguf_checkpoint is not before[2]
            raise RuntimeError("inside")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == before


def test_each_caller_gets_its_own_copy_of_the_metadata(tmp_path):
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    path = _write_tiny_llama(tmp_path / "tiny.gguf", layers=1)
    with gguf_once.parsed_once():
        first = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)
        first["config"]["num_hidden_layers"] = 99  # a caller editing what it got
        second = hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)
    assert second["config"]["num_hidden_layers"] == 1
    assert second == hf_gguf.load_gguf_checkpoint(str(path), return_tensors=False)  # the unpatched result
