"""Scoring prompts over HTTP with the official `openai` client: completions `echo` + `logprobs` (+ max_tokens 0),
OpenAI's legacy form, and vLLM's `prompt_logprobs`; checked against HF's log-softmax of its own forward."""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import hf_from_engine_dir, openai_client
from tests.test_server import stream, wait_idle
from trtpaged.server import start_server

MODEL = "tiny-scoring"
PROMPT = "The quick brown fox jumps over the lazy dog; 0123456789!"  # 57 byte tokens, odd block split


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


@pytest.fixture(scope="module")
def hf(tiny_engine_dir):
    return hf_from_engine_dir(tiny_engine_dir)


def hf_scores(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_ranks(row: torch.Tensor, token: int, tol: float = 1e-4) -> range:
    """The ranks (1: most likely) a token may have in a row of HF's log-probs, its ties within `tol` either way."""
    lp = float(row[token])
    return range(int((row > lp + tol).sum()) + 1, int((row >= lp - tol).sum()) + 1)


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, server, hf):
    ids = hf.tokenizer.encode(PROMPT)
    ref = hf_scores(hf, ids)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT and resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT and lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    diffs = [abs(lp.token_logprobs[j] - float(ref[j - 1, ids[j]])) for j in range(1, len(ids))]
    assert max(diffs) < 1e-4
    for j in range(1, len(ids)):  # the 3 most likely, plus the prompt token when it is not among them
        top = torch.topk(ref[j - 1], 3).indices.tolist()
        shown = {hf.tokenizer.decode([t]) for t in top} | {lp.tokens[j]}
        assert set(lp.top_logprobs[j]) == shown
    wait_idle(server)


def test_echo_with_a_completion_and_token_id_prompt(client, hf):
    ids = hf.tokenizer.encode(PROMPT)[:20]
    resp = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=4, temperature=0)
    choice = resp.choices[0]
    assert choice.text.startswith(hf.tokenizer.decode(ids)) and len(choice.logprobs.tokens) == 20 + 4
    ref = hf_scores(hf, ids)
    assert abs(choice.logprobs.token_logprobs[5] - float(ref[4, ids[5]])) < 1e-4
    assert resp.usage.completion_tokens == 4


def test_vllm_prompt_logprobs_field(client, hf):
    ids = hf.tokenizer.encode(PROMPT)
    ref = hf_scores(hf, ids)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = resp.model_extra.get("prompt_logprobs") or resp.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for j in range(1, len(ids)):
        entry = scored[j]
        assert str(ids[j]) in entry and len(entry) <= 3
        assert abs(entry[str(ids[j])]["logprob"] - float(ref[j - 1, ids[j]])) < 1e-4
        assert entry[str(ids[j])]["rank"] in hf_ranks(ref[j - 1], ids[j])  # vLLM's rank: 1 = the most likely
        top = torch.topk(ref[j - 1], 2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_prompt_logprobs_beside_echo_logprobs_keep_their_own_k(client, hf):
    """The prompt is scored once for the larger of prompt_logprobs and an echo's logprobs; each field shows its own
    k (vLLM's: the prompt token plus its top k). prompt_logprobs 0 beside echo logprobs 3 showed 3 or 4 entries."""
    ids = hf.tokenizer.encode(PROMPT)
    ref = hf_scores(hf, ids)
    for k in (0, 1):
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=3,
                                         extra_body={"prompt_logprobs": k})  # fmt: skip
        scored = resp.choices[0].model_extra["prompt_logprobs"]
        assert scored[0] is None and len(scored) == len(ids)
        for j in range(1, len(ids)):
            entry, best = scored[j], float(ref[j - 1].max())
            others = [e for t, e in entry.items() if t != str(ids[j])]
            assert str(ids[j]) in entry and len(others) <= k
            if k and len(entry) == 1:  # the prompt token is the most likely one
                assert abs(entry[str(ids[j])]["logprob"] - best) < 1e-4
            assert all(e["rank"] == 1 and abs(e["logprob"] - best) < 1e-4 for e in others)
        assert len(resp.choices[0].logprobs.top_logprobs[5]) >= 2  # the echo keeps its 3 (names may coincide)


def test_streamed_echo_sends_the_prompt_first(server, hf):
    events = stream(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_scoring_requests_are_400s(client):
    import openai

    for kwargs, field in [({"max_tokens": 0}, "max_tokens"),
                          ({"extra_body": {"prompt_logprobs": -1}}, "prompt_logprobs"),
                          ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
                          ({"echo": True, "logprobs": 99, "max_tokens": 0}, "logprobs")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="x", **kwargs)
        assert info.value.body["param"] == field, (kwargs, info.value.body)
