"""A model's recommended sampling settings (its generation_config.json), as vLLM's `--generation-config auto` uses
them: the build records them (`sampling_defaults`), `LLM.get_default_sampling_params()` and a request that sets
no such field sample with them, every request's max_tokens is capped at max_new_tokens, `generation_config="vllm"`
ignores them. The truth is the file written here and the Python API given those settings explicitly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from c_runtime import build, generate, parse_outputs, setup_build_dir
from conftest import build_from_dict, save_manifest
from runtime_helpers import openai_client
from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.config import parse_config
from trtpaged.manifest import MANIFEST_NAME, EngineDirError, read_manifest
from trtpaged.server import start_server

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.3,
               "max_new_tokens": 9}  # fmt: skip
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.3, "max_tokens": 9}
MODEL = "tiny"


def _hf_dir(root: Path, generation_config: dict) -> Path:
    from trtpaged.models import load_hf

    hf = load_hf(parse_config({"model": {"tiny": {"num_hidden_layers": 1}}}).model)
    hf.model.save_pretrained(root / "hf")
    hf.tokenizer.save_pretrained(root / "hf")
    config = json.loads((root / "hf" / "generation_config.json").read_text())
    (root / "hf" / "generation_config.json").write_text(json.dumps({**config, **generation_config}))
    return root / "hf"


def _data(hf: Path) -> dict:
    return {**TINY, "model": {"hf_dir": str(hf)}, "output": None}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("genconfig")
    return build_from_dict(_data(_hf_dir(root, RECOMMENDED)), root / "engine")


def test_the_build_records_the_fields_the_generation_config_sets(engine_dir):
    assert read_manifest(engine_dir).sampling_defaults == DEFAULTS
    llm = LLM(engine_dir, device="cpu")
    got = llm.get_default_sampling_params()
    assert {k: getattr(got, k) for k in DEFAULTS} == DEFAULTS
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)  # no SamplingParams: the model's, max_tokens 9 among them
    assert len(out.outputs[0].token_ids) <= 9
    plain = LLM(engine_dir, device="cpu", generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()
    with pytest.raises(ValueError, match="generation_config: 'auto'"):
        LLM(engine_dir, device="cpu", generation_config="/some/folder")


def test_inspect_shows_them(engine_dir):
    r = CliRunner().invoke(main, ["inspect", str(engine_dir)])
    assert r.exit_code == 0, r.output
    assert ("sampling_defaults (the model's generation config): max_tokens 9, repetition_penalty 1.3, temperature "
            "0.6, top_k 7, top_p 0.9") in r.output


def test_a_model_without_recommendations_records_none(tiny_engine_dir):
    assert read_manifest(tiny_engine_dir).sampling_defaults == {}
    assert "sampling_defaults" not in json.loads((tiny_engine_dir / MANIFEST_NAME).read_text())


def _completion(client, **kw):
    r = client.completions.create(model=MODEL, prompt="once upon", **kw)
    return r.choices[0].text, r.usage.completion_tokens


@pytest.mark.parametrize("generation_config", ["auto", "vllm"])
def test_requests_sample_with_the_models_settings_where_they_set_none(engine_dir, generation_config):
    """auto: an unset temperature, top_p, top_k and repetition_penalty are the model's, max_tokens (given or not)
    at most its 9; a request's own value wins. vllm: the API's defaults. Seeded answers equal the Python API's
    with those settings written out."""
    llm = LLM(engine_dir, device="cpu")
    model = DEFAULTS if generation_config == "auto" else {"max_tokens": 40}
    handle = start_server(engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          generation_config=generation_config)  # fmt: skip
    try:
        client = openai_client(handle.url)
        ids = llm.tokenizer.encode("once upon")

        def truth(**params) -> str:
            (out,) = llm.generate([ids], SamplingParams(**params), use_tqdm=False)
            return out.outputs[0].text

        text, n = _completion(client, max_tokens=40, seed=11, extra_body={"ignore_eos": True})
        assert n == model["max_tokens"]
        assert text == truth(**{**model, "seed": 11, "ignore_eos": True})
        text, n = _completion(client, max_tokens=40, seed=11, temperature=0.0, extra_body={"ignore_eos": True})
        assert text == truth(**{**model, "temperature": 0.0, "seed": 11, "ignore_eos": True})
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=3,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        if generation_config == "auto":
            assert chat.usage.completion_tokens == 9
        beams = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, n=2,
                                          extra_body={"use_beam_search": True})  # fmt: skip
        assert len(beams.choices) == 2  # a beam search takes none of the sampling settings (top_p is refused there)
    finally:
        handle.shutdown(timeout=0)


def test_a_generation_config_no_request_could_take_refuses_the_build(tmp_path):
    hf = _hf_dir(tmp_path, {"temperature": -1.0})
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_data(hf)))
    r = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert "generation_config.json: temperature: got -1.0; expected in [0, 3.4e38]" in r.output.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("defaults, field", [
    ({"temperature": "hot"}, "sampling_defaults.temperature"),
    ({"top_p": 0.0}, "sampling_defaults.top_p"),
    ({"top_k": 2.5}, "sampling_defaults.top_k"),
    ({"repetition_penalty": float("nan")}, "sampling_defaults.repetition_penalty"),
    ({"max_tokens": 0}, "sampling_defaults.max_tokens"),
    ({"seed": 1}, "sampling_defaults.seed"),
])  # fmt: skip
def test_an_edited_manifests_defaults_are_refused_naming_the_field(engine_dir, tmp_path, defaults, field):
    edited = tmp_path / "engine"
    shutil.copytree(engine_dir, edited)
    data = json.loads((edited / MANIFEST_NAME).read_text())
    data.pop("content_sha256")
    save_manifest(edited, {**data, "sampling_defaults": defaults})
    with pytest.raises(EngineDirError) as info:
        read_manifest(edited)
    assert info.value.field == field


def test_the_c_runtime_opens_an_engine_with_sampling_defaults(engine_dir):
    """The C runtime takes the caller's settings: its greedy tokens are the Python API's with temperature 0."""
    build_dir = build(setup_build_dir() or Path(__file__).resolve().parents[1] / "build" / "tests" / "c-runtime")
    prompts = [[5, 6, 7, 8], [9, 10]]
    run = generate(build_dir, engine_dir, prompts, "--max-tokens", "6", "--ignore-eos")
    llm = LLM(engine_dir, device="cpu")
    want = [list(o.outputs[0].token_ids) for o in llm.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)]  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = parse_outputs(run.stdout)[0]
    assert [got[i] for i in range(len(prompts))] == want
