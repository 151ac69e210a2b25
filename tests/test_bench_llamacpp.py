"""`bench throughput --llamacpp`: llama.cpp's row on the same requests, and its refusals.

The real row needs llama-cpp-cffi, installed outside the project's environment (trtpaged.bench.llamacpp.INSTALL):
TRTPAGED_LLAMACPP_PATH names its directory and, on a libstdc++ older than GCC 14's, TRTPAGED_LLAMACPP_PRELOAD the
`__cxa_call_terminate` stand-in; without them those tests are skipped, saying why. The refusals always run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from trtpaged.bench.llamacpp import INSTALL, PATH_ENV, PRELOAD_ENV, Library, LlamaCppError, generate, in_child, probe
from trtpaged.cli import main

TRACE = '{"prompt_len": 20, "output_len": 8}\n{"prompt_len": 33, "output_len": 7}\n'
TEXTS = ["The capital of France is", "Once upon a time, in a small village,", "The three primary colors are"]


def _tiny_gguf(path, tokens: int = 320):
    """A GGUF with a vocabulary of `tokens` (the tiny engine's is 320) and no tensors: enough for the checks made
    before anything loads."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _throughput(engine, *args: str, env: dict | None = None):
    return CliRunner().invoke(main, ["bench", "throughput", str(engine), "--baseline", "none", *args], env=env)


def _refused(result, *parts: str) -> None:
    assert result.exit_code == 1 and isinstance(result.exception, (SystemExit, type(None))), result.output
    assert "Traceback" not in result.output and all(p in result.output for p in parts), result.output


def test_not_installed_says_how_to_install_it_and_which_option_finds_it(tiny_engine_dir, tmp_path) -> None:
    gguf = _tiny_gguf(tmp_path / "tiny.gguf")
    _refused(_throughput(tiny_engine_dir, "--llamacpp", str(gguf), "--llamacpp-path", str(tmp_path)),
             f"--llamacpp: llama-cpp-cffi is not installed in {tmp_path} (--llamacpp-path / {PATH_ENV})", INSTALL)
    # found by the environment variable as well
    _refused(_throughput(tiny_engine_dir, "--llamacpp", str(gguf), env={PATH_ENV: str(tmp_path)}),
             f"is not installed in {tmp_path}", INSTALL)


def test_a_build_that_does_not_load_is_named_with_the_preload_option(tiny_engine_dir, tmp_path) -> None:
    """A `_llama_cpp_cpu` module that is no shared library: the load fails in llama.cpp's own process, and the
    refusal names the file; a --llamacpp-preload that is no library is named too."""
    import importlib.machinery

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "__init__.py").write_text("raise SystemExit('the package is never imported')\n")
    (tmp_path / "llama" / f"_llama_cpp_cpu{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"not ELF")
    gguf = str(_tiny_gguf(tmp_path / "tiny.gguf"))
    _refused(_throughput(tiny_engine_dir, "--llamacpp", gguf, "--llamacpp-path", str(tmp_path)),
             "--llamacpp: ", "_llama_cpp_cpu", "does not load")
    not_a_library = tmp_path / "shim.so"
    not_a_library.write_text("text")
    _refused(_throughput(tiny_engine_dir, "--llamacpp", gguf, "--llamacpp-path", str(tmp_path), "--llamacpp-preload",
                         str(not_a_library)), f"--llamacpp-preload ({PRELOAD_ENV}): ")  # fmt: skip


def test_a_gguf_that_cannot_be_read_or_is_another_model_is_refused_naming_the_option(tiny_engine_dir,
                                                                                     tmp_path) -> None:  # fmt: skip
    text = tmp_path / "notes.txt"
    text.write_text("not a GGUF\n")
    _refused(_throughput(tiny_engine_dir, "--llamacpp", str(text)),
             f"--llamacpp: {text} is not a readable GGUF file: no GGUF magic")
    _refused(_throughput(tiny_engine_dir, "--llamacpp", str(tmp_path / "missing.gguf")),
             "--llamacpp: ", "missing.gguf is not a readable GGUF file", "No such file")
    other = _tiny_gguf(tmp_path / "other.gguf", tokens=300)
    _refused(_throughput(tiny_engine_dir, "--llamacpp", str(other)),
             "has a vocabulary of 300 tokens, the engine 320", "give a GGUF of the engine's model")
    # alone: the engine's own GGUF, which a random-weight engine does not have
    _refused(_throughput(tiny_engine_dir, "--llamacpp"), "--llamacpp: the engine was not built from a GGUF")
    _refused(_throughput(tiny_engine_dir, "--llamacpp="), "--llamacpp: an empty path")


def test_where_to_find_the_library_is_refused_without_the_row(tiny_engine_dir, tmp_path) -> None:
    """--llamacpp-path alone would change nothing: refused on the command line (its environment variable, which a
    shell may set for every run, is not)."""
    _refused(_throughput(tiny_engine_dir, "--llamacpp-path", str(tmp_path)), "--llamacpp-path: ", "--llamacpp [GGUF]")


def test_the_llamacpp_ratio_is_refused_a_verdict_in_a_noisy_run() -> None:
    from trtpaged.bench.noise import assess
    from trtpaged.bench.throughput_bench import SystemResult, format_throughput_report

    rows = [asdict(SystemResult(name, tok_s, 1.0, 1.0, 0, 0, 0, 0, 1.0, 1, 1)) for name, tok_s in
            (("trtpaged", 30.0), ("llama.cpp", 12.0))]  # fmt: skip
    report = {"requests": 1, "prompt_tokens": 1, "output_tokens": 1, "systems": rows, "ratio_vs_baseline": None,
              "ratio_vs_llamacpp": 2.5}  # fmt: skip
    quiet = format_throughput_report({**report, "noise": assess(0.01, 0.0, 2).to_dict()})
    assert "trtpaged / llama.cpp useful tok/s: 2.50x\n" in quiet + "\n"
    noisy = format_throughput_report({**report, "noise": assess(0.3, 0.0, 2).to_dict()})
    assert "trtpaged / llama.cpp useful tok/s: 2.50x (noisy run: indicative only" in noisy


# ---- the real row ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def library() -> Library:
    library = Library(os.environ.get(PATH_ENV) or None, os.environ.get(PRELOAD_ENV) or None)
    try:
        library.module_file()
        in_child(probe, library)
    except LlamaCppError as exc:
        pytest.skip(f"llama-cpp-cffi is not available ({exc}); set {PATH_ENV} (and {PRELOAD_ENV}) to run these")
    return library


@pytest.mark.slow
def test_the_llamacpp_row_runs_the_requests_side_by_side(library, smollm2_int4_engine_dir, tmp_path) -> None:
    """The row's tokens are the trace's (useful: its output_len; computed: each prompt once and each output token
    but the last), in the same table with its instruction sets, its rounds and the ratio."""
    from trtpaged.bench.throughput_bench import format_throughput_report

    trace = tmp_path / "t.jsonl"
    trace.write_text(TRACE)
    env = {PATH_ENV: library.path or "", PRELOAD_ENV: library.preload or ""}
    result = _throughput(smollm2_int4_engine_dir, "--trace", str(trace), "--llamacpp", "--rounds", "2", "--json",
                         env=env)  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index('{\n  "engine"'):])
    trtpaged, llama = report["systems"]
    lines = [json.loads(line) for line in TRACE.splitlines()]
    assert llama["name"] == "llama.cpp" and not llama["timed_out"]
    assert llama["useful_tokens"] == trtpaged["useful_tokens"] == sum(r["output_len"] for r in lines)
    assert llama["computed_tokens"] == sum(r["prompt_len"] + r["output_len"] - 1 for r in lines)
    assert len(llama["round_walls"]) == 2 and llama["peak_rss_mb"] > 0
    assert llama["isa"].startswith("llama-cpp-cffi ")
    assert report["ratio_vs_llamacpp"] == pytest.approx(trtpaged["useful_tok_s"] / llama["useful_tok_s"])
    text = format_throughput_report(report)
    assert f"\n  llama.cpp: {llama['isa']}\n" in text and "\ntrtpaged / llama.cpp useful tok/s: " in text
    assert "llama.cpp: rounds on fresh prompts of the same shapes, wall s " in text


