"""The C runtime (libtrtpaged_runtime, runtime.h) and its example against the Python runtime: the same greedy
token ids for the same prompts, alone and batched (continuous batching, a shared prefix, preemption), the step
API's logits against the Python step model's, and bad inputs refused with the argument named."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_manifest

from c_runtime import (REPO, CError, CRuntime, Stats, StepInputs, build, check, generate, i32_array, load,
                       parse_outputs, setup_build_dir)
from trtpaged import LLM, SamplingParams
from trtpaged.manifest import EngineDirError, read_manifest

MAX_TOKENS = 24
# A is exactly max_num_tokens long, so it is prefilled alone and its full blocks are cached before B (which shares
# its first 40 tokens, two full blocks) is admitted; a pool of 8 blocks cannot hold all four: one is preempted.
SHARED = [(7 * i + 3) % 300 + 5 for i in range(48)]
PROMPTS = [SHARED, SHARED[:40] + [17, 93, 5, 211, 64], [(11 * i + 1) % 310 for i in range(20)], [1, 2, 3, 4, 5]]
BATCH = {"num_kv_blocks": 8, "max_num_tokens": 48}


@pytest.fixture(scope="session")
def build_dir() -> Path:
    # a dir of its own is not build/*/, where the kernel loader looks
    return build(setup_build_dir() or REPO / "build" / "tests" / "c-runtime")


@pytest.fixture(scope="session")
def lib(build_dir):
    return load(build_dir)


def python_greedy(engine_dir: Path, prompts, max_tokens: int, **options) -> tuple[list[list[int]], dict]:
    llm = LLM(engine_dir, device="cpu", backend="torch", **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([list(p) for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in out], llm.engine.stats()


def python_alone(engine_dir: Path, prompts, max_tokens: int) -> list[list[int]]:
    llm = LLM(engine_dir, device="cpu", backend="torch", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(llm.generate([list(p)], params)[0].outputs[0].token_ids) for p in prompts]


def example_alone(build_dir: Path, engine_dir: Path, prompts, max_tokens: int) -> list[list[int]]:
    got = []
    for p in prompts:
        run = generate(build_dir, engine_dir, [p], "--max-tokens", str(max_tokens), "--ignore-eos",
                       "--no-prefix-caching")
        assert run.returncode == 0, run.stderr
        got.append(parse_outputs(run.stdout)[0][0])
    return got


def example_batch(build_dir: Path, engine_dir: Path, prompts, max_tokens: int) -> tuple[list[list[int]], dict]:
    run = generate(build_dir, engine_dir, prompts, "--max-tokens", str(max_tokens), "--ignore-eos", "--stats",
                   "--num-kv-blocks", str(BATCH["num_kv_blocks"]), "--max-num-tokens", str(BATCH["max_num_tokens"]))
    assert run.returncode == 0, run.stderr
    tokens, reasons, stats = parse_outputs(run.stdout)
    assert set(reasons.values()) == {"length"}
    return [tokens[i] for i in range(len(prompts))], stats


def test_example_matches_python_tiny(build_dir, tiny_engine_dir):
    assert example_alone(build_dir, tiny_engine_dir, PROMPTS, MAX_TOKENS) == python_alone(tiny_engine_dir, PROMPTS,
                                                                                         MAX_TOKENS)
    want, py_stats = python_greedy(tiny_engine_dir, PROMPTS, MAX_TOKENS, num_kv_blocks=BATCH["num_kv_blocks"],
                                   max_num_tokens=BATCH["max_num_tokens"])
    got, stats = example_batch(build_dir, tiny_engine_dir, PROMPTS, MAX_TOKENS)
    assert got == want
    # the scenario is the one intended, in both runtimes: a preemption, and B's two shared blocks found cached
    assert py_stats["num_preemptions"] >= 1 and stats["preemptions"] == py_stats["num_preemptions"]
    assert stats["prefix_hits_tokens"] >= 32 and stats["steps"] == py_stats["num_steps"]


def test_c_api_requests_match_python_tiny(lib, tiny_engine_dir):
    want, _ = python_greedy(tiny_engine_dir, PROMPTS, 12, **BATCH)
    with CRuntime(lib, tiny_engine_dir, **BATCH) as rt:
        assert rt.info.vocab_size == 320 and rt.info.num_kv_blocks == 8 and rt.info.max_num_tokens == 48
        assert rt.generate(PROMPTS, 12) == want
        st = rt.stats()
        assert st.num_preemptions >= 1 and st.num_running == st.num_waiting == 0
        assert st.kv_blocks_used == 0  # every block back in the pool (cached ones stay findable)
        # the counters by name: each stats field's value, the reclaimed blocks (no window here: none)
        assert {name: rt.counter(name) for name, _ in st._fields_} == {name: getattr(st, name) for name, _ in
                                                                        st._fields_}  # fmt: skip
        assert rt.counter("kv_blocks_reclaimed") == 0
        for name in (b"kv_blocks_reclaimedX", b"", b"x" * 100):
            with pytest.raises(CError, match="name: got '.*'; expected one of kv_blocks_free, kv_blocks_reclaimed"):
                rt.counter(name)


def test_abort_and_stop_tokens(lib, tiny_engine_dir):
    with CRuntime(lib, tiny_engine_dir) as rt:
        (free_run,) = rt.generate([PROMPTS[3]], 8)
        stop = free_run[3]
        stops = (ctypes.c_int32 * 1)(stop)
        rid = rt.add(PROMPTS[3], 8, stop_token_ids=ctypes.cast(stops, ctypes.c_void_p), num_stop_token_ids=1)
        other = rt.add(PROMPTS[2], 50)
        tokens, reason = [], "running"
        while reason == "running":
            rt.run_step()
            new, reason = rt.read(rid)
            tokens += new
        assert reason == "stop" and tokens == free_run[: free_run.index(stop) + 1]
        check_unknown = pytest.raises(CError, match="request_id")
        with check_unknown:
            rt.read(rid)  # finished and read: forgotten
        assert rt.stats().num_running == 1
        ctypes_abort = rt.lib.trtpaged_request_abort(rt.handle, other)
        assert ctypes_abort == 0
        _, reason = rt.read(other)
        assert reason == "abort" and rt.stats().kv_blocks_used == 0


@pytest.mark.parametrize("capacity", [1, 3, 5, 10])
def test_a_finished_request_read_in_parts_reports_its_reason_with_its_last_token(lib, tiny_engine_dir, capacity):
    """A request read with fewer slots than its unread tokens reports running until the read that returns its last
    token: that read carries the finish reason (a stop token is then the last token read, as runtime.h says) and
    forgets the request. It reported the reason with tokens still held (10 tokens read 3 at a time: ([a, b, c],
    'length')), so embedding.md's loop `while (reason == TRTPAGED_RUNNING)` stopped with the rest unread, kept in
    the handle for good; and where the rest filled the buffer exactly, no read could tell whether more remained."""
    with CRuntime(lib, tiny_engine_dir) as rt:
        (free_run,) = rt.generate([PROMPTS[3]], 10)  # read whole: the truth the parts must add up to
        stops = (ctypes.c_int32 * 1)(free_run[6])
        for sampling, want, reason in [({}, free_run, "length"),
                                       (dict(stop_token_ids=ctypes.cast(stops, ctypes.c_void_p), num_stop_token_ids=1),
                                        free_run[: free_run.index(free_run[6]) + 1], "stop")]:
            rid = rt.add(PROMPTS[3], 10, **sampling)
            while rt.run_step():  # to the end, unread
                pass
            parts = [rt.read(rid, capacity) for _ in range(-(-len(want) // capacity))]
            assert [t for new, _ in parts for t in new] == want
            assert [r for _, r in parts] == ["running"] * (len(parts) - 1) + [reason]
            with pytest.raises(CError, match="request_id"):
                rt.read(rid, capacity)  # its last token read: forgotten


def test_step_api_matches_python_step_model(lib, tiny_engine_dir):
    """Two sequences prefilled in one packed step, then a decode step: logits equal the Python runner's."""
    from trtpaged.runtime.runners import StepBatch, TorchRunner

    runner = TorchRunner.from_engine_dir(tiny_engine_dir, num_kv_blocks=16)
    a, b = PROMPTS[2][:19], PROMPTS[3]
    steps = [
        dict(input_ids=a + b, positions=list(range(19)) + list(range(5)), query_start=[0, 19, 24],
             context_lens=[19, 5], block_tables=[[3, 9], [4, 0]], logits_index=[18, 23]),
        dict(input_ids=[PROMPTS[2][19], 77], positions=[19, 5], query_start=[0, 1, 2], context_lens=[20, 6],
             block_tables=[[3, 9], [4, 0]], logits_index=[0, 1]),
    ]
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=16) as rt:
        for s in steps:
            want = runner.step(StepBatch(**{k: torch.tensor(v, dtype=torch.int32) for k, v in s.items()}))
            got = run_c_step(rt, s)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(1), want.argmax(1))


