"""`trtpaged build` end to end: engine dir contents, ONNX contract, verification, bad configs, inspect."""

from __future__ import annotations

import json
import shutil
import time
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from click.testing import CliRunner

from trtpaged.builder import build_engine
from trtpaged.builder.engine_dir import sha256_file
from trtpaged.builder.onnx_node import DOMAIN, OP_TYPE
from trtpaged.builder.probe import ProbeSequence, pack_step
from trtpaged.cli import main
from trtpaged.config import ConfigError, parse_config
from trtpaged.manifest import read_manifest
from trtpaged.models import load_step_model

from runtime_helpers import hf_from_engine_dir, hf_greedy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())


def _yaml(tmp_path: Path, data: dict, name: str = "model.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


# --- the tiny engine -------------------------------------------------------------------------


def test_manifest_matches_files(tiny_engine_dir):
    m = read_manifest(tiny_engine_dir)
    on_disk = {str(p.relative_to(tiny_engine_dir)) for p in tiny_engine_dir.rglob("*") if p.is_file()}
    assert on_disk == set(m.files) | {"trtpaged.json"}
    for name, sha in m.files.items():
        assert sha256_file(tiny_engine_dir / name) == sha
    assert {"model.onnx", "weights.safetensors", "tokenizer/tokenizer.json"} <= set(m.files)
    assert m.backends == ["torch"] and m.plan_file is None and m.format_version == 1
    raw = json.loads((tiny_engine_dir / "trtpaged.json").read_text())
    assert raw["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert raw["kv_bytes_per_block"] == raw["kv_bytes_per_token"] * 16
    assert m.kv_cache.num_kv_blocks == 256 and m.limits.max_seq_len == 512
    assert m.eos_token_ids == [257] and m.bos_token_id == 256 and m.chat_template


def test_verification_recorded(tiny_engine_dir):
    v = read_manifest(tiny_engine_dir).verification
    assert v["max_abs_diff"] <= v["tolerance"] and v["rows"] > 0 and v["steps"] == 2


def test_onnx_contract(tiny_engine_dir):
    path = tiny_engine_dir / "model.onnx"
    onnx.checker.check_model(str(path), full_check=False)
    model = onnx.load(str(path), load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert len(nodes) == 2 and all(n.op_type == OP_TYPE for n in nodes)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[1].attribute}
    assert attrs["layer"] == 1 and attrs["num_heads"] == 4 and attrs["num_kv_heads"] == 2
    assert attrs["head_dim"] == 16 and attrs["block_size"] == 16 and abs(attrs["scale"] - 0.25) < 1e-7
    assert attrs["plugin_version"] == b"1" and attrs["plugin_namespace"] == b"trtpaged"
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["input_ids"] == ["num_tokens"] and inputs["block_tables"] == ["num_seqs", "max_blocks_per_seq"]
    assert inputs["kv_cache"] == ["num_kv_blocks", 2, 2, 2, 16, 16] and inputs["logits_index"] == ["num_outputs"]
    assert [o.name for o in model.graph.output] == ["logits", "kv_cache_out"]
    # weights live once, in weights.safetensors: the graph only references them
    external = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert external == {"weights.safetensors"}
    assert path.stat().st_size < 300_000 and not (tiny_engine_dir / "model.onnx.data").exists()


def test_onnx_runs_other_shapes_like_the_torch_runner(tiny_engine_dir):
    """Dynamic dims: one sequence, different pool size and block-table width than at export."""
    from onnx.reference import ReferenceEvaluator

    from trtpaged.builder.onnx_reference import TrtpagedPagedAttention

    model, _ = load_step_model(tiny_engine_dir)
    seqs = [ProbeSequence(tokens=list(range(3, 100)), blocks=[9, 1, 4, 7, 2, 11, 0])]
    step = pack_step(seqs, [(0, 0, 97)], all_rows=True)
    pool = model.new_kv_cache(12, 16)
    with torch.no_grad():
        expected, _ = model(*step.args(pool.clone()))
    session = ReferenceEvaluator(str(tiny_engine_dir / "model.onnx"), new_ops=[TrtpagedPagedAttention])
    feeds = {k: v.numpy() for k, v in step.inputs.items()} | {"kv_cache": pool.numpy()}
    logits, new_pool = session.run(None, feeds)
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4)
    assert np.abs(new_pool).sum() > 0


def test_tokenizer_loads_from_engine_dir(tiny_engine_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_engine_dir / "tokenizer")
    assert tok.decode(tok("paged")["input_ids"]) == "paged"
    assert "assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                  add_generation_prompt=True)


def test_qwen2_tiny_builds_and_verifies(tmp_path):
    data = {**TINY, "model": {"tiny": {"architecture": "Qwen2ForCausalLM", "num_hidden_layers": 1,
                                       "tie_word_embeddings": True}}}
    config = parse_config(data, base_dir=tmp_path)
    result = build_engine(config, tmp_path / "qwen", echo=lambda s: None)
    m = result.manifest
    assert m.dims.attention_bias and not m.dims.o_proj_bias and m.dims.tie_word_embeddings
    assert m.verification["max_abs_diff"] <= m.verification["tolerance"]


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_build_prints_stages_and_inspect_prints_memory_plan(tmp_path):
    out = tmp_path / "e"
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out))
    assert r.exit_code == 0, r.output
    for stage in ("check", "load", "patch", "export", "verify", "compile", "write"):
        assert stage in r.output
    assert "max abs diff" in r.output and f"built {out}" in r.output
    r = _cli("inspect", str(out), "--avg-len", "100")
    assert r.exit_code == 0, r.output
    assert "KV bytes per token:   512" in r.output and "blocks in budget:     256" in r.output
    assert "at max_seq_len 512: 8" in r.output and "average length 100: 36" in r.output