@pytest.mark.slow
def test_llamacpps_greedy_tokens_against_the_int4_engines(library, smollm2_int4_engine_dir) -> None:
    """The same GGUF weights (the int4 engine carries its Q4_1 blocks exactly) but other arithmetic: llama.cpp
    rounds the activations to 8 bits (Q8_1) where the engine keeps them float. So the greedy tokens agree until a
    near tie: where they first differ, llama.cpp's token is the engine's runner-up within 0.5 nats (measured: 0.02
    to 0.22). Each request yields exactly its output_len tokens."""
    from trtpaged import LLM, SamplingParams
    from trtpaged.bench.llamacpp import default_threads, engine_gguf
    from trtpaged.bench.throughput_bench import Request

    llm = LLM(str(smollm2_int4_engine_dir))
    requests = [Request(tuple(llm.get_tokenizer().encode(t)), 12) for t in TEXTS]
    theirs = in_child(generate, engine_gguf(llm.manifest), requests, library, default_threads())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    agreed = []
    for tokens, out in zip(theirs, llm.generate([list(r.prompt_ids) for r in requests], params, use_tqdm=False)):
        ours = list(out.outputs[0].token_ids)
        assert len(tokens) == len(ours) == 12
        first = next((i for i, (a, b) in enumerate(zip(tokens, ours)) if a != b), None)
        agreed.append(12 if first is None else first)
        if first is not None:
            top = out.outputs[0].logprobs[first]
            assert tokens[first] in top and top[ours[first]].logprob - top[tokens[first]].logprob < 0.5, (first, top)
    print(f"greedy tokens agreeing before the first near tie, of 12: {agreed}")