def run_c_step(rt: CRuntime, s: dict) -> torch.Tensor:
    arrays = {k: i32_array(sum(v, []) if k == "block_tables" else v) for k, v in s.items()}
    inputs = StepInputs(len(s["input_ids"]), len(s["context_lens"]), len(s["block_tables"][0]), len(s["logits_index"]),
                        *[ctypes.cast(arrays[k], ctypes.c_void_p) for k in ("input_ids", "positions", "query_start",
                                                                          "context_lens", "block_tables",
                                                                          "logits_index")])
    logits = torch.empty(len(s["logits_index"]), rt.info.vocab_size)
    status = rt.lib.trtpaged_runtime_step(rt.handle, ctypes.byref(inputs), logits.data_ptr(), logits.numel())
    if status:
        raise CError(status, rt.lib.trtpaged_last_error().decode())
    return logits


def edited_engine(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "trtpaged.json").read_text())
    edit(manifest)
    save_manifest(dst, manifest)
    return dst


@pytest.mark.parametrize("edit, status, named", [
    (lambda m: m.update(format_version=2), "unsupported", "format_version"),
    (lambda m: m["dims"].update(architecture="GPT2LMHeadModel"), "unsupported", "dims.architecture"),
    (lambda m: m.update(backends=["tensorrt"]), "unsupported", "backends"),
    (lambda m: m.update(dtype="float16"), "unsupported", "dtype"),
    (lambda m: m.update(kv_cache_dtype="int4"), "invalid_argument", "kv_cache_dtype"),
    (lambda m: m.update(tensor_parallel=2), "unsupported", "tensor_parallel"),
    (lambda m: m.update(weights_file="../weights.safetensors"), "invalid_argument", "weights_file"),
    (lambda m: m["limits"].update(block_size=12), "invalid_argument", "limits.block_size"),
    (lambda m: m["dims"].update(hidden_size=96), "invalid_argument", "embed_tokens.weight"),
    (lambda m: m.update(quantization={"weights": "int4", "modules": {"lm_head": [3, 32]}}), "invalid_argument",
     "quantization.modules"),
    (lambda m: m.update(surprise=1), "invalid_argument", "surprise: unknown field"),
    # finite and positive as a double, 0 as a float: every angle would be NaN
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "linear", "factor": 1e-300}), "invalid_argument",
     "trtpaged.json: dims.rope_theta / dims.rope_scaling: rope_theta 10000 with factor 1e-300 gives non-finite "
     "rotary frequencies"),  # the file named too
    # finite as a double, inf or 0 as the kernels' float: refused at open, naming the field (was: every step failed)
    (lambda m: m["dims"].update(rms_norm_eps=1e308), "invalid_argument", "dims.rms_norm_eps: got 1e+308"),
    (lambda m: m["dims"].update(rope_theta=1e-308), "invalid_argument", "dims.rope_theta: got 1e-308"),
    (lambda m: m.update(kv_cache={"memory_bytes": 2**50}), "invalid_argument",
     "trtpaged.json: kv_cache.memory_bytes: "),
    # other families' fields, with values no engine has: refused as the Python loader refuses them, naming the field
    (lambda m: m["dims"].update(partial_rotary_factor=0), "invalid_argument",
     "dims.partial_rotary_factor: got 0; expected a number in (0, 1] leaving an even number (>= 2) of head_dim 16"),
    (lambda m: m["dims"].update(partial_rotary_factor=1.5), "invalid_argument", "dims.partial_rotary_factor: got 1.5"),
    (lambda m: m["dims"].update(partial_rotary_factor=0.1875), "invalid_argument",  # 3 of 16 dims: an odd number
     "dims.partial_rotary_factor: got 0.1875"),
    (lambda m: m["dims"].update(hidden_act="relu"), "invalid_argument",
     "dims.hidden_act: got \"relu\"; one of silu, gelu_tanh"),
    (lambda m: m["dims"].update(gemma_norms=True), "invalid_argument",
     "dims.gemma_norms: got true for LlamaForCausalLM; Gemma's norms go with Gemma only"),
    (lambda m: m["dims"].update(attn_logit_softcap=5.0), "invalid_argument",  # a Llama's scores are not capped
     "dims.attn_logit_softcap: got 5.0; expected 0 (none) or, for Gemma"),
    (lambda m: m["dims"].update(architecture="Gemma2ForCausalLM", gemma_norms=True, embed_scale=8.0,
                                attn_logit_softcap=-5.0), "invalid_argument", "dims.attn_logit_softcap: got -5.0"),
    (lambda m: m["dims"].update(architecture="Gemma2ForCausalLM", gemma_norms=True, embed_scale=8.0,
                                final_logit_softcap=1e-50), "invalid_argument",  # 0 as the kernels' float
     "dims.final_logit_softcap: got 1e-50"),
    (lambda m: m["dims"].update(architecture="Gemma2ForCausalLM", gemma_norms=True), "invalid_argument",
     "dims.embed_scale: got 1.0; Gemma2ForCausalLM scales embeddings by 8 (sqrt(hidden_size))"),
    # NaN is not JSON (the Python loader reads Python's NaN literal, and refuses it naming the field)
    (lambda m: m["dims"].update(attn_logit_softcap=float("nan")), "invalid_argument", "trtpaged.json: (file): not "
     "valid JSON"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3}),
     "invalid_argument", "dims.rope_scaling.short_factor: got [1.0,1.0,1.0]; expected 8 finite positive numbers"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 7 + [-1.0]}),
     "invalid_argument", "dims.rope_scaling.short_factor: got [1.0,"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                              "long_factor": [2.0] * 9}),
     "invalid_argument", "dims.rope_scaling.long_factor: got a list of 9 items; expected 8"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                              "original_max_position_embeddings": 0.5}),
     "invalid_argument", "dims.rope_scaling.original_max_position_embeddings: got 0.5; expected a number of positions"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn"}), "invalid_argument",
     "dims.rope_scaling.factor: missing"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": None}),
     "invalid_argument", "dims.rope_scaling.truncate: got null; expected true or false"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}),
     "invalid_argument", "dims.rope_scaling.beta_fast: got -32"),
    # cos/sin scaled past float32: were opened, and every logit NaN (as in the Python runtime, which refuses them too)
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e39}),
     "invalid_argument", "dims.rope_scaling.attention_factor: got 1e+39; expected a positive number, finite and not 0"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                              "attention_factor": 1e-50}),
     "invalid_argument", "dims.rope_scaling.attention_factor: got 1e-50"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1e300,
                                              "mscale_all_dim": 1.0}), "invalid_argument",
     "dims.rope_theta / dims.rope_scaling: rope_theta 10000 with factor 4 gives a cos/sin scaling of 1.21751e+299"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e20}),
     "invalid_argument", "gives a cos/sin scaling of 1e+20 (attention_factor, or from factor, mscale and "
                         "mscale_all_dim), not non-zero and at most 1000 in magnitude"),
    # a family field written as null: were read as its default, where the Python reader refuses it
    (lambda m: m["dims"].update(partial_rotary_factor=None), "invalid_argument",
     "dims.partial_rotary_factor: got null; expected a value"),
    (lambda m: m["dims"].update(architecture="Gemma2ForCausalLM", gemma_norms=True, embed_scale=8.0,
                                final_logit_softcap=None), "invalid_argument", "dims.final_logit_softcap: got null"),
    # a null rope_type is rope.py's "None", refused (was: the "type" key read instead)
    (lambda m: m["dims"].update(rope_scaling={"rope_type": None, "type": "yarn", "factor": 4.0}), "unsupported",
     "dims.rope_scaling.rope_type: got null; the C runtime supports"),
    (lambda m: m["dims"].update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "unsupported",
     "dims.rope_scaling.rope_type: got \"dynamic\"; the C runtime supports default, linear, llama3, yarn, longrope"),
    (lambda m: m["dims"].update(nope_layers=[1, 1]), "invalid_argument", "dims.nope_layers: got [1,1]; expected"),
    (lambda m: m["dims"].update(nope_layers=[2]), "invalid_argument", "dims.nope_layers: got [2]; expected"),
    (lambda m: m["dims"].update(qk_norm=1), "invalid_argument", "dims.qk_norm: got 1; expected true or false"),
    (lambda m: m["dims"].update(qk_norm=True), "invalid_argument", "layers.0.self_attn.q_norm.weight"),
    (lambda m: m["dims"].update(layer_windows=[4096]), "invalid_argument",
     "dims.layer_windows: got [4096]; one window"),
    (lambda m: m["dims"].update(layer_windows=[-1, 0]), "invalid_argument", "dims.layer_windows: got [-1,0]"),
])
def test_open_refuses_bad_engine_dirs(lib, tiny_engine_dir, tmp_path, edit, status, named):
    engine = edited_engine(tiny_engine_dir, tmp_path / "engine", edit)
    with pytest.raises(CError) as e:
        CRuntime(lib, engine)
    assert e.value.status == status and named in e.value.message


