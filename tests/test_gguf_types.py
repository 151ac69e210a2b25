"""GGUF files in the weight types llama.cpp's quantizer writes, and in types no loader here reads."""

from __future__ import annotations


import numpy as np
import pytest
import yaml

gguf = pytest.importorskip("gguf")

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
