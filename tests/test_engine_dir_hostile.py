"""Engine dirs are untrusted input (issue 17, items 7-10 and 15's runtime part).

Each broken dir is a real copy of the tiny engine with one thing damaged on disk. Every kind must
make `inspect` and `generate` exit 1 with one line naming the file and the field (no traceback),
and `LLM(...)` raise EngineDirError. Kinds that the hashes alone would catch are also tried with
the manifest's hashes rewritten to match the damage, so that the structural check behind
them (confinement, safetensors header, dims, NaN) is what refuses the dir.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import save_manifest

from trtpaged.cli import main
from trtpaged.engine_files import sha256_file, verify_engine_dir
from trtpaged.manifest import MANIFEST_NAME, EngineDirError, Manifest, read_manifest


@pytest.fixture(autouse=True)
def _own_stamp_cache(tmp_path, monkeypatch):
    """Verified-stamps go to this test's own cache dir."""
    monkeypatch.setenv("TRTPAGED_CACHE_DIR", str(tmp_path / "cache"))


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def _copy(tiny_engine_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, out, symlinks=True)
    return out


def _edit_manifest(engine: Path, **changes) -> None:
    path = engine / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(changes)
    save_manifest(engine, data)


def _rehash(engine: Path) -> None:
    """Rewrites the manifest's hashes to match what is on disk (a hostile dir whose manifest agrees with it)."""
    data = json.loads((engine / MANIFEST_NAME).read_text())
    files = sorted(p for p in engine.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    data["files"] = {p.relative_to(engine).as_posix(): sha256_file(p) for p in files}
    save_manifest(engine, data)


def _weights_data_start(path: Path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def _outside_file(engine: Path) -> Path:
    outside = engine.parent / "outside"
    outside.mkdir(exist_ok=True)
    target = outside / "weights.safetensors"
    shutil.copy(engine / "weights.safetensors", target)  # valid weights, but not the engine dir's
    return target


def _random_bytes_into_weights(e: Path) -> None:
    start = _weights_data_start(e / "weights.safetensors")
    with open(e / "weights.safetensors", "r+b") as f:
        f.seek(start)
        f.write(os.urandom(1 << 20))  # 1 MiB, past the tensors' end too


def _random_bytes_in_place(e: Path) -> None:
    path = e / "weights.safetensors"
    start, size = _weights_data_start(path), path.stat().st_size
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(os.urandom(size - start))  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime


def _zero_hashes(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    _edit_manifest(e, files={name: "0" * 64 for name in data["files"]})


def _rope_theta_edited_by_hand(e: Path) -> None:
    """A plausible value, in bounds, written without the build's hash of the manifest's fields."""
    data = json.loads((e / MANIFEST_NAME).read_text())
    data["dims"]["rope_theta"] *= 2
    (e / MANIFEST_NAME).write_text(json.dumps(data, indent=2))


def _truncate(e: Path) -> None:
    path = e / "weights.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _huge_header(e: Path) -> None:
    path = e / "weights.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])


def _all_ff(e: Path) -> None:
    path = e / "weights.safetensors"
    path.write_bytes(b"\xff" * path.stat().st_size)


def _ff_tensor_data(e: Path) -> None:
    path = e / "weights.safetensors"
    data = bytearray(path.read_bytes())
    start = _weights_data_start(path)
    data[start:start + 4096] = b"\xff" * 4096  # float32 0xFFFFFFFF is NaN
    path.write_bytes(bytes(data))


def _pickle(e: Path) -> None:
    from safetensors.torch import load_file

    state = {name: t.clone().numpy() for name, t in load_file(str(e / "weights.safetensors")).items()}
    with open(e / "weights.safetensors", "wb") as f:
        pickle.dump(state, f)  # never unpickled: trtpaged reads only safetensors


def _no_tokenizer(e: Path) -> None:
    shutil.rmtree(e / "tokenizer")


def _wrong_dims(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    _edit_manifest(e, dims={**data["dims"], "intermediate_size": 256})


def _rope_factor_zero(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    _edit_manifest(e, dims={**data["dims"], "rope_scaling": {"rope_type": "linear", "factor": 0}})


def _rope_factor_below_float32(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    _edit_manifest(e, dims={**data["dims"], "rope_scaling": {"rope_type": "linear", "factor": 1e-300}})


def _unknown_field(e: Path) -> None:
    _edit_manifest(e, weights_sha="abc")


def _unlisted_weights(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    files = {k: v for k, v in data["files"].items() if k != "weights.safetensors"}
    _edit_manifest(e, files=files)


def _parent_path(e: Path) -> None:
    _edit_manifest(e, weights_file="../../../../etc/passwd")


def _absolute_path(e: Path) -> None:
    _edit_manifest(e, weights_file=str(_outside_file(e)))


def _symlink_out(e: Path) -> None:
    target = _outside_file(e)
    (e / "weights.safetensors").unlink()
    (e / "weights.safetensors").symlink_to(target)


def _tokenizer_dir_up(e: Path) -> None:
    _edit_manifest(e, tokenizer_dir="../../../../etc")


def _tokenizer_symlink_out(e: Path) -> None:
    shutil.move(str(e / "tokenizer"), str(e.parent / "tok-outside"))
    (e / "tokenizer").symlink_to(e.parent / "tok-outside")


def _tokenizer_extra_file(e: Path) -> None:
    (e / "tokenizer" / "notes.txt").write_text("not from the build")


def _garbage_tokenizer(e: Path) -> None:
    (e / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')


def _kv_blocks_beyond_int32(e: Path) -> None:
    data = json.loads((e / MANIFEST_NAME).read_text())
    _edit_manifest(e, kv_cache={**data["kv_cache"], "num_kv_blocks": 10**15})


def _tokenizer_dir_dot(e: Path) -> None:
    _edit_manifest(e, tokenizer_dir=".")


def _verification_without_tolerance(e: Path) -> None:
    _edit_manifest(e, verification={"max_abs_diff": 0})


def _quantization_without_weights(e: Path) -> None:
    _edit_manifest(e, quantization={"group_size": 32})


def _quantization_origin_a_number(e: Path) -> None:
    _edit_manifest(e, quantization={"weights": "int8", "origin": 5})


def _dims(**changes):
    def edit(e: Path) -> None:
        data = json.loads((e / MANIFEST_NAME).read_text())
        _edit_manifest(e, dims={**data["dims"], **changes})
    return edit


def _tokenizer_ids_past_the_vocabulary(e: Path) -> None:
    path = e / "tokenizer" / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    for piece in list(vocab)[:60]:  # text with these pieces encodes to ids the model has no embedding for
        vocab[piece] += 5000
    path.write_text(json.dumps(data))


def _manifest_a_fifo(e: Path) -> None:
    (e / MANIFEST_NAME).unlink()
    os.mkfifo(e / MANIFEST_NAME)


# kind -> (damage, rehash too?, the field the error names, words in it)
BROKEN = {
    "weights_file ../": (_parent_path, False, "weights_file", "not a path inside the engine dir"),
    "weights_file absolute": (_absolute_path, False, "weights_file", "not a path inside the engine dir"),
    "weights symlink out": (_symlink_out, False, "weights_file", "outside the engine dir"),
    "tokenizer_dir ../": (_tokenizer_dir_up, False, "tokenizer_dir", "not a path inside the engine dir"),
    "tokenizer symlink out": (_tokenizer_symlink_out, False, "tokenizer_dir", "outside the engine dir"),
    "1 MiB random into weights": (_random_bytes_into_weights, False, "weights_file",
                                  "the file has 1048576 after the header"),
    "random weights, same size and mtime": (_random_bytes_in_place, False, "files['weights.safetensors']", "sha256"),
    "zeroed hashes": (_zero_hashes, False, "files[", "sha256"),
    # was: loaded, and every answer changed
    "rope_theta edited by hand": (_rope_theta_edited_by_hand, False, "content_sha256", "edited after the build"),
    "truncated weights": (_truncate, False, "weights_file", "truncated"),
    "truncated weights, rehashed": (_truncate, True, "weights_file", "truncated"),
    "header length 2^62": (_huge_header, True, "weights_file", "header length 4611686018427387904"),
    "0xFF weights": (_all_ff, True, "weights_file", "not a valid safetensors file"),
    "0xFF tensor data": (_ff_tensor_data, True, "", "NaN/inf"),
    "pickle weights": (_pickle, True, "weights_file", "not a valid safetensors file"),
    "missing tokenizer dir": (_no_tokenizer, False, "tokenizer_dir", "missing"),
    "wrong dims": (_wrong_dims, False, "layers.0.mlp.gate_up_proj.weight", "the manifest's dims need"),
    "unknown manifest field": (_unknown_field, False, "weights_sha", "unknown field"),
    # was: loaded, and every request failed on NaN logits
    "rope_scaling factor 0": (_rope_factor_zero, False, "dims.rope_scaling.factor", "finite positive"),
    # finite and positive as a double, 0 as a float32
    "rope_scaling factor 1e-300": (_rope_factor_below_float32, False, "dims", "gives non-finite rotary frequencies"),
    "weights not hashed": (_unlisted_weights, False, "weights_file", "not listed in the manifest's files"),
    "extra tokenizer file": (_tokenizer_extra_file, False, "tokenizer_dir", "does not list"),
    "num_kv_blocks 10^15": (_kv_blocks_beyond_int32, False, "kv_cache.num_kv_blocks", "int32 block ids"),
    "garbage tokenizer.json, rehashed": (_garbage_tokenizer, True, "tokenizer_dir", "transformers cannot load it"),
    "tokenizer_dir .": (_tokenizer_dir_dot, False, "tokenizer_dir", "not a path inside the engine dir"),
    # were: a KeyError / AttributeError traceback from inspect, while LLM loaded the engine
    "verification without tolerance": (_verification_without_tolerance, False, "verification.tolerance",
                                       "expected a finite number"),
    "quantization without weights": (_quantization_without_weights, False, "quantization.weights", "one of int8, int4"),
    "quantization.origin a number": (_quantization_origin_a_number, False, "quantization.origin", "expected"),
    # were: tracebacks from the step model (rope shapes, a window per layer), or another model run than written
    "partial_rotary_factor 5": (_dims(partial_rotary_factor=5.0), False, "dims.partial_rotary_factor", "(0, 1]"),
    "a window for 1 of 2 layers": (_dims(layer_windows=[4]), False, "dims.layer_windows", "1 windows for 2 layers"),
    "a negative window": (_dims(layer_windows=[4, -4]), False, "dims.layer_windows", "a number of tokens >= 0"),
    "nope_layers past the layers": (_dims(nope_layers=[99]), False, "dims.nope_layers", "[0, 2)"),
    "hidden_act relu": (_dims(hidden_act="relu"), False, "dims.hidden_act", "one of silu, gelu_tanh"),
    "rope_scaling factor -3": (_dims(rope_scaling={"rope_type": "yarn", "factor": -3}), False,
                               "dims.rope_scaling.factor", "finite positive"),
    # were: "dims: no step model has these dims (The size of tensor a (3) must match ...)", and loaded as if false
    # (the C runtime refuses both the same way)
    "longrope with 3 factors for 8 pairs": (_dims(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3}),
                                            False, "dims.rope_scaling.short_factor", "expected 8 finite positive"),
    "yarn truncate null": (_dims(rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": None}), False,
                           "dims.rope_scaling.truncate", "expected true or false"),
    # were: ZeroDivisionError / OverflowError tracebacks out of rope.py (yarn's log(rope_theta) divisor at theta 1,
    # floor(inf) at a denormal beta_slow, a denominator mscale of 0; longrope's log(original) at original 1), which the
    # C runtime refuses as non-finite frequencies
    "yarn at rope_theta 1": (_dims(rope_theta=1.0, rope_scaling={"rope_type": "yarn", "factor": 4.0}), False, "dims",
                             "gives non-finite rotary frequencies"),
    "yarn beta_slow 5e-324": (_dims(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_slow": 5e-324}), False,
                              "dims", "gives non-finite rotary frequencies"),
    "yarn mscale_all_dim zeroing": (_dims(rope_scaling={"rope_type": "yarn", "factor": math.e, "mscale": 1.0,
                                                        "mscale_all_dim": -10.0}), False, "dims",
                                    "gives non-finite rotary frequencies"),
    "longrope original 1": (_dims(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "factor": 4.0,
                                                "original_max_position_embeddings": 1}), False, "dims",
                            "gives non-finite rotary frequencies"),
    # were: loaded, and every logit NaN (cos/sin scaled past float32, or a base whose powers leave it), which the C
    # runtime refuses (the base) or ran too (the scaling)
    "yarn attention_factor 1e39": (_dims(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e39}),
                                   False, "dims.rope_scaling.attention_factor", "finite and not 0 in float32"),
    "yarn mscale 1e300": (_dims(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1e300,
                                              "mscale_all_dim": 1.0}), False, "dims",
                          "gives a cos/sin scaling of 1.21751e+299"),
    "rope_theta 1e-45": (_dims(rope_theta=1e-45), False, "dims", "rope_theta 1e-45 gives non-finite"),
    # finite in float32, but the scores grow as its square: were loaded, and every logit NaN in both runtimes
    "yarn attention_factor 1e20": (_dims(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e20}),
                                   False, "dims", "gives a cos/sin scaling of 1e+20"),
    # were: loaded, then token 0 for ever (embed_scale 0) or every request failed (NaN): a Llama's embeddings are
    # not scaled and its logits not capped
    "embed_scale 0": (_dims(embed_scale=0.0), False, "dims.embed_scale", "scales embeddings by 1"),
    "embed_scale NaN": (_dims(embed_scale=float("nan")), False, "dims.embed_scale", "scales embeddings by 1"),
    "final_logit_softcap inf": (_dims(final_logit_softcap=float("inf")), False, "dims.final_logit_softcap",
                                "for Gemma"),
    "final_logit_softcap 30 on a Llama": (_dims(final_logit_softcap=30.0), False, "dims.final_logit_softcap",
                                          "for Gemma"),
    "attention_scale -1": (_dims(attention_scale=-1.0), False, "dims.attention_scale", "for Gemma"),
    "local_rope_theta NaN": (_dims(local_rope_theta=float("nan")), False, "dims.local_rope_theta", "for Gemma"),
    "gemma_norms on a Llama": (_dims(gemma_norms=True), False, "dims.gemma_norms", "Gemma only"),
    # was: "not an engine dir (no trtpaged.json)"
    "trtpaged.json a FIFO": (_manifest_a_fifo, False, "(file)", "is not a regular file"),
}


@pytest.mark.parametrize("kind", list(BROKEN))
def test_a_broken_engine_dir_is_refused_in_one_line(tiny_engine_dir, tmp_path, kind):
    from trtpaged import LLM

    damage, rehash, field, words = BROKEN[kind]
    engine = _copy(tiny_engine_dir, tmp_path)
    damage(engine)
    if rehash:
        _rehash(engine)
    for args in (["inspect", str(engine)], ["generate", str(engine), "--prompt", "hi", "--max-tokens", "2"]):
        r = _cli(*args)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.output)
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in r.output, r.output
        assert field in lines[0] and words in lines[0], lines[0]
    with pytest.raises(EngineDirError) as info:
        LLM(engine, device="cpu")
    assert field in info.value.field and words in str(info.value)
    assert info.value.path.name in str(info.value)


def test_the_intact_copy_loads_and_inspects(tiny_engine_dir, tmp_path):
    """The control: the same copy, undamaged, passes every check."""
    engine = _copy(tiny_engine_dir, tmp_path)
    r = _cli("inspect", str(engine))
    assert r.exit_code == 0 and "verified: 5 files" in r.output and "sha256 of every file" in r.output, r.output
    r = _cli("generate", str(engine), "--prompt", "hi", "--max-tokens", "2")
    assert r.exit_code == 0, r.output


def test_a_hand_edited_verification_summary_is_shown_as_such(tiny_engine_dir, tmp_path):
    """verification.accuracy / kv_cache are informational: in another form than a build writes, inspect says so in
    its line (was: a KeyError / TypeError traceback) and the engine still loads."""
    for summary in ({"max_abs_diff": 0.0, "tolerance": 1.0, "accuracy": {"x": 1}},
                    {"max_abs_diff": 0.0, "tolerance": 1.0, "kv_cache": {"a": 1}},
                    {"skipped": True, "accuracy": [1, 2]}):
        engine = _copy(tiny_engine_dir, tmp_path / str(len(list(tmp_path.iterdir()))))
        _edit_manifest(engine, verification=summary)
        r = _cli("inspect", str(engine))
        assert r.exit_code == 0 and "not in the form a build writes" in r.output, r.output


def test_a_memory_budget_past_int32_block_ids_is_refused(tiny_engine_dir, tmp_path):
    """memory_bytes of 10^15 would be 1.2e11 blocks, past the int32 block ids (inspect printed that pool)."""
    engine = _copy(tiny_engine_dir, tmp_path)
    _edit_manifest(engine, kv_cache={"num_kv_blocks": None, "memory_bytes": 10**15, "fraction": None})
    for args in (["inspect", str(engine)], ["generate", str(engine), "--prompt", "hi", "--max-tokens", "2"]):
        r = _cli(*args)
        assert r.exit_code == 1 and "kv_cache.memory_bytes" in r.output and "int32 block ids" in r.output, r.output


def test_a_text_the_tokenizer_encodes_past_the_vocabulary_is_refused_per_request(tiny_engine_dir, tmp_path):
    """A tokenizer may hold ids past the embedding (Gemma 3's image token sits at vocab_size), so the engine
    loads; a text that encodes to one is refused naming the prompt (was: an IndexError traceback out of the
    embedding), and other texts run."""
    from trtpaged import LLM, SamplingParams
    from trtpaged.errors import RequestError

    engine = _copy(tiny_engine_dir, tmp_path)
    _tokenizer_ids_past_the_vocabulary(engine)
    _rehash(engine)
    r = _cli("generate", str(engine), "--prompt", '!"#$%', "--max-tokens", "2")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "outside the model's vocabulary [0, 320)" in lines[0], r.output
    with LLM(engine, device="cpu", warmup=False) as llm:
        with pytest.raises(RequestError) as refused:
            llm.generate('!"#$%', SamplingParams(max_tokens=2))
        assert refused.value.field == "prompt" and refused.value.limit == 320
        assert llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
        assert llm.stats()["kv_blocks_used"] == 0


def test_the_manifest_hash_covers_values_not_their_spelling(tiny_engine_dir, tmp_path):
    """Rewritten with other whitespace, key order and number spelling, the manifest still loads; without the hash
    (an older build's) too; with any value changed and the hash kept it is refused (the table above)."""
    engine = _copy(tiny_engine_dir, tmp_path)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    assert len(data["content_sha256"]) == 64
    text = json.dumps(dict(reversed(list(data.items()))), separators=(" ,", " : "))
    text = text.replace('"rope_theta" : 10000.0', '"rope_theta" : 1e4')
    assert "1e4" in text
    (engine / MANIFEST_NAME).write_text(text)
    assert read_manifest(engine).dims.rope_theta == 10000.0
    assert Manifest.from_dict(data).dims.rope_theta == 10000.0  # parsed JSON, derived fields and all
    for bad in (12, "ABC", data["content_sha256"].upper()):  # a hash's form is checked before its value
        with pytest.raises(EngineDirError, match="content_sha256: got .*; expected a sha256 hex digest"):
            Manifest.from_dict({**data, "content_sha256": bad})
    del data["content_sha256"]
    (engine / MANIFEST_NAME).write_text(json.dumps(data))
    assert read_manifest(engine).dims.rope_theta == 10000.0


def test_hashes_are_checked_in_full_once_then_by_stamp(tiny_engine_dir, tmp_path):
    engine = _copy(tiny_engine_dir, tmp_path)
    manifest = read_manifest(engine)
    assert verify_engine_dir(engine, manifest).method == "sha256"
    assert verify_engine_dir(engine, manifest).method == "stamp"
    stamps = list((tmp_path / "cache" / "verified").iterdir())
    assert len(stamps) == 1 and not any(p.name.endswith(".json") for p in engine.rglob("*") if p.parent == engine
                                        and p.name != MANIFEST_NAME)
    assert verify_engine_dir(engine, manifest, full=True).method == "sha256"  # inspect --verify
    r = _cli("inspect", str(engine))
    assert "unchanged since verified" in r.output
    r = _cli("inspect", str(engine), "--verify")
    assert "sha256 of every file" in r.output
    # a change after the stamp (same size, mtime put back; the ctime moves) is hashed and refused
    _random_bytes_in_place(engine)
    with pytest.raises(EngineDirError, match="sha256"):
        verify_engine_dir(engine, manifest)


def test_no_stamp_where_home_is_nowhere_and_no_half_written_one_is_left(tiny_engine_dir, tmp_path, monkeypatch):
    """HOME=/nonexistent (a service user's): the stamp's dirs were made under it; now no stamp is kept (every
    load hashes). A stamp that cannot be written (a full disk) left its temp file, one per load; now none."""
    import errno

    from trtpaged import engine_files

    engine = _copy(tiny_engine_dir, tmp_path)
    manifest = read_manifest(engine)
    monkeypatch.delenv("TRTPAGED_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    assert [verify_engine_dir(engine, manifest).method for _ in range(2)] == ["sha256", "sha256"]
    assert not (tmp_path / "nowhere").exists()
    monkeypatch.setenv("TRTPAGED_CACHE_DIR", str(tmp_path / "full"))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_files.json, "dump", no_space)
    assert [verify_engine_dir(engine, manifest).method for _ in range(2)] == ["sha256", "sha256"]
    assert list((tmp_path / "full" / "verified").iterdir()) == []


def test_a_tokenizer_with_auto_map_never_runs_its_code(tiny_engine_dir, tmp_path):
    from trtpaged import LLM

    engine = _copy(tiny_engine_dir, tmp_path)
    marker = tmp_path / "code-ran"
    config_path = engine / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    config_path.write_text(json.dumps(config))
    (engine / "tokenizer" / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast): pass\n")
    _rehash(engine)  # the manifest lists the files: only trust_remote_code=False stands in the way
    llm = LLM(engine, device="cpu")
    assert type(llm.tokenizer).__name__ != "EvilTokenizer" and not marker.exists()


def test_kv_pools_beyond_the_device_memory_are_refused_before_allocating(tiny_engine_dir, tmp_path):
    from trtpaged import LLM
    from trtpaged.kv_budget import KVBudgetError

    with pytest.raises(KVBudgetError) as info:
        LLM(tiny_engine_dir, device="cpu", num_kv_blocks=2**31 - 1)  # 8 KiB blocks: 16 TiB
    assert info.value.field == "num_kv_blocks" and info.value.limit > 0 and "GiB" in str(info.value)
    engine = _copy(tiny_engine_dir, tmp_path)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    _edit_manifest(engine, kv_cache={**data["kv_cache"], "num_kv_blocks": 2**31 - 1})
    with pytest.raises(KVBudgetError, match="kv_cache.num_kv_blocks: 2147483647 blocks of 8192 bytes need"):
        LLM(engine, device="cpu")
    r = _cli("generate", str(engine), "--prompt", "hi")
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "kv_cache.num_kv_blocks" in r.output, r.output


def test_a_head_dim_without_cuda_kernels_is_refused_at_load_on_cuda(tiny_engine_dir):
    # tiny.yaml's head_dim 16 has CPU kernels but no CUDA ones: on a GPU the load says so before any weight
    # goes to the device (was: the first step failed inside the attention kernel, found on an H200).
    from trtpaged.models import load_step_model
    from trtpaged.models.dims import CUDA_HEAD_DIMS

    assert read_manifest(tiny_engine_dir).dims.head_dim not in CUDA_HEAD_DIMS
    with pytest.raises(ValueError, match=r"head_dim: .* has head_dim 16; the CUDA kernels support 64, 80, 96, 128"):
        load_step_model(tiny_engine_dir, device="cuda")
    assert load_step_model(tiny_engine_dir, device="cpu")[1].dims.head_dim == 16


def test_serve_refuses_a_bad_port_and_too_many_kv_blocks_in_one_line(tiny_engine_dir):
    r = _cli("serve", str(tiny_engine_dir), "--port", "70000")
    assert r.exit_code == 2 and "Traceback" not in r.output and "70000 is not in the range 0<=x<=65535" in r.output
    r = _cli("serve", str(tiny_engine_dir), "--port", "0", "--num-kv-blocks", str(2**31 - 1), "--device", "cpu")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and lines[-1].startswith("Error: --num-kv-blocks: 2147483647 blocks"), r.output
    assert "Traceback" not in r.output


def test_tensor_parallel_shards_are_confined_and_checked(tiny_kv4_engines, tmp_path):
    from trtpaged import LLM

    engine = _copy(tiny_kv4_engines[2], tmp_path)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    shards = [dict(s) for s in data["shards"]]
    shards[1]["weights_file"] = "../../weights-rank1.safetensors"
    _edit_manifest(engine, shards=shards)
    r = _cli("inspect", str(engine))
    assert r.exit_code == 1
    assert "shards[1].weights_file: '../../weights-rank1.safetensors' is not a path inside" in r.output

    engine = _copy(tiny_kv4_engines[2], tmp_path / "second")
    shard = engine / "weights-rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4096])
    _rehash(engine)
    r = _cli("inspect", str(engine))
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "weights-rank1.safetensors: shards[1].weights_file:" in lines[0]
    assert "not a valid safetensors file" in lines[0], r.output
    with pytest.raises(EngineDirError, match="shards\\[1\\].weights_file"):  # before any rank is started
        LLM(engine, device="cpu")


def test_a_terminal_without_the_characters_gets_them_escaped_not_a_traceback(tiny_engine_dir, tmp_path):
    """A latin-1 (or ASCII) terminal: a model path in Chinese in `inspect`'s lines (or a build's, or a model's
    U+FFFD from `generate`) ended the command with UnicodeEncodeError's traceback; the characters come out escaped
    and the command succeeds."""
    engine = _copy(tiny_engine_dir, tmp_path)
    data = json.loads((engine / MANIFEST_NAME).read_text())
    _edit_manifest(engine, source={**data["source"], "path": "/models/引擎"})
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    out = subprocess.run([sys.executable, "-m", "trtpaged.cli", "inspect", str(engine)], env=env,
                         capture_output=True)  # fmt: skip
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr[-400:]
    assert b"from /models/\\u5f15\\u64ce" in out.stdout  # the path, escaped


LOADED_THEN_CHANGED = """
import sys
from trtpaged import LLM, SamplingParams
engine, how = sys.argv[1], sys.argv[2]
llm = LLM(engine, device="cpu")
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
before = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
weights = engine + "/weights.safetensors"
with open(weights, "r+b") as f:  # in place: the same file, as cp over it, rsync --inplace or a truncation do
    if how == "truncate":
        f.truncate(0)
    else:
        f.seek(4096)
        f.write(bytes(range(256)) * 64)
after = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
print(list(before) == list(after))
"""


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_a_weights_file_changed_in_place_after_the_load_changes_nothing(tiny_engine_dir, tmp_path, how):
    """The weights are the process's own once loaded: a file truncated in place killed the process (SIGBUS, the
    tensors were its mapping), and one rewritten in place changed the answers to bytes no check had read."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    done = subprocess.run([sys.executable, "-c", LOADED_THEN_CHANGED, str(engine), how], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip().splitlines()[-1] == "True", done.stdout


@pytest.mark.parametrize("name", [MANIFEST_NAME, "model.onnx"])
def test_inspect_takes_a_file_of_the_engine_dir_as_generate_does(tiny_engine_dir, name):
    """A file in the engine dir names it for `generate` (LLM(...)); inspect read its manifest from the dir, then
    looked for tokenizer/ under the file itself and told the user to rebuild an intact engine."""
    r = _cli("inspect", "--verify", str(tiny_engine_dir / name))
    assert r.exit_code == 0 and "verified: 5 files" in r.output, r.output
    timing = re.compile(r"\(\d+\.\d+s\)")  # the verification's seconds
    assert timing.sub("", r.output) == timing.sub("", _cli("inspect", "--verify", str(tiny_engine_dir)).output)
    r = _cli("generate", str(tiny_engine_dir / name), "--prompt", "hi", "--max-tokens", "2")
    assert r.exit_code == 0, r.output