@pytest.mark.parametrize("quantization, field", [({"group_size": 32}, "quantization.weights"),
                                                   ({"weights": "int2"}, "quantization.weights"),
                                                   ({"weights": "int8", "origin": 5}, "quantization.origin"),
                                                   ({"weights": "int8", "origin": {"g": "7"}}, "quantization.origin"),
                                                   ({"weights": "int4", "group_size": 0}, "quantization.group_size"),
                                                   ({"weights": "int8", "activations": 8}, "quantization.activations")])
def test_a_quantization_summary_the_python_loader_refuses_is_refused(lib, tiny_engine_dir, tmp_path, quantization,
                                                                     field):
    """The manifest's quantization summary is checked as trtpaged/manifest.py checks it (was: opened, the C runtime
    reading only its modules and activations, so a float engine could claim int4 weights)."""
    engine = edited_engine(tiny_engine_dir, tmp_path / "engine", lambda m: m.update(quantization=quantization))
    with pytest.raises(EngineDirError) as python:
        read_manifest(engine)
    assert python.value.field == field
    with pytest.raises(CError) as c:
        CRuntime(lib, engine)
    assert c.value.status == "invalid_argument" and f"trtpaged.json: {field}: got " in c.value.message


@pytest.mark.parametrize("kind", ["fifo", "dangling link", "directory"])
def test_a_manifest_that_is_not_a_regular_file_is_named_so(lib, tiny_engine_dir, tmp_path, kind):
    """A FIFO, a dangling link or a dir in place of trtpaged.json is "not a regular file", as the Python loader says
    (was: "missing; not an engine dir", an IO error); a manifest that is not there is still that."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    manifest = engine / "trtpaged.json"
    manifest.unlink()
    {"fifo": os.mkfifo, "dangling link": lambda p: p.symlink_to(tmp_path / "gone.json"), "directory": Path.mkdir}[kind](
        manifest)
    with pytest.raises(EngineDirError) as python:
        read_manifest(engine)
    assert python.value.field == "(file)" and "is not a regular file" in str(python.value)
    with pytest.raises(CError) as c:
        CRuntime(lib, engine)
    assert (c.value.status, c.value.message) == ("invalid_argument", f"{manifest}: (file): is not a regular file")
    manifest.unlink() if kind != "directory" else manifest.rmdir()
    with pytest.raises(CError) as c:
        CRuntime(lib, engine)
    assert c.value.status == "io" and "(file): missing; not an engine dir" in c.value.message


@pytest.mark.parametrize("where, field", [("dims", "attention_bias"), ("dims", "tie_word_embeddings"),
                                          ("dims", "max_position_embeddings"), ("", "tensor_parallel"),
                                          ("", "weights_file"), ("", "tokenizer_dir"), ("", "shards")])
def test_a_null_the_python_loader_refuses_is_refused_not_read_as_the_default(lib, tiny_engine_dir, tmp_path, where,
                                                                           field):
    """A field with a default but no None in manifest.py (attention_bias: bool = False, ...) written as null is refused
    by the Python loader (strict types); the C runtime read it as left out, so it opened an engine dir Python refuses
    (attention_bias: null ran as no biases, weights_file: null as weights.safetensors)."""
    engine = edited_engine(tiny_engine_dir, tmp_path / "engine",
                           lambda m: (m[where] if where else m).update({field: None}))
    named = f"{where}.{field}" if where else field
    with pytest.raises(EngineDirError) as python:
        read_manifest(engine)
    assert named in str(python.value)
    with pytest.raises(CError) as c:
        CRuntime(lib, engine)
    assert c.value.status == "invalid_argument" and f"trtpaged.json: {named}: got null; expected a value" in \
        c.value.message


def test_a_window_no_sequence_reaches_is_read_as_none(lib, tiny_engine_dir, tmp_path):
    """A stock Mistral config's window (4096) built with a shorter max_seq_len never applies: the C runtime opens it
    and answers as without one; so does a window inside max_seq_len that these short prompts do not reach."""
    manifest = json.loads((tiny_engine_dir / "trtpaged.json").read_text())
    longest, layers = manifest["limits"]["max_seq_len"], manifest["dims"]["num_layers"]
    with CRuntime(lib, tiny_engine_dir) as rt:
        want = rt.generate(PROMPTS[:2], 8)
    for name, windows in (("far", [longest] + [0] * (layers - 1)), ("none", [])):  # [] is none, as Python reads it
        engine = edited_engine(tiny_engine_dir, tmp_path / name, lambda m: m["dims"].update(layer_windows=windows))
        with CRuntime(lib, engine) as rt:
            assert rt.generate(PROMPTS[:2], 8) == want
    engine = edited_engine(tiny_engine_dir, tmp_path / "near", lambda m: m["dims"].update(
        layer_windows=[longest - 1] + [0] * (layers - 1)))
    with CRuntime(lib, engine) as rt:
        assert rt.generate(PROMPTS[:2], 8) == want


W4A8 = {"weights": "int4", "group_size": 32, "activations": "int8"}


@pytest.mark.parametrize("family, quantization", [
    *[(family, None) for family in ("mistral-window", "qwen2-window", "qwen3", "smollm3", "phi3", "phi3-longrope",
                                    "llama-yarn", "gemma2", "gemma3", "gemma3-attn-cap", "gemma3-one-kv-head")],
    *[(family, W4A8) for family in ("qwen3", "smollm3", "phi3-longrope", "gemma2", "gemma3", "gemma3-one-kv-head")],
])
def test_family_engines_match_transformers_and_python(lib, tmp_path, family, quantization):
    """Sliding windows (Mistral's on every layer, Qwen2's on all but the first), Qwen3's q/k norms, SmolLM3's layers
    without RoPE, Phi-3's partial rotary (and LongRoPE), yarn, Gemma 2's and 3's norms, GeGLU, scales, soft-caps and
    local RoPE base, on tiny random configs: the C runtime's greedy tokens, three windows past the prompts, are
    transformers' `generate`'s (float weights), and its prefill logits at every position the Python runner's, whose
    fused form makes the same kernel calls (int8 activations, whose rounding magnifies any last-bit difference,
    included)."""
    from test_families import WINDOW, _config
    from runtime_helpers import hf_greedy
    from trtpaged.builder import build_engine
    from trtpaged.models import load_hf
    from trtpaged.runtime.runners import StepBatch, TorchRunner

    extra = {"quantization": quantization} if quantization else {}
    config = _config(family, dtype="float32", block_size=8, kv_cache={"num_kv_blocks": 64}, backend="torch", **extra)
    engine = tmp_path / family
    build_engine(config, engine, echo=lambda line: None)
    prompts = [[(7 * i + 3) % 250 + 2 for i in range(n)] for n in (5, 2 * WINDOW + 3, 9)]
    with CRuntime(lib, engine) as rt:
        tokens = rt.generate(prompts, 3 * WINDOW)
        prompt = [(13 * i + 7) % 300 + 2 for i in range(40)]
        n = len(prompt)
        step = dict(input_ids=prompt, positions=list(range(n)), query_start=[0, n], context_lens=[n],
                    block_tables=[list(range((n + 7) // 8))], logits_index=list(range(n)))
        got = run_c_step(rt, step)
    runner = TorchRunner.from_engine_dir(engine, num_kv_blocks=16)
    assert runner.execution_plan.startswith("fused"), runner.execution_plan
    expected = runner.step(StepBatch(**{k: torch.tensor(v, dtype=torch.int32) for k, v in step.items()}))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if quantization:
        assert tokens == python_greedy(engine, prompts, 3 * WINDOW)[0]
    else:
        hf = load_hf(config.model)
        assert tokens == [hf_greedy(hf, p, 3 * WINDOW, None) for p in prompts]


@pytest.fixture(scope="module")
def window_engines(tmp_path_factory):
    """Tiny random Mistral (every layer windowed: blocks before the window are reclaimed) and Qwen2 (its first layer
    global: every block kept) engines, block size 8, window 12, with their transformers models."""
    from test_families import _config
    from trtpaged.builder import build_engine
    from trtpaged.models import load_hf

    out = {}
    for family in ("mistral-window", "qwen2-window"):
        config = _config(family, dtype="float32", block_size=8, kv_cache={"num_kv_blocks": 64}, backend="torch")
        engine = tmp_path_factory.mktemp("window") / family
        build_engine(config, engine, echo=lambda line: None)
        out[family] = engine, load_hf(config.model)
    return out


def c_run_staggered(rt: CRuntime, arrivals, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """arrivals: (step, prompt) or (step, prompt, its max_tokens), each added before that step; steps until all
    finish. (Token ids of each request, the pool's used blocks after each step.)"""
    pending, ids, out, live, used = sorted(arrivals, key=lambda a: a[0]), [], {}, set(), []
    while pending or live:
        while pending and pending[0][0] <= len(used):
            arrival = pending.pop(0)
            ids.append(rt.add(arrival[1], arrival[2] if len(arrival) > 2 else max_tokens))
            out[ids[-1]] = []
            live.add(ids[-1])
        assert rt.run_step() > 0, "no progress"
        used.append(rt.stats().kv_blocks_used)
        for rid in sorted(live):
            tokens, reason = rt.read(rid)
            out[rid] += tokens
            if reason != "running":
                live.discard(rid)
    return [out[rid] for rid in ids], used


def python_run_staggered(engine_dir: Path, arrivals, max_tokens: int, **options) -> tuple[list[list[int]], list[int],
                                                                                           dict]:
    """The same through the Python runtime's LLMEngine: tokens, used blocks after each step, its stats."""
    engine = LLM(engine_dir, device="cpu", backend="torch", **options).engine
    pending, ids, done, used = sorted(arrivals, key=lambda a: a[0]), [], {}, []
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= len(used):
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival[2] if len(arrival) > 2 else max_tokens, temperature=0.0,
                                    ignore_eos=True)
            ids.append(engine.add_request(list(arrival[1]), params))
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        used.append(engine.stats()["kv_blocks_used"])
    return [done[i] for i in ids], used, engine.stats()


