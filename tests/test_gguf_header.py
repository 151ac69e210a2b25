"""The GGUF header reader against the gguf package's own writer and reader (the independent truth)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from trtpaged.models.gguf_header import GGUFHeaderError, read_string_field  # noqa: E402


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


def test_reads_what_the_gguf_reader_reads(tmp_path: Path):
    path = _write(tmp_path / "m.gguf")
    fields = gguf.GGUFReader(str(path)).fields
    for key in ("general.architecture", "general.name", "t.str"):
        assert read_string_field(path, key) == fields[key].contents()
    assert read_string_field(path, "t.u32") is None  # not a string
    assert read_string_field(path, "absent") is None
    assert read_string_field(path, "general.name", max_entries=3) is None  # beyond the entries it looks at


def test_damaged_files_are_header_errors_never_anything_else(tmp_path: Path):
    good = _write(tmp_path / "m.gguf").read_bytes()
    want = "tiny test model"
    bad = tmp_path / "bad.gguf"
    rng = random.Random(0)
    cases = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(300):
        data = bytearray(good)
        data[rng.randrange(0, 600)] = rng.randrange(256)  # the header region
        cases.append(bytes(data))
    for data in cases:
        bad.write_bytes(data)
        try:
            got = read_string_field(bad, "general.name")
        except GGUFHeaderError:
            continue
        assert got is None or isinstance(got, str)
        if data == good:
            assert got == want
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
                    + (1 << 62).to_bytes(8, "little"))
    with pytest.raises(GGUFHeaderError, match="key of"):
        read_string_field(bad, "general.name")
    with pytest.raises(GGUFHeaderError):
        read_string_field(tmp_path, "general.name")  # a directory


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
