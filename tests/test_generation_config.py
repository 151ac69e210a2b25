"""A model's recommended sampling settings (its generation_config.json), as vLLM's `--generation-config auto` uses
them: the build records them (`sampling_defaults`), `LLM.get_default_sampling_params()` and a request that sets
no such field sample with them, every request's max_tokens is capped at max_new_tokens, `generation_config="vllm"`
ignores them. The truth is the file written here and the Python API given those settings explicitly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
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


@pytest.mark.parametrize("generation_config, words", [
    ({"temperature": -1.0}, "generation_config.json: temperature: got -1.0; expected in [0, 3.4e38]"),
    ({"top_p": 10**400}, "generation_config.json: top_p: got 10000000000"),  # was an OverflowError traceback
])  # fmt: skip
def test_a_generation_config_no_request_could_take_refuses_the_build(tmp_path, generation_config, words):
    hf = _hf_dir(tmp_path, generation_config)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(_data(hf)))
    r = CliRunner().invoke(main, ["build", str(path), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert words in last and len(last) < 400, last
    assert not (tmp_path / "out").exists()


def test_what_vllm_would_not_take_is_not_recorded(tmp_path):
    """Without generation_config.json, config.json's legacy sampling keys are not the model's recommendation
    (vLLM takes none); a max_new_tokens past any engine's length is recorded as the bound, not refused."""
    from trtpaged.sampling_defaults import MAX_TOKENS_BOUND

    hf = _hf_dir(tmp_path / "a", {})
    (hf / "generation_config.json").unlink()
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "temperature": 0.3, "top_k": 3}))
    assert read_manifest(build_from_dict(_data(hf), tmp_path / "a" / "engine")).sampling_defaults == {}
    hf = _hf_dir(tmp_path / "b", {"max_new_tokens": 10**8})
    assert read_manifest(build_from_dict(_data(hf), tmp_path / "b" / "engine")).sampling_defaults == {
        "max_tokens": MAX_TOKENS_BOUND}


@pytest.mark.parametrize("defaults, field", [
    ({"temperature": "hot"}, "sampling_defaults.temperature"),
    ({"top_p": 0.0}, "sampling_defaults.top_p"),
    ({"top_k": 2.5}, "sampling_defaults.top_k"),
    ({"repetition_penalty": float("nan")}, "sampling_defaults.repetition_penalty"),
    ({"max_tokens": 0}, "sampling_defaults.max_tokens"),
    ({"seed": 1}, "sampling_defaults.seed"),
    ({"temperature": 10**400}, "sampling_defaults.temperature"),  # was an OverflowError traceback (isfinite)
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


def test_the_c_runtime_refuses_the_defaults_python_refuses(engine_dir, tmp_path):
    build_dir = build(setup_build_dir() or Path(__file__).resolve().parents[1] / "build" / "tests" / "c-runtime")
    for defaults, field in (({"temperature": "hot"}, "sampling_defaults.temperature"),
                            ({"top_p": 0.0}, "sampling_defaults.top_p"), ({"seed": 1}, "sampling_defaults.seed"),
                            ({"max_tokens": 0}, "sampling_defaults.max_tokens")):  # fmt: skip
        edited = tmp_path / f"engine-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(engine_dir, edited)
        data = json.loads((edited / MANIFEST_NAME).read_text())
        data.pop("content_sha256")
        save_manifest(edited, {**data, "sampling_defaults": defaults})
        run = generate(build_dir, edited, [[5, 6]], "--max-tokens", "2")
        assert run.returncode != 0 and field in run.stderr, (defaults, run.returncode, run.stderr[-400:])


def test_the_server_caps_and_echoes_what_it_used(engine_dir):
    """With the model's max_new_tokens 9: a request's own max_tokens past the room is refused as without the
    cap (vLLM's order), a min_tokens past the cap is refused naming the cap, and a Response echoes the settings
    it ran with (the model's temperature, top_p and the capped max_output_tokens), not nulls and 40."""
    handle = start_server(engine_dir, port=0, served_model_name=MODEL, device="cpu")
    try:
        client = openai_client(handle.url)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="once upon", max_tokens=600)
        assert err.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="once upon", max_tokens=40, extra_body={"min_tokens": 20})
        assert err.value.body["param"] == "min_tokens" and "max_new_tokens 9" in err.value.body["message"]
        r = client.responses.create(model=MODEL, input="hello", max_output_tokens=40)
        assert (r.temperature, r.top_p, r.max_output_tokens) == (0.6, 0.9, 9)
        assert r.usage.output_tokens <= 9
    finally:
        handle.shutdown(timeout=0)