@pytest.mark.parametrize("caching", [1, 0])
def test_windowed_engine_reclaims_blocks_and_runs_a_request_longer_than_the_pool(lib, window_engines, caching):
    """Every layer windowed (Mistral): the blocks wholly before a request's window go back to the pool as it advances,
    as in the Python runtime (KVCacheManager.reclaim). A 70-token prompt with 40 outputs (14 blocks of 8) runs on a
    pool of 6 blocks, prefilled 16 tokens a step: the tokens are transformers' generate's, the pool's used blocks
    after every step are the Python runtime's (which reclaims), with no preemption; a pool of 5 refuses it up front,
    as Python does (its window, one chunk, a partial block at each end and the chain parent)."""
    from runtime_helpers import hf_greedy

    engine, hf = window_engines["mistral-window"]
    prompt = [(7 * i + 3) % 250 + 2 for i in range(70)]
    options = dict(num_kv_blocks=6, max_num_tokens=16, max_batch_size=1, enable_prefix_caching=caching)
    want, py_used, py_stats = python_run_staggered(engine, [(0, prompt)], 40, **options)
    with CRuntime(lib, engine, **options) as rt:
        got, used = c_run_staggered(rt, [(0, prompt)], 40)
        st, reclaimed = rt.stats(), rt.counter("kv_blocks_reclaimed")
    assert got == want == [hf_greedy(hf, prompt, 40, None)]
    assert used == py_used and max(used) <= 6 and st.kv_blocks_used == 0 and st.num_preemptions == 0
    assert reclaimed == py_stats["kv_blocks_reclaimed"] >= (70 + 40 - 12) // 8 - 1
    assert py_stats["num_preemptions"] == 0
    with CRuntime(lib, engine, **{**options, "num_kv_blocks": 5}) as rt:
        with pytest.raises(CError, match="more than the whole pool"):
            rt.add(prompt, 40)


def test_windowed_engine_reclaims_around_a_shared_prefix(lib, window_engines):
    """Prefix caching on, two requests sharing a 40-token prefix (5 blocks, longer than the window of 12): the second
    arrives once the first's prompt is computed and finds its blocks, those already reclaimed (free, still cached)
    included. Tokens are transformers', prefix hits, preemptions and used blocks after every step the Python
    runtime's, on a pool smaller than the two requests' contexts (22 blocks)."""
    from runtime_helpers import hf_greedy

    engine, hf = window_engines["mistral-window"]
    shared = [(7 * i + 3) % 250 + 2 for i in range(40)]
    prompts = [shared + [11, 22, 33, 44, 55], shared + [66, 77, 88]]
    arrivals = [(0, prompts[0]), (3, prompts[1])]  # 45 tokens, 16 a step: the first's prompt is computed in 3 steps
    options = dict(num_kv_blocks=10, max_num_tokens=16, max_batch_size=2)
    want, py_used, py_stats = python_run_staggered(engine, arrivals, 40, **options)
    with CRuntime(lib, engine, **options) as rt:
        got, used = c_run_staggered(rt, arrivals, 40)
        st, reclaimed = rt.stats(), rt.counter("kv_blocks_reclaimed")
    assert got == want == [hf_greedy(hf, p, 40, None) for p in prompts]
    assert used == py_used and st.kv_blocks_used == 0
    assert st.prefix_cache_hits_tokens == py_stats["prefix_cache_hits_tokens"] == 40
    assert st.num_preemptions == py_stats["num_preemptions"]
    assert reclaimed == py_stats["kv_blocks_reclaimed"] > 0


