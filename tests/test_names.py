"""One name per setting: the deprecated spellings (trtpaged/names.py) read exactly as the new ones, with a
FutureWarning, from the command line, a model.yaml and the manifest of an engine dir built before the rename;
both spellings of one setting are refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpaged.cli import main
from trtpaged.config import ConfigError, parse_config
from trtpaged.manifest import MANIFEST_NAME, EngineDirError, Manifest, read_manifest
from trtpaged.names import RENAMED_KEYS, RENAMED_OPTIONS, renamed_options

TINY = {"model": {"tiny": {}}, "max_seq_len": 64}


def _bench_memory(tmp_path: Path, *options: str) -> dict:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": 20 + i, "output_len": 10, "n": 2}) for i in range(5)))
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(trace), *options, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{"):])


def test_deprecated_cli_options_give_the_same_report(tmp_path) -> None:
    new = _bench_memory(tmp_path, "--num-kv-blocks", "32", "--kv-cache-dtype", "int8")
    with pytest.warns(FutureWarning) as warned:
        old = _bench_memory(tmp_path, "--num-blocks", "32", "--kv-dtype=int8")
    assert sorted(str(w.message).split(" is ")[0] for w in warned) == ["--kv-dtype", "--num-blocks"]
    assert old == new and new["budget"]["num_kv_blocks"] == 32
    assert new["kv_cache_dtypes"]["rows"][-1]["kv_cache_dtype"] == "int8"
    with pytest.warns(FutureWarning, match="--kv-blocks is deprecated"):
        assert _bench_memory(tmp_path, "--kv-blocks", "32", "--kv-cache-dtype", "int8") == new


def test_renamed_options_leave_values_and_arguments_after_double_dash() -> None:
    with pytest.warns(FutureWarning):
        assert renamed_options(["--kv-blocks", "--kv-blocks", "--", "--kv-blocks"]) == [
            "--num-kv-blocks", "--num-kv-blocks", "--", "--kv-blocks"]
    assert renamed_options(["--num-kv-blocks=3", "--kv-blocksx"]) == ["--num-kv-blocks=3", "--kv-blocksx"]
    assert set(RENAMED_OPTIONS.values()) == {"--kv-cache-dtype", "--num-kv-blocks"}


def test_model_yaml_num_blocks_reads_as_num_kv_blocks() -> None:
    new = parse_config({**TINY, "kv_cache": {"num_kv_blocks": 40}})
    with pytest.warns(FutureWarning, match=r"kv_cache\.num_blocks is deprecated.*kv_cache\.num_kv_blocks"):
        old = parse_config({**TINY, "kv_cache": {"num_blocks": 40}})
    assert old == new and new.kv_cache.num_kv_blocks == 40
    with pytest.warns(FutureWarning):  # the same bounds apply to the old spelling
        with pytest.raises(ConfigError, match=r"kv_cache\.num_kv_blocks: got 1; one sequence"):
            parse_config({**TINY, "kv_cache": {"num_blocks": 1}})
    with pytest.raises(ConfigError, match=r"kv_cache\.num_kv_blocks: set twice"):
        parse_config({**TINY, "kv_cache": {"num_blocks": 40, "num_kv_blocks": 40}})


def _old_manifest(engine: Path) -> dict:
    """The engine's manifest as a build before the rename wrote it."""
    data = json.loads((engine / MANIFEST_NAME).read_text())
    del data["content_sha256"]  # written since; a manifest without it is read without that check
    new_to_old = {new: old for old, new in RENAMED_KEYS.items()}
    data["kv_cache"] = {new_to_old.get(k, k): v for k, v in data["kv_cache"].items()}
    data.setdefault("verification", {})["kv_cache"] = {"kv_dtype": "int8", "max_abs_diff": 0.5}
    return data


def test_manifest_of_an_older_build_reads_the_same(tiny_engine_dir, tmp_path) -> None:
    engine = tmp_path / "old"
    shutil.copytree(tiny_engine_dir, engine)
    old = _old_manifest(engine)
    assert "num_blocks" in old["kv_cache"]
    (engine / MANIFEST_NAME).write_text(json.dumps(old))
    with pytest.warns(FutureWarning) as warned:
        got = read_manifest(engine)
    assert sorted(str(w.message).split(" is ")[0] for w in warned) == ["kv_cache.num_blocks",
                                                                        "verification.kv_cache.kv_dtype"]
    want = read_manifest(tiny_engine_dir)
    assert got.kv_cache == want.kv_cache and got.kv_cache.num_kv_blocks is not None
    assert got.verification["kv_cache"] == {"kv_cache_dtype": "int8", "max_abs_diff": 0.5}
    both = {**old, "kv_cache": {**old["kv_cache"], "num_kv_blocks": 128}}
    with pytest.raises(EngineDirError, match=r"kv_cache\.num_kv_blocks: set twice"):
        Manifest.from_json(json.dumps(both))