def test_build_help_documents_everything():
    text = _cli("build", "--help").output
    for word in ("hf_dir", "gguf", "package", "tiny", "dtype", "kv_cache_dtype", "max_batch_size",
                 "max_num_tokens", "max_seq_len", "block_size", "num_kv_blocks", "fraction", "backend",
                 "output", "--skip-verify", "-o", "atol + rtol"):
        assert word in text


def test_inspect_fraction_budget(tmp_path):
    config = parse_config({**TINY, "kv_cache": {"fraction": 0.5}}, base_dir=EXAMPLES)
    build_engine(config, tmp_path / "f", skip_verify=True, echo=lambda s: None)
    r = _cli("inspect", str(tmp_path / "f"))
    assert "decided at serve time" in r.output
    r = _cli("inspect", str(tmp_path / "f"), "--memory", "1MiB")
    assert "blocks in budget:     64" in r.output  # 0.5 MiB / 8 KiB blocks


def test_inspect_reports_the_blocks_the_runtime_allocates(tmp_path):
    from trtpaged import LLM

    config = parse_config({**TINY, "kv_cache": {"fraction": 0.5}}, base_dir=EXAMPLES)
    build_engine(config, tmp_path / "f", skip_verify=True, echo=lambda s: None)
    lim = config.limits
    useful = lim.max_batch_size * -(-lim.max_seq_len // lim.block_size)  # every sequence at full length
    r = _cli("inspect", str(tmp_path / "f"), "--memory", "64MiB")  # 0.5 x 64 MiB holds 4096 blocks of 8 KiB
    assert f"blocks in budget:     {useful}" in r.output and "capped" in r.output, r.output
    assert LLM(tmp_path / "f", device="cpu").config.num_kv_blocks == useful  # this host has more than 64 MiB free


BAD = {
    "missing model": ({k: v for k, v in TINY.items() if k != "model"}, "model: missing"),
    "unknown key": ({**TINY, "max_seq_length": 64}, "did you mean 'max_seq_len'"),
    "negative limit": ({**TINY, "max_batch_size": -2}, "max_batch_size: got -2"),
    "block_size": ({**TINY, "block_size": 24}, "power of two"),
    "tokens < batch": ({**TINY, "max_batch_size": 16, "max_num_tokens": 8}, "max_num_tokens: got 8"),
    "tensorrt": ({**TINY, "backend": "tensorrt"}, "backend: 'tensorrt'"),
    "kv memory too small": ({**TINY, "kv_cache": {"memory": "64KiB"}}, "kv_cache.memory: 65536 bytes hold 8 blocks"),
    "unsupported arch": ({**TINY, "model": {"tiny": {"architecture": "GPT2LMHeadModel"}}},
                         "supported: LlamaForCausalLM"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_yaml_is_a_clear_error_and_leaves_nothing(tmp_path, case):
    if case == "tensorrt":
        from trtpaged.tensorrt_env import tensorrt_installed

        if tensorrt_installed():
            pytest.skip("TensorRT installed")
    data, message = BAD[case]
    out = tmp_path / "out" / "engine"
    r = _cli("build", str(_yaml(tmp_path, data)), "-o", str(out))
    assert r.exit_code != 0 and message in r.output, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_unreadable_gguf(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    out = tmp_path / "out"
    r = _cli("build", str(_yaml(tmp_path, {"model": {"gguf": "broken.gguf"}})), "-o", str(out))
    assert r.exit_code != 0 and "not a readable GGUF file" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf", "model.yaml"]


def test_failed_build_leaves_nothing_and_keeps_old_engine(tmp_path, monkeypatch):
    from trtpaged.builder import verify

    config = parse_config(TINY, base_dir=EXAMPLES)
    out = tmp_path / "new" / "engine"
    monkeypatch.setitem(verify.TOLERANCES, "float32", (0.0, 0.0))
    with pytest.raises(verify.VerificationError):
        build_engine(config, out, echo=lambda s: None)
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    build_engine(config, out, skip_verify=True, echo=lambda s: None)
    before = sha256_file(out / "trtpaged.json")
    monkeypatch.setitem(verify.TOLERANCES, "float32", (0.0, 0.0))
    with pytest.raises(verify.VerificationError):
        build_engine(config, out, force=True, echo=lambda s: None)
    assert sha256_file(out / "trtpaged.json") == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["engine"]


def test_output_that_is_not_an_engine_dir_is_refused(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not an engine dir"):
        build_engine(parse_config(TINY, base_dir=EXAMPLES), tmp_path, echo=lambda s: None)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


# --- SmolLM2 -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_builds_and_verifies(smollm2_engine_dir):
    from transformers import AutoTokenizer

    m = read_manifest(smollm2_engine_dir)
    assert m.dims.num_layers == 30 and m.dims.num_kv_heads == 3 and m.dims.tie_word_embeddings
    assert m.verification["max_abs_diff"] <= m.verification["tolerance"]
    model = onnx.load(str(smollm2_engine_dir / "model.onnx"), load_external_data=False)
    assert sum(n.op_type == OP_TYPE for n in model.graph.node) == 30
    tok = AutoTokenizer.from_pretrained(smollm2_engine_dir / "tokenizer")
    assert tok.chat_template and m.chat_template and m.eos_token_ids
    log = (smollm2_engine_dir.parent / "smollm2.log").read_text()
    assert "verify" in log and "max abs diff" in log
    r = _cli("inspect", str(smollm2_engine_dir), "--avg-len", "300")
    assert r.exit_code == 0 and "KV bytes per token:   46,080" in r.output and "average length 300" in r.output


def test_cpu_build_forces_float32_with_a_warning(tmp_path):
    lines: list[str] = []
    config = parse_config({**TINY, "dtype": "float16"}, base_dir=EXAMPLES)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device keeps float16")
    m = build_engine(config, tmp_path / "e", skip_verify=True, echo=lines.append).manifest
    assert m.dtype == m.kv_cache_dtype == "float32"
    assert any(line.startswith("warning: dtype float16") for line in lines)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_cpu_build_keeps_a_16_bit_kv_cache_dtype_given_explicitly(tmp_path, kv_cache_dtype):
    # dtype falls back to float32 without a GPU, but a named 16-bit KV cache is kept (the CPU
    # kernels read it directly); the engine then generates what HF generates greedily.
    if torch.cuda.is_available():
        pytest.skip("a CUDA device keeps float16")
    from trtpaged.runtime.llm import LLM
    from trtpaged.runtime.sampling_params import SamplingParams

    config = parse_config({**TINY, "dtype": "float16", "kv_cache_dtype": kv_cache_dtype}, base_dir=EXAMPLES)
    m = build_engine(config, tmp_path / "e", echo=lambda _m: None).manifest
    assert (m.dtype, m.kv_cache_dtype) == ("float32", kv_cache_dtype)
    llm = LLM(str(tmp_path / "e"))
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    prompt = [5, 17, 99, 3, 42, 8]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    want = hf_greedy(hf_from_engine_dir(tmp_path / "e"), prompt, 12, eos=None)
    assert list(out.outputs[0].token_ids) == want


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_graphs_export_and_float16_verifies(tmp_path, dtype):
    from trtpaged.builder.export import export_onnx
    from trtpaged.builder.verify import unsupported_reason, verify_onnx
    from trtpaged.builder.weights import save_weights
    from trtpaged.models import TORCH_DTYPES, dims_from_hf_config, load_hf, step_model_from_hf

    hf = load_hf(parse_config(TINY, base_dir=EXAMPLES).model)
    dims = dims_from_hf_config(hf.config)
    model = step_model_from_hf(hf.model, dims, TORCH_DTYPES[dtype])
    save_weights(model, tmp_path / "weights.safetensors")
    export_onnx(model, 16, TORCH_DTYPES[dtype], tmp_path / "model.onnx", tmp_path / "weights.safetensors")
    onnx.checker.check_model(str(tmp_path / "model.onnx"))
    if dtype == "bfloat16":
        assert "bfloat16" in unsupported_reason(dtype, dtype)
        return
    result = verify_onnx(tmp_path / "model.onnx", hf.model, dims.vocab_size, 16, dtype, dtype)
    assert result.max_abs_diff <= result.tolerance


def test_hf_dir_source_builds(tmp_path):
    from trtpaged.models import load_hf

    hf = load_hf(parse_config({"model": {"tiny": {"architecture": "MistralForCausalLM",
                                                  "num_hidden_layers": 1}}}).model)  # fmt: skip
    hf.model.save_pretrained(tmp_path / "hf")
    hf.tokenizer.save_pretrained(tmp_path / "hf")
    config = parse_config({**TINY, "model": {"hf_dir": "hf"}}, base_dir=tmp_path)
    m = build_engine(config, tmp_path / "e", echo=lambda s: None).manifest
    assert m.dims.architecture == "MistralForCausalLM" and m.source["kind"] == "hf_dir"
    assert m.verification["max_abs_diff"] <= m.verification["tolerance"]


def _hub_cache_snapshot(src: Path, cache: Path) -> Path:
    """`src`'s files laid out as huggingface_hub's cache holds a download: models--org--name/snapshots/<commit>/
    of links to ../../blobs/<sha256>."""
    import hashlib

    repo = cache / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / ("0123abcd" * 5), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / sha)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", sha))
    return snapshot


def test_a_hub_cache_snapshot_of_sharded_bfloat16_links_builds_and_generates_as_hf(tmp_path):
    """Every model huggingface_hub downloads is a snapshot dir of links leaving it (into the repo's blobs/): such a
    dir, of a sharded bfloat16 checkpoint, builds and its engine's greedy tokens are transformers' own."""
    from transformers import AutoModelForCausalLM

    from trtpaged import LLM, SamplingParams
    from trtpaged.models import load_hf

    hf = load_hf(parse_config({"model": {"tiny": {"seed": 3}}}).model)
    hf.model.to(torch.bfloat16).save_pretrained(tmp_path / "src", max_shard_size="40KB")
    hf.tokenizer.save_pretrained(tmp_path / "src")
    assert len(list((tmp_path / "src").glob("model-*.safetensors"))) > 2
    snapshot = _hub_cache_snapshot(tmp_path / "src", tmp_path / "cache")
    config = parse_config({**TINY, "model": {"hf_dir": str(snapshot)}}, base_dir=tmp_path)
    build_engine(config, tmp_path / "e", echo=lambda s: None)
    reference = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    prompt = [5, 17, 42, 99, 7, 250, 3]
    expected = hf_greedy(types.SimpleNamespace(model=reference), prompt, 8, None)
    (out,) = LLM(tmp_path / "e", device="cpu").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert list(out.outputs[0].token_ids) == expected


def test_unsupported_hf_dir_architecture_is_refused_before_loading(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    r = _cli("build", str(_yaml(tmp_path, {"model": {"hf_dir": "gpt2"}})), "-o", str(tmp_path / "out"))
    assert r.exit_code != 0 and "GPT2LMHeadModel is not supported" in r.output and "Qwen2ForCausalLM" in r.output
    assert not (tmp_path / "out").exists()


def test_gguf_header_gives_the_architecture_without_loading():
    from trtpaged.models import source_architecture

    spec = parse_config(yaml.safe_load((EXAMPLES / "smollm2.yaml").read_text()), base_dir=EXAMPLES).model
    assert source_architecture(spec) == "LlamaForCausalLM"


def test_build_with_inconsistent_tiny_heads_is_a_clear_error(tmp_path):
    data = {
        "model": {"tiny": {"hidden_size": 64, "num_attention_heads": 3, "num_key_value_heads": 1}},
        "max_seq_len": 64, "kv_cache": {"num_kv_blocks": 8},
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["build", str(tmp_path / "m.yaml"), "-o", str(tmp_path / "out" / "eng")])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "model.tiny" in result.output and "not a multiple of the number of attention heads" in result.output
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.yaml"]


def test_build_refuses_an_existing_engine_dir_unless_forced(tmp_path):
    out = tmp_path / "engine"
    assert _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify").exit_code == 0
    before = sha256_file(out / "trtpaged.json")
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify")
    assert r.exit_code == 1 and "is an engine dir already; pass --force" in r.output, r.output
    assert sha256_file(out / "trtpaged.json") == before
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify", "--force")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine"]  # replaced in place, no leftovers


def test_force_replaces_only_an_engine_dir_and_nothing_else_in_it(tmp_path):
    """--force took any dir holding a file named trtpaged.json for an engine dir, and deleted it whole."""
    out = tmp_path / "engine"
    assert _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify").exit_code == 0
    (out / "notes.txt").write_text("mine")
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify", "--force")
    assert r.exit_code == 1 and "holds files its trtpaged.json does not name (notes.txt)" in r.output, r.output
    assert (out / "notes.txt").read_text() == "mine"
    project = tmp_path / "project"
    (project / "sub").mkdir(parents=True)
    (project / "trtpaged.json").write_text('{"my": "project settings"}')
    (project / "sub" / "x").write_text("1")
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(project), "--skip-verify", "--force")
    assert r.exit_code == 1 and "holds a trtpaged.json that is not an engine's" in r.output, r.output
    assert (project / "sub" / "x").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["engine",
                                                                                                         "project"]
    # a manifest naming "." as a dir took in everything; one of another format version is still an engine's
    (out / "notes.txt").unlink()
    manifest = json.loads((out / "trtpaged.json").read_text())
    (out / "trtpaged.json").write_text(json.dumps({**manifest, "tokenizer_dir": ".", "format_version": 99}))
    (out / "mine").mkdir()
    (out / "mine" / "data").write_text("mine")
    r = _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify", "--force")
    assert r.exit_code == 1 and "does not name (mine/data)" in r.output, r.output
    shutil.rmtree(out / "mine")
    assert _cli("build", str(EXAMPLES / "tiny.yaml"), "-o", str(out), "--skip-verify", "--force").exit_code == 0


def test_a_long_stage_prints_heartbeats_with_elapsed_time():
    """A beat every 0.05 s of a 0.23 s stage (4 on a quiet machine), and the stage's time on its end line. The
    bounds follow the time the stage really took (`took`): a loaded machine stretches the sleep (0.254 s once, whose
    end line read 0.3 s), and a beat is printed once per 0.05 s waited, so at most took / 0.05 of them."""
    from trtpaged.builder.progress import Progress

    lines: list[str] = []
    progress = Progress(lines.append, heartbeat=0.05)
    start = time.perf_counter()
    with progress.stage("load") as st:
        time.sleep(0.23)
        st.note("done")
    took = time.perf_counter() - start
    beats = [line for line in lines if line.startswith("load     ... ")]
    assert 3 <= len(beats) <= took / 0.05, (beats, took)
    assert lines[-1].startswith("load     done  (") and lines[-1].endswith("s)"), lines[-1]
    shown = float(lines[-1].removeprefix("load     done  (").removesuffix("s)"))
    assert 0.2 <= shown <= took + 0.05, (shown, took)  # the stage's own time, printed to 0.1 s
    with progress.stage("patch"):
        pass
    assert not lines[-1].startswith("patch    ...")  # a quick stage prints only its end line


def test_export_leaves_out_the_quadratic_rewrite_rule_only_while_exporting() -> None:
    """The exporter's optimizer runs without SlicesSplit; onnxscript's own rule list is back afterwards, also when
    the export inside raised."""
    from onnxscript import rewriter

    from trtpaged.builder.export import _without_quadratic_rewrites

    before = rewriter._DEFAULT_REWRITE_RULES
    names = [getattr(r, "name", None) for r in before]
    assert "SlicesSplit" in names
    with _without_quadratic_rewrites():
        inside = [getattr(r, "name", None) for r in rewriter._DEFAULT_REWRITE_RULES]
    assert inside == [n for n in names if n != "SlicesSplit"]
    assert rewriter._DEFAULT_REWRITE_RULES is before
    with pytest.raises(RuntimeError, match="export failed"), _without_quadratic_rewrites():
        raise RuntimeError("export failed")
    assert rewriter._DEFAULT_REWRITE_RULES is before