def test_windowed_prefix_hits_before_the_window_are_holes_as_in_python(lib, window_engines):
    """A 48-token prompt finished leaves its 6 blocks cached in a 6-block pool; the same 48 tokens + 8 (admitted by
    the window bound) adopts only the hits its first token's window reads (Scheduler::dead_hits, as
    KVCacheManager.dead_hits): was ended 'length' with no token. Tokens are transformers', used blocks after every
    step and prefix hits the Python runtime's, within the pool."""
    from runtime_helpers import hf_greedy

    engine, hf = window_engines["mistral-window"]
    shared = [(7 * i + 3) % 250 + 2 for i in range(48)]
    prompts = [shared, shared + [11, 22, 33, 44, 55, 66, 77, 88]]
    arrivals = [(0, prompts[0], 1), (3, prompts[1], 10)]  # the first finishes in the third step
    options = dict(num_kv_blocks=6, max_num_tokens=16, max_batch_size=2, enable_prefix_caching=1)
    want, py_used, py_stats = python_run_staggered(engine, arrivals, 0, **options)
    with CRuntime(lib, engine, **options) as rt:
        got, used = c_run_staggered(rt, arrivals, 0)
        st = rt.stats()
    assert got == want == [hf_greedy(hf, prompts[0], 1, None), hf_greedy(hf, prompts[1], 10, None)]
    assert used == py_used and max(used) <= 6 and st.kv_blocks_used == 0
    assert st.prefix_cache_hits_tokens == py_stats["prefix_cache_hits_tokens"] == 48


def test_windowed_preempted_request_is_recomputed_in_chunks_as_in_python(lib, window_engines):
    """Two identical 30-token prompts (17 and 25 out) on a 5-block pool, chunks up to 512 tokens: the newer is
    preempted; its recompute (prompt + outputs, 41 tokens) goes in chunks of at most
    max(min(prompt, max_num_tokens), (pool - 2) * block_size - window) tokens in both runtimes (was: one chunk of 6
    blocks, ended 'length' with 11 tokens). Tokens are transformers', used blocks after every step Python's."""
    from runtime_helpers import hf_greedy

    engine, hf = window_engines["mistral-window"]
    prompt = [(7 * i + 3) % 250 + 2 for i in range(30)]
    arrivals = [(0, prompt, 17), (0, prompt, 25)]
    options = dict(num_kv_blocks=5, max_num_tokens=512, max_batch_size=4, enable_prefix_caching=1)
    want, py_used, py_stats = python_run_staggered(engine, arrivals, 0, **options)
    with CRuntime(lib, engine, **options) as rt:
        got, used = c_run_staggered(rt, arrivals, 0)
        st = rt.stats()
    assert got == want == [hf_greedy(hf, prompt, 17, None), hf_greedy(hf, prompt, 25, None)]
    assert used == py_used and max(used) <= 5 and st.kv_blocks_used == 0
    assert st.num_preemptions == py_stats["num_preemptions"] > 0


def test_engine_with_a_global_layer_keeps_every_block(lib, window_engines):
    """Qwen2 with its first layer global: a block is never returned while that layer reads it, so a request holds
    every block of its context until it finishes (the Python runtime's rule too): used blocks after each step are
    those of the whole context, tokens transformers'."""
    from runtime_helpers import hf_greedy

    engine, hf = window_engines["qwen2-window"]
    prompt = [(7 * i + 3) % 250 + 2 for i in range(30)]
    options = dict(num_kv_blocks=16, max_num_tokens=16)
    want, py_used, py_stats = python_run_staggered(engine, [(0, prompt)], 40, **options)
    with CRuntime(lib, engine, **options) as rt:
        got, used = c_run_staggered(rt, [(0, prompt)], 40)
        reclaimed = rt.counter("kv_blocks_reclaimed")
    assert got == want == [hf_greedy(hf, prompt, 40, None)]
    # after step k, min(16 k, 30) prompt tokens computed, then one more each step; the last token is never computed
    computed = [min(16 * (k + 1), 30) if k < 2 else 30 + k - 1 for k in range(len(used))]
    assert used[:-1] == py_used[:-1] == [(n + 7) // 8 for n in computed[:-1]] and used[-1] == py_used[-1] == 0
    assert reclaimed == py_stats["kv_blocks_reclaimed"] == 0


def test_json_nested_past_the_limit_is_refused_not_a_stack_overflow(lib, tiny_engine_dir, tmp_path):
    """A manifest field or a safetensors header nested 100,000 deep is refused in one message: the error message's
    dump of the value recursed once per level and overflowed the stack (SIGSEGV)."""
    deep = "[" * 100_000 + "]" * 100_000
    engine = edited_engine(tiny_engine_dir, tmp_path / "manifest", lambda m: m["dims"].update(num_layers=0))
    path = engine / "trtpaged.json"
    path.write_text(path.read_text().replace('"num_layers": 0', f'"num_layers": {deep}'))
    with pytest.raises(CError, match="trtpaged.json: \\(file\\): JSON nested deeper than 64 levels"):
        CRuntime(lib, engine)
    engine = edited_engine(tiny_engine_dir, tmp_path / "weights", lambda m: None)
    weights = engine / "weights.safetensors"
    data = weights.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    name = next(k for k in header if k != "__metadata__")
    text = json.dumps(header).replace(json.dumps(header[name]["shape"]), deep, 1).encode()
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size:])
    with pytest.raises(CError, match="weights_file: not a valid safetensors file: the header nests deeper than 64"):
        CRuntime(lib, engine)


def test_the_manifest_hash_is_read_for_its_form(lib, tiny_engine_dir, tmp_path):
    """content_sha256 (the build's hash of the manifest's fields) is taken as a field; its value is the Python
    loader's to check, its form is checked here as the files' hashes are."""
    engine = edited_engine(tiny_engine_dir, tmp_path / "engine", lambda m: None)
    with CRuntime(lib, engine) as rt:
        assert rt.info.num_kv_blocks == 256
    path = engine / "trtpaged.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "content_sha256": 12}))
    with pytest.raises(CError, match="trtpaged.json: content_sha256: got 12; expected a sha256 hex digest"):
        CRuntime(lib, engine)


def test_manifest_of_an_older_build_opens_the_same(lib, tiny_engine_dir, tmp_path):
    """kv_cache.num_blocks, the deprecated spelling (trtpaged/names.py), reads as kv_cache.num_kv_blocks."""
    old = edited_engine(tiny_engine_dir, tmp_path / "old",
                        lambda m: m.update(kv_cache={"num_blocks": m["kv_cache"]["num_kv_blocks"]}))
    with CRuntime(lib, tiny_engine_dir) as new_rt, CRuntime(lib, old) as old_rt:
        assert old_rt.info.num_kv_blocks == new_rt.info.num_kv_blocks == 256
    both = edited_engine(tiny_engine_dir, tmp_path / "both",
                         lambda m: m["kv_cache"].update(num_blocks=m["kv_cache"]["num_kv_blocks"]))
    with pytest.raises(CError, match=r"kv_cache\.num_kv_blocks: set twice"):
        CRuntime(lib, both)


def test_open_refuses_unsafe_weights(lib, tiny_engine_dir, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tiny_engine_dir / "weights.safetensors", outside)
    engine = edited_engine(tiny_engine_dir, tmp_path / "link", lambda m: None)
    (engine / "weights.safetensors").unlink()
    (engine / "weights.safetensors").symlink_to(outside)
    with pytest.raises(CError, match="outside the engine dir"):
        CRuntime(lib, engine)
    # the manifest itself a link out of the dir (was: opened, where the Python loader refuses it)
    manifest_link = edited_engine(tiny_engine_dir, tmp_path / "manifest-link", lambda m: None)
    shutil.move(manifest_link / "trtpaged.json", tmp_path / "outside.json")
    (manifest_link / "trtpaged.json").symlink_to(tmp_path / "outside.json")
    with pytest.raises(CError, match=r"trtpaged.json: \(manifest\): resolves to .*outside the engine dir"):
        CRuntime(lib, manifest_link)
    truncated = edited_engine(tiny_engine_dir, tmp_path / "short", lambda m: None)
    data = (truncated / "weights.safetensors").read_bytes()
    (truncated / "weights.safetensors").write_bytes(data[:-100])
    with pytest.raises(CError, match="weights_file: not a valid safetensors file"):
        CRuntime(lib, truncated)
    with pytest.raises(CError, match="engine_dir: .* does not exist") as e:
        CRuntime(lib, tmp_path / "missing")
    assert e.value.status == "io"
    with pytest.raises(CError) as e:
        CRuntime(lib, "")
    assert e.value.message == "engine_dir: empty path"  # was: "'' does not exist (Success)"
    with pytest.raises(CError, match="options.num_kv_blocks, options.kv_bytes: set at most one"):
        CRuntime(lib, tiny_engine_dir, num_kv_blocks=4, kv_bytes=1 << 20)
    with pytest.raises(CError, match="options.max_seq_len: must be in \\[1, 512\\]"):
        CRuntime(lib, tiny_engine_dir, max_seq_len=513)
    with pytest.raises(CError, match="options.backend: 'tensorrt' is not implemented"):
        CRuntime(lib, tiny_engine_dir, backend=b"tensorrt")


def test_the_step_api_is_refused_while_requests_run_and_forgets_the_prefix_cache(lib, tiny_engine_dir):
    """copy_blocks, like step, is refused while a request runs (it would overwrite that request's K/V); and a step
    API write empties the prefix cache, whose blocks it may have overwritten (was: the same prompt, run again,
    hit the cache and read the step's K/V: other tokens)."""
    prompt = SHARED[:40]  # two full blocks, cached once it ran
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=16) as rt:
        first = rt.generate([prompt], 8)[0]
        hits = rt.stats().prefix_cache_hits_tokens
        rid = rt.add(prompt, 8)
        with pytest.raises(CError, match="requests are unfinished"):
            check(lib, lib.trtpaged_runtime_copy_blocks(rt.handle, i32_array([0, 1]), 1))
        while rt.read(rid)[1] == "running":
            rt.run_step()
        hits_again = rt.stats().prefix_cache_hits_tokens
        assert hits_again >= hits + 32  # the second run found the first's two blocks
        for block in range(16):  # the step API writes every block of the pool
            run_c_step(rt, dict(input_ids=[9] * 16, positions=list(range(16)), query_start=[0, 16],
                                context_lens=[16], block_tables=[[block]], logits_index=[15]))  # fmt: skip
        check(lib, lib.trtpaged_runtime_copy_blocks(rt.handle, i32_array([0, 1]), 1))
        assert rt.generate([prompt], 8)[0] == first
        assert rt.stats().prefix_cache_hits_tokens == hits_again  # nothing found: the cache was emptied


def test_two_threads_on_one_handle_are_refused_not_raced(lib, tiny_engine_dir):
    """One thread at a time per handle (documented): a call that overlaps another thread's is refused with a
    message saying so (was: a silent data race on the scheduler and the pool; TSan's SEGV), and the handle goes
    on; the tokens of the requests equal those of a handle used by one thread."""
    import threading

    prompts = [PROMPTS[0], PROMPTS[2]]
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=16) as rt:
        want = rt.generate(prompts, 64)
    refused: list[str] = []
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=16) as rt:
        done = threading.Event()

        def hammer() -> None:  # reads while the other thread steps
            stats = Stats()
            while not done.is_set():
                if lib.trtpaged_runtime_get_stats(rt.handle, ctypes.byref(stats)) != 0:
                    refused.append(lib.trtpaged_last_error().decode())

        def retried(call):  # any of this thread's calls may be the one refused (add, step and read alike)
            while True:
                try:
                    return call()
                except CError as exc:
                    assert "two threads at once" in exc.message

        other = threading.Thread(target=hammer)
        other.start()
        rounds = []
        try:
            # the overlap is a race: the same requests again until one call has met another (once in six runs a
            # single round of these short steps met none)
            while not refused and len(rounds) < 20:
                ids = [retried(lambda p=p: rt.add(p, 64)) for p in prompts]
                while retried(rt.run_step) != 0:
                    pass
                rounds.append({rid: retried(lambda rid=rid: rt.read(rid))[0] for rid in ids})
        finally:
            done.set()
            other.join()
    assert refused and all("called from two threads at once" in m for m in refused), refused[:3]
    assert all(list(got.values()) == want for got in rounds)


def test_a_prompt_longer_than_can_run_is_refused_before_it_is_read(lib, tiny_engine_dir):
    """prompt_len is checked against max_seq_len before the prompt's ids are read (was: 2**20 ids read from a
    4-id buffer); top_k -1 is off, as in vLLM and SamplingParams."""
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=16) as rt:
        rid = ctypes.c_int64()
        status = lib.trtpaged_request_add(rt.handle, i32_array([1, 2, 3, 4]), 2**20, None, ctypes.byref(rid))
        assert status == 1 and lib.trtpaged_last_error().decode().startswith("prompt_len: 1048576 tokens exceed")
        greedy = rt.generate([PROMPTS[1]], 6)[0]
        rid_off = rt.add(PROMPTS[1], 6, top_k=-1)
        tokens: list[int] = []
        while True:
            got, reason = rt.read(rid_off)
            tokens += got
            if reason != "running":
                break
            rt.run_step()
        assert tokens == greedy


def test_a_message_quoting_bytes_that_are_not_utf8_escapes_them(lib, tiny_engine_dir, tmp_path):
    """A corrupt manifest's bytes quoted in the error are written \\xNN: every binding can decode it as UTF-8."""
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine_dir, engine)
    (engine / "trtpaged.json").write_bytes(b'{"format_version": 1, \xff\xfe "dims": caf\xc3\xa9}')
    handle = ctypes.c_void_p()
    assert lib.trtpaged_runtime_open(str(engine).encode(), None, ctypes.byref(handle)) != 0
    message = lib.trtpaged_last_error().decode("utf-8")  # was: UnicodeDecodeError
    assert "\\xff" in message and "trtpaged.json" in message


def test_bad_requests_and_steps_name_the_argument(lib, tiny_engine_dir):
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=4) as rt:
        with pytest.raises(CError, match=r"prompt_len: 512 tokens reach max_seq_len \(512\)"):
            rt.add([1] * 512)
        with pytest.raises(CError, match=r"prompt_len: 65 tokens need 5 KV blocks, more than the whole pool"):
            rt.add([1] * 65)
        with pytest.raises(CError, match=r"prompt\[1\]: token id 320 is outside the vocabulary \[0, 320\)"):
            rt.add([1, 320])
        with pytest.raises(CError, match=r"sampling.max_tokens: got 600"):
            rt.add([1, 2], 600)
        with pytest.raises(CError, match="sampling.top_p"):
            rt.add([1, 2], 4, temperature=1.0, top_p=0.0)
        # a flag is 0 or 1: another value is a mistake (an uninitialised field), not "true"
        with pytest.raises(CError, match=r"sampling.has_seed: got 2; expected 0 or 1"):
            rt.add([1, 2], 4, has_seed=2)
        with pytest.raises(CError, match=r"sampling.ignore_eos: got -1; expected 0 or 1"):
            rt.add([1, 2], 4, ignore_eos=-1)
        with pytest.raises(CError, match=r"options.enable_prefix_caching: got 7; expected 0 or 1"):
            CRuntime(lib, tiny_engine_dir, num_kv_blocks=4, enable_prefix_caching=7)
        lib_ = rt.lib
        rid = ctypes.c_int64()
        assert lib_.trtpaged_request_add(rt.handle, None, 3, None, ctypes.byref(rid)) == 1
        assert lib_.trtpaged_last_error() == b"prompt: null pointer"
        assert lib_.trtpaged_request_add(rt.handle, i32_array([1]), 1, None, None) == 1
        assert lib_.trtpaged_last_error() == b"request_id: null pointer"
        assert lib_.trtpaged_request_add(None, i32_array([1]), 1, None, ctypes.byref(rid)) == 1
        assert lib_.trtpaged_last_error() == b"runtime: null pointer"
        assert lib_.trtpaged_runtime_open(b".", None, None) == 1 and lib_.trtpaged_last_error() == b"out: null pointer"
        good = dict(input_ids=[1, 2], positions=[0, 1], query_start=[0, 2], context_lens=[2], block_tables=[[0]],
                    logits_index=[1])
        for key, value, named in [("block_tables", [[4]], r"inputs.block_tables\[0\]\[0\]: block 4 is outside"),
                                  ("input_ids", [1, -3], r"inputs.input_ids\[1\]: token id -3"),
                                  ("positions", [0, 2], r"inputs.positions\[1\]: got 2"),
                                  ("logits_index", [2], r"inputs.logits_index\[0\]: got 2")]:
            with pytest.raises(CError, match=named):
                run_c_step(rt, {**good, key: value})
        # query_start is checked whole before positions are read through it (was: read past positions' end)
        with pytest.raises(CError, match=r"inputs.query_start\[2\]: decreases"):
            run_c_step(rt, dict(input_ids=[1, 2], positions=[0, 1], query_start=[0, 100, 2], context_lens=[2, 2],
                                block_tables=[[0], [1]], logits_index=[1]))
        run_c_step(rt, good)
        rt.add([1, 2, 3], 2)  # in flight: the step API would share its pool
        with pytest.raises(CError, match="runtime: 1 requests are unfinished"):
            run_c_step(rt, good)
        assert lib_.trtpaged_runtime_close(None) is None


@pytest.mark.parametrize("stop_token_ids", [[5, 320], [-1], [2**31 - 1]])
def test_stop_token_ids_outside_the_vocabulary_are_refused_as_python_refuses_them(lib, tiny_engine_dir,
                                                                                   stop_token_ids):
    """A stop token id outside the vocabulary (which no step can sample) is refused naming it, as the Python engine
    refuses it (was: accepted, and the request ran to max_tokens)."""
    llm = LLM(tiny_engine_dir, device="cpu", backend="torch")
    with pytest.raises(ValueError) as python:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=stop_token_ids))
    bad = next(t for t in stop_token_ids if not 0 <= t < 320)
    assert f"token id {bad} is outside the vocabulary [0, 320)" in str(python.value)
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=4) as rt:
        ids = i32_array(stop_token_ids)
        with pytest.raises(CError) as c:
            rt.add([1, 2, 3], 2, stop_token_ids=ctypes.cast(ids, ctypes.c_void_p), num_stop_token_ids=len(ids))
        index = stop_token_ids.index(bad)
        assert c.value.message == (f"sampling.stop_token_ids[{index}]: token id {bad} is outside the vocabulary "
                                   f"[0, {rt.info.vocab_size})")
        assert rt.stats().kv_blocks_free == 4 and rt.stats().num_waiting == 0
        rt.add([1, 2, 3], 2, stop_token_ids=ctypes.cast(i32_array([319]), ctypes.c_void_p), num_stop_token_ids=1)


def test_two_sequences_writing_one_kv_slot_in_a_step_are_refused(lib, tiny_engine_dir):
    """Two sequences of a step writing one KV slot are refused naming the token and the slot (was: run, the kernels
    writing each sequence's K/V on its own thread: a data race); a block one sequence writes and another reads in
    the same step runs, and gives the logits of the same tokens as one sequence."""
    tokens = [(7 * i + 3) % 300 for i in range(17)]
    with CRuntime(lib, tiny_engine_dir, num_kv_blocks=4) as rt:
        with pytest.raises(CError) as c:
            run_c_step(rt, dict(input_ids=[5, 6, 7], positions=[0, 1, 1], query_start=[0, 2, 3], context_lens=[2, 2],
                                block_tables=[[0], [0]], logits_index=[1, 2]))
        assert c.value.message.startswith("inputs.positions[2]: sequence 1 writes block 0 offset 1, as sequence 0 "
                                          "(token 1) does in this step")
        alone = run_c_step(rt, dict(input_ids=tokens, positions=list(range(17)), query_start=[0, 17],
                                    context_lens=[17], block_tables=[[2, 3]], logits_index=[16]))
        shared = run_c_step(rt, dict(input_ids=tokens, positions=list(range(17)), query_start=[0, 16, 17],
                                     context_lens=[16, 17], block_tables=[[0, 0], [0, 1]], logits_index=[16]))
        torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)


# Steps through a positions array that ends where an unmapped page begins: reading one element past it is a
# SIGSEGV, so this fails on a runtime that reads positions through query_start before checking it (what an
# ordinary allocation only shows under AddressSanitizer). A process of its own, so that the crash is not pytest's.
GUARDED_STEP = """
import ctypes, mmap, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from c_runtime import CError, CRuntime, StepInputs, i32_array, load
lib = load(Path(sys.argv[2]))
page = mmap.PAGESIZE
pages = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(pages))
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
positions = (ctypes.c_int32 * 2).from_address(base + page - 8)
positions[0], positions[1] = 0, 1
arrays = {k: i32_array(v) for k, v in dict(input_ids=[1, 2], query_start=[0, 100, 2], context_lens=[2, 2],
                                           block_tables=[0, 1], logits_index=[1]).items()}
ptr = lambda a: ctypes.cast(a, ctypes.c_void_p)
inputs = StepInputs(2, 2, 1, 1, ptr(arrays["input_ids"]), base + page - 8, ptr(arrays["query_start"]),
                    ptr(arrays["context_lens"]), ptr(arrays["block_tables"]), ptr(arrays["logits_index"]))
logits = (ctypes.c_float * 320)()
with CRuntime(lib, Path(sys.argv[3]), num_kv_blocks=4) as rt:
    status = lib.trtpaged_runtime_step(rt.handle, ctypes.byref(inputs), ctypes.cast(logits, ctypes.c_void_p), 320)
    print(status, lib.trtpaged_last_error().decode())
"""


def test_query_start_is_checked_before_positions_are_read_through_it(build_dir, tiny_engine_dir):
    run = subprocess.run([sys.executable, "-c", GUARDED_STEP, str(REPO / "tests"), str(build_dir),
                          str(tiny_engine_dir)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert run.stdout.startswith("1 inputs.query_start[2]: decreases"), run.stdout


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "abc", "1,2"], "--max-tokens: 'abc' is not an integer in [-2147483648, 2147483647]"),
    (["--max-tokens", "99999999999", "1,2"], "--max-tokens: '99999999999' is not an integer in [-2147483648, "
                                             "2147483647]"),
    (["--num-kv-blocks", "1e3", "1,2"], "--num-kv-blocks: '1e3' is not an integer in [-9223372036854775808, "
                                        "9223372036854775807]"),
    (["--max-batch-size", "0x10", "1,2"], "--max-batch-size: '0x10' is not an integer in [-2147483648, 2147483647]"),
    (["1,99999999999"], "PROMPT '1,99999999999': '99999999999' is not a token id (comma-separated integers in "
                        "[0, 2147483647])"),
    (["--max-token", "4", "1,2"], "unknown option '--max-token'"),
])
def test_the_example_refuses_arguments_that_are_not_what_they_name(build_dir, tiny_engine_dir, args, message):
    """An option value or a token id that is not an integer in its type's range is refused naming it, exit 2 (was:
    atol and an int32 cast: "abc" ran as 0, "1e3" as 1, "0x10" as 0 (the engine's limit), 99999999999 as the
    token id 1215752191; a misspelt option was read as a PROMPT)."""
    run = generate(build_dir, tiny_engine_dir, [], *args)
    assert (run.returncode, run.stderr, run.stdout) == (2, f"error: {message}\n", "")


def test_smoke_script(build_dir, tiny_engine_dir):
    """examples/cpp/smoke_test.sh: the Python-free check of a built example."""
    run = subprocess.run(["bash", str(REPO / "examples" / "cpp" / "smoke_test.sh"), str(build_dir),
                          str(tiny_engine_dir)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "smoke test passed" in run.stdout


@pytest.mark.slow
def test_example_matches_python_smollm2_int4(build_dir, lib, smollm2_int4_engine_dir):
    engine = smollm2_int4_engine_dir
    llm_tokenizer = LLM(engine, device="cpu", backend="torch", num_kv_blocks=16).tokenizer
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived an old "
             "fisherman who", "def fibonacci(n):", "Water boils at"]
    prompts = [llm_tokenizer.encode(t) for t in texts]
    prompts.insert(2, prompts[1][:-2] + llm_tokenizer.encode(" a young girl"))  # shares the fisherman's prefix
    assert example_alone(build_dir, engine, prompts[:2], 12) == python_alone(engine, prompts[:2], 12)
    # 16 tokens each in a pool of 4 blocks: two requests are preempted (and recomputed) along the way
    small = {"num_kv_blocks": 4, "max_num_tokens": 24, "max_batch_size": 8}
    want, py_stats = python_greedy(engine, prompts, 16, **small)
    run = generate(build_dir, engine, prompts, "--max-tokens", "16", "--ignore-eos", "--stats",
                   *[arg for k, v in small.items() for arg in (f"--{k.replace('_', '-')}", str(v))])
    assert run.returncode == 0, run.stderr
    tokens, _, stats = parse_outputs(run.stdout)
    assert [tokens[i] for i in range(len(prompts))] == want
    assert stats["preemptions"] == py_stats["num_preemptions"] >= 1 and stats["prefix_hits_tokens"] >= 16
    with CRuntime(lib, engine, **small) as rt:
        assert rt.info.quantized == 1 and rt.info.one_call_layers == 1
        assert rt.generate(prompts, 16) == want


@pytest.mark.slow
def test_asan_build_has_no_leak_or_invalid_access(build_dir, tiny_engine_dir):
    """The runtime and example built with AddressSanitizer (LeakSanitizer included: it sees the whole process)
    over the smoke script: a batch with a shared prefix and a preemption, repeated runs and the refused inputs."""
    build(build_dir, "trtpaged_runtime_asan", "trtpaged_generate_asan")
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0:exitcode=99"}
    run = subprocess.run(["bash", str(REPO / "examples" / "cpp" / "smoke_test.sh"), str(build_dir),
                          str(tiny_engine_dir), "trtpaged_generate_asan"], capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0 and "smoke test passed" in run.stdout, run.stdout + run.stderr
    assert "AddressSanitizer" not in run.stderr and "LeakSanitizer" not in run.stderr


def test_runtime_library_exports_only_its_c_api(build_dir):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(build_dir / "libtrtpaged_runtime.so")], capture_output=True,
                         text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {"trtpaged_runtime_open", "trtpaged_request_add", "trtpaged_runtime_step"} <= names
    assert all(name.startswith("trtpaged_") for name in names), names


def test_sampling_is_seeded_per_request(lib, tiny_engine_dir):
    """top_k 1 is greedy whatever the temperature; a seeded request draws the same tokens alone and batched with
    others (its own generator), and another seed draws other tokens."""
    with CRuntime(lib, tiny_engine_dir) as rt:
        (greedy,) = rt.generate([PROMPTS[2]], 16)
        rid = rt.add(PROMPTS[2], 16, temperature=1.5, top_k=1)
        while rt.run_step():
            pass
        assert rt.read(rid) == (greedy, "length")
        seeded = dict(temperature=1.0, top_p=0.95, has_seed=1, seed=1234)
        alone = rt.add(PROMPTS[3], 16, **seeded)
        while rt.run_step():
            pass
        first, _ = rt.read(alone)
        batched = [rt.add(PROMPTS[0], 16, temperature=1.0), rt.add(PROMPTS[3], 16, **seeded),
                   rt.add(PROMPTS[3], 16, **{**seeded, "seed": 99})]
        while rt.run_step():
            pass
        _, again, other = [rt.read(r)[0] for r in batched]
        assert again == first and other != first


def test_int8_activation_engine_matches_the_python_runner(lib, tmp_path):
    """A w4a8 engine (int8 activations, whose rounding magnifies any last-bit difference): the C runtime's prefill
    logits at every 7th of 200 positions equal the Python runner's. (The rotary tables both take are checked
    exactly in test_step_model.py: torch's float32 cos/sin there put the SmolLM2 w4a8 engine's log-probs 0.13-0.49
    apart, a gap this tiny model does not show.)"""
    import yaml

    from conftest import EXAMPLES, build_from_dict
    from trtpaged.runtime.runners import StepBatch, TorchRunner

    config = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    config.pop("output")
    quant = {"weights": "int4", "group_size": 32, "activations": "int8"}
    engine = build_from_dict({**config, "quantization": quant}, tmp_path / "tiny-w4a8")
    runner = TorchRunner.from_engine_dir(engine, num_kv_blocks=16)
    prompt = [(13 * i + 7) % 310 + 3 for i in range(200)]
    step = dict(input_ids=prompt, positions=list(range(200)), query_start=[0, 200], context_lens=[200],
                block_tables=[list(range(13))], logits_index=list(range(0, 200, 7)))
    want = runner.step(StepBatch(**{k: torch.tensor(v, dtype=torch.int32) for k, v in step.items()}))
    with CRuntime(lib, engine, num_kv_blocks=16) as rt:
        got = run_c_step(rt, step)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_int8_kv_cache_matches_python(build_dir, tmp_path):
    """A quantized KV pool (int8 rows with their fp16 scales inside the blocks): the same tokens as Python."""
    import yaml

    from conftest import EXAMPLES, build_from_dict

    config = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    config.pop("output")
    engine = build_from_dict({**config, "kv_cache_dtype": "int8"}, tmp_path / "tiny-int8kv")
    want, _ = python_greedy(engine, PROMPTS, 12, **BATCH)
    got, stats = example_batch(build_dir, engine, PROMPTS, 12)
    assert got == want and stats["preemptions"] >= 1
