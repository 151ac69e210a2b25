"""vLLM's --reasoning-parser: a chat answer's thinking (up to `</think>`) in `reasoning`, the rest in `content`, in
the body and the stream alike; a structured output or forced tool call holds only after the thinking; the
Responses API's reasoning items. Truth: the engine's own raw text for the same prompt and seed (the Python API),
split by a plain `str.partition` reference written here, and the token ids themselves.

The served model is the tiny random one with a vocabulary that spells two of the ids it samples often as
`<think>` and `</think>` (added tokens, as Qwen3's are), so its answers really contain the tags."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import openai
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import build_from_dict
from runtime_helpers import openai_client
from tests.test_server import wait_idle
from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.runtime.sampling_params import StructuredOutputsParams
from trtpaged.server import ServerOptions, start_server
from trtpaged.runtime.reasoning import REASONING_PARSERS, ReasoningFormat, ReasoningReader, ThinkingBudget
from trtpaged.server.reasoning import ReasoningSplit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
MODEL = "tiny-thinking"
PROMPTS = ["hello there", "what is two plus two", "tell me a story", "why is the sky blue"]
SEEDS = range(3)
R1 = REASONING_PARSERS["deepseek_r1"]


def reference(text: str, in_reasoning: bool, start: str = "<think>", end: str = "</think>") -> tuple:
    """(reasoning, content) of a whole answer, each None when empty: a start tag that opens the answer is left out
    and opens the reasoning; the reasoning runs to the first end tag (all of it when none comes)."""
    if text.lstrip().startswith(start):
        text, in_reasoning = text.lstrip()[len(start):], True
    if not in_reasoning:
        return None, text or None
    thought, tag, rest = text.partition(end)
    return thought or None, (rest or None) if tag else None


TOKEN_TEXT = {1: "a", 2: " ", 3: "\n", 4: "bc", 5: "<", 8: "<think>", 9: "</think>"}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(sorted(TOKEN_TEXT)), max_size=12), st.booleans(),
       st.lists(st.integers(1, 4), min_size=12, max_size=12), st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_a_streamed_choice_puts_each_token_where_the_body_counts_it(ids, in_reasoning, sizes, held):
    """Deltas of any size, some of whose text comes a delta late (a stop string's hold-back): the tokens marked as
    reasoning add up to the body's count, and the texts join to the body's split."""
    from trtpaged.server.reasoning import ChoiceReasoning, split_text

    reader = ReasoningReader(R1, 8, 9)
    reading, chunks, pos, late = ChoiceReasoning(reader, in_reasoning), [], 0, ""
    for size, lag in zip(sizes, held):
        if pos >= len(ids):
            break
        part, pos = ids[pos : pos + size], pos + size
        text = late + "".join(TOKEN_TEXT[t] for t in part)
        done = pos >= len(ids)
        lag = 0 if done else min(lag, len(text))
        text, late = text[: len(text) - lag], text[len(text) - lag :]
        got = reading.read(text, part, [{t: -1.0} for t in part], done)
        if got is not None:
            chunks.append(got)
    if pos < len(ids) or not ids:
        return
    whole = "".join(TOKEN_TEXT[t] for t in ids)
    thought, content, entered = split_text(R1, in_reasoning, whole)
    assert sum(c[4] for c in chunks) == reader.reasoning_span(ids, entered)
    assert [t for c in chunks for t in c[2]] == ids and [len(c[3]) for c in chunks] == [len(c[2]) for c in chunks]
    assert ("".join(c[0] for c in chunks) or None, "".join(c[1] for c in chunks) or None) == (thought, content)


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think", ">", " ", "\n", "a", "bc", "é"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.booleans(), st.lists(st.integers(0, 60), max_size=6))
def test_any_text_in_any_pieces_splits_as_the_whole_partitions(pieces, in_reasoning, cuts):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    split = ReasoningSplit(R1, in_reasoning)
    thought, content = "", ""
    for a, b in zip(bounds, bounds[1:]):
        r, c = split.feed(text[a:b])
        thought, content = thought + r, content + c
    r, c = split.finish()
    thought, content = thought + r, content + c
    assert (thought or None, content or None) == reference(text, in_reasoning)


@pytest.mark.parametrize("prompt, kwargs, want", [
    ([1, 2, 3], None, True),  # no tag: the model thinks first (vLLM's rule for both parsers)
    ([1, 8, 2], None, True),  # the template opened the reasoning
    ([1, 8, 2, 9, 3], None, False),  # ... and closed it (thinking turned off by the template)
    ([8, 5, 9, 4, 8, 6], None, True),  # an earlier turn's closed reasoning, then a new one opened
    ([8, 5, 9, 4], {"enable_thinking": True}, False),
    ([1, 2], {"enable_thinking": False}, False),  # qwen3's switch; deepseek_r1 has none
])  # fmt: skip
def test_the_prompt_and_the_switch_decide_where_an_answer_starts(prompt, kwargs, want):
    """By token ids (the engine's reading), and by the template's generation prompt as text (the server's): the
    same rule, with "<think>" for 8 and "</think>" for 9."""
    qwen3, r1 = ReasoningReader(REASONING_PARSERS["qwen3"], 8, 9), ReasoningReader(R1, 8, 9)
    text = "".join({8: "<think>", 9: "</think>"}.get(t, "x") for t in prompt)
    for got in (qwen3.starts_in_reasoning(prompt, kwargs), qwen3.starts_in_reasoning([], kwargs, text)):
        assert got is want
    r1_want = want or bool(kwargs and kwargs.get("enable_thinking") is False)  # deepseek_r1 reads no switch
    assert r1.starts_in_reasoning(prompt, kwargs) is r1_want and r1.starts_in_reasoning([], kwargs, text) is r1_want


def test_a_parser_refuses_a_tokenizer_that_cannot_write_its_tags():
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer

    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()  # bytes spell the tags, in pieces: refused, as vLLM refuses a vocabulary without them
    with pytest.raises(ValueError, match=r"reasoning_parser: qwen3's tag '<think>' is not a token of this model's"):
        ReasoningReader.for_tokenizer("qwen3", tok)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    with pytest.raises(ValueError, match=r"tag '</think>' is not a token"):
        ReasoningReader.for_tokenizer("qwen3", tok)
    tok.add_tokens([AddedToken("</think>", special=False, normalized=False)])
    reader = ReasoningReader.for_tokenizer("qwen3", tok)
    assert (reader.start_id, reader.end_id) == (259, 260)  # the next free ids, as added
    assert {tok.convert_ids_to_tokens(i) for i in reader.blank_ids} >= {"Ġ", "Ċ"}  # byte-level " " and "\n"
    assert all(not tok.decode([i]).strip() for i in reader.blank_ids) and tok.encode("a")[0] not in reader.blank_ids
    tok.add_special_tokens({"additional_special_tokens": ["</think>"]})
    with pytest.raises(ValueError, match=r"reasoning_parser: qwen3's tag '</think>' is a special token"):
        ReasoningReader.for_tokenizer("qwen3", tok)
    with pytest.raises(ValueError, match=r"reasoning_parser: 'granite' is not a parser this server has; one of "
                                         r"deepseek_r1, qwen3"):  # fmt: skip
        ReasoningReader.for_tokenizer("granite", tok)
    with pytest.raises(ValueError, match="reasoning_parser: 'nope'"):
        ServerOptions(reasoning_parser="nope")


def test_a_server_whose_model_cannot_write_the_tags_is_not_started(tiny_engine_dir, monkeypatch):
    import threading

    monkeypatch.setitem(REASONING_PARSERS, "specials", ReasoningFormat("specials", "<|bos|>", "<|eos|>"))
    before = threading.active_count()
    with pytest.raises(ValueError, match=r"reasoning_parser: specials's tag '<\|bos\|>' is a special token"):
        start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(reasoning_parser="specials"))
    assert threading.active_count() <= before  # the engine thread and the tokenizer lanes were stopped


def test_serve_names_the_flag_of_an_unknown_parser(tiny_engine_dir):
    r = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--port", "0", "--reasoning-parser", "nope"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "--reasoning-parser" in r.output and "deepseek_r1, qwen3" in r.output, r.output


# ---- a grammar gated by the end of the thinking (the engine) --------------------------------------------------

def test_a_gated_grammar_leaves_the_output_free_until_its_tokens_then_holds(tiny_engine_dir):
    llm = _llm(tiny_engine_dir)
    prompt = llm.chat_prompt([{"role": "user", "content": "tell me a story"}])
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (truth,) = llm.generate([prompt], free, use_tqdm=False)
    ids = truth.outputs[0].token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i - 1] != ids[i])
    grammar = StructuredOutputsParams(regex="[a-z]{3}", starts_after=ids[k])
    params = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=grammar)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    got = out.outputs[0].token_ids
    assert got[: k + 1] == ids[: k + 1]  # free, as without the grammar, through the gate
    assert re.fullmatch("[a-z]{3}", llm.tokenizer.decode(got[k + 1 :], skip_special_tokens=True)), got
    assert out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match=r"structured_outputs.starts_after: token id 999 is outside the vocabulary"):
        gated = StructuredOutputsParams(regex="a", starts_after=999)
        llm.generate([prompt], SamplingParams(structured_outputs=gated), use_tqdm=False)


# ---- the server ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tags(tiny_engine_dir) -> dict[int, str]:
    """Two ids past the byte vocabulary that the tiny model samples in most answers to PROMPTS: the end tag, the
    one it samples most; the start tag, the next."""
    llm = _llm(tiny_engine_dir)
    seen: Counter = Counter()
    for text in PROMPTS:
        prompt = llm.chat_prompt([{"role": "user", "content": text}])
        for seed in SEEDS:
            params = SamplingParams(max_tokens=40, temperature=0.8, seed=seed, ignore_eos=True)
            seen.update({t for t in llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids if t >= 259})
    (end, _), (start, _) = seen.most_common(2)
    return {start: "<think>", end: "</think>"}


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory, tags) -> Path:
    from tokenizers import AddedToken

    from trtpaged.config import parse_config
    from trtpaged.models import load_hf

    root = tmp_path_factory.mktemp("thinking")
    hf = load_hf(parse_config({"model": {"tiny": TINY["model"]["tiny"]}}).model)
    names = [tags.get(i, f"<|unused{i}|>") for i in range(259, TINY["model"]["tiny"]["vocab_size"])]
    hf.tokenizer.add_tokens([AddedToken(n, special=False, normalized=False) for n in names])
    hf.model.save_pretrained(root / "hf")
    hf.tokenizer.save_pretrained(root / "hf")
    return build_from_dict({**TINY, "model": {"hf_dir": str(root / "hf")}, "output": None}, root / "engine")


@pytest.fixture(scope="module")
def server(thinking_engine):
    handle = start_server(thinking_engine, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(reasoning_parser="qwen3"))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


@functools.lru_cache(maxsize=None)
def _llm(engine: Path, reasoning_parser: Optional[str] = None) -> LLM:
    """One engine loaded once for the module's truths (each generate is its own)."""
    return LLM(engine, device="cpu", reasoning_parser=reasoning_parser)


def _tag_id(tags: dict[int, str], name: str) -> int:
    return next(t for t, tag in tags.items() if tag == name)


def _free_thinking(engine: Path, messages: list, seed: int, ids: list[int], end: int) -> Optional[str]:
    """The reasoning the model wrote freely through its first end tag (the same seed, nothing gating it)."""
    free, _ = _raw(engine, messages, seed, max_tokens=ids.index(end) + 1)
    return reference(free, True)[0]


def _raw(engine: Path, messages: list, seed: int, **kwargs) -> tuple[str, list[int]]:
    llm = _llm(engine)
    prompt = llm.chat_prompt(messages, template_kwargs=kwargs.pop("chat_template_kwargs", None))
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0.8, "seed": seed, "ignore_eos": True, **kwargs})
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    return c.text, list(c.token_ids)


def _streamed(client, **kwargs) -> tuple:
    thought, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning", None)
            assert getattr(choice.delta, "reasoning_content", None) == piece  # the older name, for its clients
            thought += piece or ""
            content += choice.delta.content or ""
    return thought or None, content or None


@pytest.mark.parametrize("thinking", [None, False])
def test_chat_answers_split_at_the_end_tag_in_the_body_and_the_stream(server, thinking_engine, thinking):
    client = openai_client(server.url)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if thinking is False else {}
    both = 0
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        for seed in SEEDS:
            raw, _ = _raw(thinking_engine, messages, seed, **kwargs)
            want = reference(raw, thinking is not False)
            ask = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=seed,
                       extra_body={"ignore_eos": True, **kwargs})  # fmt: skip
            message = client.chat.completions.create(**ask).choices[0].message
            assert (getattr(message, "reasoning", None), message.content) == want, raw
            assert getattr(message, "reasoning_content", None) == want[0]
            assert _streamed(client, **ask) == want
            both += bool(want[0] and want[1])
    if thinking is None:
        assert both >= 3  # the tags came in the middle of answers, not only at their ends
    wait_idle(server)


def test_a_response_format_holds_after_the_thinking_not_during_it(server, thinking_engine, tags):
    client = openai_client(server.url)
    end = _tag_id(tags, "</think>")
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    checked = 0
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        for seed in SEEDS:
            raw, ids = _raw(thinking_engine, messages, seed)
            ask = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=seed,
                       response_format=fmt, extra_body={"ignore_eos": True})  # fmt: skip
            r = client.chat.completions.create(**ask)
            message = r.choices[0].message
            if end not in ids:  # never ended its thinking: all of it free, as without the format
                assert (message.reasoning, message.content) == reference(raw, True)
                continue
            # the thinking as the model wrote it freely
            assert message.reasoning == _free_thinking(thinking_engine, messages, seed, ids, end)
            assert isinstance(json.loads(message.content), int), message.content  # the format holds after it
            checked += 1
    assert checked >= 3
    # thinking off: the format holds from the first token, and there is no reasoning
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                       response_format=fmt, extra_body=off)  # fmt: skip
    message = r.choices[0].message
    assert getattr(message, "reasoning", None) is None and isinstance(json.loads(message.content), int)
    wait_idle(server)


def test_a_forced_tool_call_comes_after_the_thinking(server, thinking_engine, tags):
    """tool_choice "required": the model thinks freely, then its calls are forced and read from the content."""
    from tests.test_server_tools import TOOLS

    client = openai_client(server.url)
    end = _tag_id(tags, "</think>")
    called = 0
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        for seed in SEEDS:
            raw, ids = _raw(thinking_engine, messages, seed)
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0.8,
                                               seed=seed, tools=TOOLS, tool_choice="required",
                                               extra_body={"ignore_eos": True})  # fmt: skip
            choice = r.choices[0]
            if end not in ids[:40]:
                continue
            assert choice.message.reasoning == _free_thinking(thinking_engine, messages, seed, ids, end)
            assert choice.message.tool_calls and choice.message.content is None  # forced: calls, even cut short
            for call in choice.message.tool_calls:
                assert call.function.name in ("get_weather", "add")
                if choice.finish_reason == "tool_calls":  # the calls ended within max_tokens: whole JSON objects
                    assert isinstance(json.loads(call.function.arguments), dict)
            called += 1
    assert called >= 2
    wait_idle(server)


def test_responses_carry_a_reasoning_item_before_the_message(server, thinking_engine, tags):
    client = openai_client(server.url)
    end = _tag_id(tags, "</think>")
    seen = 0
    for text in PROMPTS:
        for seed in SEEDS:
            raw, ids = _raw(thinking_engine, [{"role": "user", "content": text}], seed, ignore_eos=False)
            thought, content = reference(raw, True)
            ask = dict(model=MODEL, input=text, max_output_tokens=40, temperature=0.8, extra_body={"seed": seed})
            body = client.responses.create(**ask)
            kinds = [item.type for item in body.output]
            assert kinds == ["reasoning"] + (["message"] if content else []), kinds
            assert body.output[0].content[0].text == thought
            if content:
                assert body.output[1].content[0].text == content
            span = ids[: ids.index(end) + 1 if end in ids else len(ids)]
            assert body.usage.output_tokens_details.reasoning_tokens == sum(t not in tags for t in span)  # tags not
            events = list(client.responses.create(stream=True, **ask))
            done = events[-1].response
            assert [item.model_dump() for item in done.output][0]["content"] == body.output[0].model_dump()["content"]
            deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert deltas == thought
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (content or "")
            assert done.usage.output_tokens_details == body.usage.output_tokens_details
            seen += bool(content)
    assert seen >= 3
    wait_idle(server)


def test_a_past_turns_reasoning_reaches_the_template():
    """vLLM gives an assistant message's `reasoning` (or its old name `reasoning_content`) to the chat template,
    which reads either (Qwen3's reads reasoning_content)."""
    from trtpaged.models.tiny_tokenizer import make_tiny_tokenizer
    from trtpaged.runtime.llm import chat_prompt_text
    from trtpaged.server.protocol import chat_messages
    from trtpaged.server.schemas import ChatMessage

    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content', '-') }}|{{ m['content'] }};"
                "{% endfor %}")  # fmt: skip
    for key in ("reasoning", "reasoning_content"):
        messages = [ChatMessage(role="user", content="q"), ChatMessage(role="assistant", content="a", **{key: "why"}),
                    ChatMessage(role="user", content="q2")]  # fmt: skip
        text = chat_prompt_text(make_tiny_tokenizer(), chat_messages(messages), add_generation_prompt=False,
                                chat_template=template)  # fmt: skip
        assert text == "user:-|q;assistant:why|a;user:-|q2;"


def test_a_responses_reasoning_item_reaches_the_template_with_the_turn_it_led_to(tiny_engine_dir):
    """Responses input as a client sends a conversation back (reasoning item, then the answer it led to): the
    thinking goes with that assistant turn, as reasoning_content; a summary-only item too, and several join."""
    import jinja2

    template = ("{% for m in messages %}{{ m['role'] }}:{{ m.get('reasoning_content', '-') }}|{{ m['content'] }};"
                "{% endfor %}")  # fmt: skip
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=template)
    try:
        client = openai_client(handle.url)
        llm = _llm(tiny_engine_dir)
        think = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "hm"}]}  # fmt: skip
        summary = {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "short"}]}
        call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}
        cases = [
            ([think, {"role": "assistant", "content": "a"}],
             [{"role": "assistant", "content": "a", "reasoning_content": "hm"}]),
            ([summary, call], [{"role": "assistant", "content": "", "reasoning_content": "short"}]),  # calls only: ""
            ([think, {"role": "user", "content": "x"}], [{"role": "user", "content": "x"}]),  # no turn of its own
            ([think, summary, {"role": "assistant", "content": "a"}],  # two items before one turn: both, in order
             [{"role": "assistant", "content": "a", "reasoning_content": "hm\n\nshort"}]),
        ]  # fmt: skip
        for items, want in cases:
            r = client.responses.create(model=MODEL, input=[{"role": "user", "content": "q"}, *items,
                                                            {"role": "user", "content": "q2"}], max_output_tokens=1)
            rendered = jinja2.Template(template).render(messages=[{"role": "user", "content": "q"}, *want,
                                                                  {"role": "user", "content": "q2"}])
            assert r.usage.input_tokens == len(llm.tokenizer.encode(rendered, add_special_tokens=False)), rendered
        with pytest.raises(openai.BadRequestError, match=r"input\[1\].content: must be a list of reasoning_text"):
            client.responses.create(model=MODEL, input=[{"role": "user", "content": "q"},
                                                        {**think, "content": [{"type": "output_text", "text": "x"}]}])
    finally:
        handle.shutdown(timeout=0)


# ---- thinking_token_budget -------------------------------------------------------------------------------------

def test_a_thinking_budget_forces_the_end_tag_after_that_many_tokens(thinking_engine, tags):
    """vLLM's thinking_token_budget: the output is the free one for `budget` tokens, then the end tag, then the
    model goes on; a model that closes its thinking sooner is not touched. Truth: the same seed without a budget."""
    end = _tag_id(tags, "</think>")
    start = _tag_id(tags, "<think>")
    llm = _llm(thinking_engine, "qwen3")
    cut = untouched = 0
    for text in PROMPTS:
        prompt = llm.chat_prompt([{"role": "user", "content": text}])
        for seed, temperature in [(s, 0.8) for s in SEEDS] + [(0, 0.0)]:
            def run(**budget):
                params = SamplingParams(max_tokens=40, temperature=temperature, seed=seed, ignore_eos=True, **budget)
                return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

            free = run()
            for budget in (0, 3, 11, 30):
                # where the budget runs out: after `budget` tokens that are not a start tag (tags do not count)
                counted = [i for i, t in enumerate(free) if t != start]
                due = counted[budget] if budget < len(counted) else len(free)
                got = run(thinking_token_budget=budget)
                if end in free[:due + 1]:  # closed its thinking in time
                    assert got == free
                    untouched += 1
                else:
                    assert got[:due] == free[:due] and got[due] == end, (budget, free, got)
                    assert len(got) == 40  # and it goes on answering
                    cut += 1
    assert cut >= 5 and untouched >= 1
    with pytest.raises(ValueError, match="thinking_token_budget: not supported with beam search"):
        SamplingParams(beam_width=2, thinking_token_budget=3)
    with pytest.raises(ValueError, match=r"thinking_token_budget: must be in \[0, 2\*\*31\) \(or -1: no budget\)"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "unlimited"


@pytest.mark.parametrize("thinking, picks, want", [
    (False, [8, 3, 4, 5, 6], [8, 3, 4, 9, 6]),  # the answer opens with a start tag: the budget starts there
    (True, [8, 3, 4, 5, 6], [8, 3, 4, 9, 6]),  # a start tag the model writes itself does not count
    (True, [3, 9, 4, 5, 6], [3, 9, 4, 5, 6]),  # closed in time: nothing forced
    (False, [1, 8, 3, 4, 5], [1, 8, 3, 4, 5]),  # a start tag inside the answer is text (as the split reads it)
    (True, [3, 4, 5], [3, 4, 9]),
    (False, [2, 2, 8, 3, 4, 5], [2, 2, 8, 3, 4, 9]),  # whitespace, then the start tag: it opens (as the split reads)
    (True, [2, 8, 3, 4, 5], [2, 8, 3, 4, 9]),  # ... and that whitespace does not count
    (False, [2, 1, 8, 3, 4], [2, 1, 8, 3, 4]),  # text before it: no
])  # fmt: skip
def test_a_thinking_budget_counts_the_reasoning_tokens_only(thinking, picks, want):
    budget, out = ThinkingBudget(2, 8, 9, thinking, blank_ids=frozenset({2})), []  # 2: a whitespace token
    for token in picks:  # the model's picks; a forced token replaces its pick
        forced = budget.forced()
        out.append(token if forced is None else forced)
        budget.advance(out[-1])
    assert out == want


def test_the_server_takes_a_thinking_budget(server, thinking_engine, tags):
    client = openai_client(server.url)
    end = _tag_id(tags, "</think>")
    llm = _llm(thinking_engine, "qwen3")
    start = _tag_id(tags, "<think>")
    for text in PROMPTS:
        raw, ids = _raw(thinking_engine, [{"role": "user", "content": text}], 0, ignore_eos=False)
        counted = [i for i, t in enumerate(ids) if t != start]
        due = counted[5] if len(counted) > 5 else len(ids)  # after five reasoning tokens (a start tag is not one)
        if end in ids[: due + 1] or due >= 39:
            continue
        ask = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=40, temperature=0.8, seed=0,
                   extra_body={"thinking_token_budget": 5})  # fmt: skip
        message = client.chat.completions.create(**ask).choices[0].message
        assert message.reasoning == reference(llm.tokenizer.decode(ids[:due]), True)[0]
        r = client.responses.create(model=MODEL, input=text, max_output_tokens=40, temperature=0.8,
                                    extra_body={"seed": 0, "thinking_token_budget": 5})  # fmt: skip
        assert r.usage.output_tokens_details.reasoning_tokens == 5  # the tags are not counted (vLLM's count)
    # the engine counts where the server's split reads the thinking: thinking switched off, nothing is forced; a
    # user's "</think>" changes nothing
    for text, kwargs, forced in (("tell me a story", {"enable_thinking": False}, False),
                                 ("tell me a story </think>", None, True)):  # fmt: skip
        messages = [{"role": "user", "content": text}]
        free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0.8, seed=0,
                                              logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                         "chat_template_kwargs": kwargs})
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0.8, seed=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True,
                                                         "chat_template_kwargs": kwargs, "thinking_token_budget": 3})
        ids, budgeted = free.choices[0].token_ids, got.choices[0].token_ids
        if forced and end not in ids[:4]:
            assert budgeted[:3] == ids[:3] and budgeted[3] == end
        elif not forced:
            assert budgeted == ids
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget: must be in"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"thinking_token_budget": -5})  # fmt: skip
    wait_idle(server)


def test_a_thinking_budget_without_a_reasoning_parser_is_refused_naming_it(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    try:
        with pytest.raises(openai.BadRequestError, match="thinking_token_budget: needs a reasoning parser") as info:
            openai_client(handle.url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"thinking_token_budget": 5})
        assert info.value.body["param"] == "thinking_token_budget"
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def _logprob_tokens(entries) -> list[str]:
    return [e.token for e in entries or []]


@pytest.mark.parametrize("options", [{"stream_interval": 3},
                                     {"default_chat_template_kwargs": {"enable_thinking": False}}],
                         ids=["interval3", "thinking-off"])  # fmt: skip
def test_log_probs_and_reasoning_tokens_follow_the_split(thinking_engine, tags, options):
    """Each token's log-prob goes with the part its text went to: the reasoning's (through the end tag) with the
    reasoning, the rest with the answer; streamed (chunks of several tokens too) as in the body, and the Responses
    message's log-probs are the answer's tokens. Thinking off: no reasoning, every token the message's."""
    end = _tag_id(tags, "</think>")
    off = "default_chat_template_kwargs" in options
    handle = start_server(thinking_engine, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(reasoning_parser="qwen3", **options))  # fmt: skip
    try:
        client = openai_client(handle.url)
        for text in PROMPTS:
            for seed in SEEDS:
                messages = [{"role": "user", "content": text}]
                kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if off else {}
                _, ids = _raw(thinking_engine, messages, seed, ignore_eos=False, **kwargs)
                thought = 0 if off else (ids.index(end) + 1 if end in ids else len(ids))  # tokens through the end tag
                counted = sum(t not in tags for t in ids[:thought])  # usage leaves the tags out (vLLM's count)
                ask = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=seed, logprobs=True,
                           top_logprobs=1)  # fmt: skip
                body = client.chat.completions.create(**ask).choices[0]
                assert len(body.logprobs.content) == len(ids)
                parts = {"reasoning": [], "content": []}
                for chunk in client.chat.completions.create(stream=True, **ask):
                    for choice in chunk.choices:
                        if choice.logprobs is None:
                            continue
                        part = "reasoning" if getattr(choice.delta, "reasoning", None) is not None else "content"
                        parts[part] += _logprob_tokens(choice.logprobs.content)
                assert parts["reasoning"] + parts["content"] == _logprob_tokens(body.logprobs.content)
                assert len(parts["reasoning"]) == thought, (thought, parts)
                ask = dict(model=MODEL, input=text, max_output_tokens=40, temperature=0.8, top_logprobs=1,
                           include=["message.output_text.logprobs"], extra_body={"seed": seed})  # fmt: skip
                r = client.responses.create(**ask)
                assert r.usage.output_tokens_details.reasoning_tokens == counted
                message = [item for item in r.output if item.type == "message"]
                want = _logprob_tokens(body.logprobs.content)[thought:]
                assert _logprob_tokens(message[0].content[0].logprobs if message else []) == want
                events = list(client.responses.create(stream=True, **ask))
                deltas = [e for e in events if e.type == "response.output_text.delta"]
                streamed = [t for e in deltas for t in _logprob_tokens(e.logprobs)]
                assert streamed == want
                assert events[-1].response.usage.output_tokens_details.reasoning_tokens == counted
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_a_tag_in_a_message_does_not_move_where_the_answer_starts(server, thinking_engine):
    """Only the template's generation prompt says whether the answer starts in the thinking: a user who writes
    "</think>" does not turn the split off."""
    client = openai_client(server.url)
    for seed in SEEDS:
        messages = [{"role": "user", "content": "tell me a story </think>"}]
        raw, _ = _raw(thinking_engine, messages, seed)
        message = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8,
                                                 seed=seed, extra_body={"ignore_eos": True}).choices[0].message
        assert (message.reasoning, message.content) == reference(raw, True)
    wait_idle(server)


def test_responses_continue_a_partial_assistant_message_and_pass_the_effort_to_the_template(tiny_engine_dir):
    """vLLM's Responses rules: an input that ends with an assistant message still in progress (or incomplete) is
    continued, not answered; `reasoning.effort` (and chat's `reasoning_effort`) is the template variable
    reasoning_effort. Truth: the template rendered here with jinja2."""
    import jinja2

    template = ("{{ reasoning_effort | default('-') }}:{% for m in messages %}{{ m['role'] }}={{ m['content'] }};"
                "{% endfor %}{% if add_generation_prompt %}assistant={% endif %}")  # fmt: skip
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", chat_template=template)
    llm = _llm(tiny_engine_dir)

    def tokens(**kwargs) -> int:
        return len(llm.tokenizer.encode(jinja2.Template(template).render(**kwargs), add_special_tokens=False))

    try:
        client = openai_client(handle.url)
        partial = {"role": "assistant", "content": [{"type": "output_text", "text": "Once upon"}], "type": "message",
                   "status": "incomplete"}  # fmt: skip
        user = {"role": "user", "content": "a story"}
        r = client.responses.create(model=MODEL, input=[user, partial], max_output_tokens=1)
        # continued: the text ends in the message itself ("...=Once upon;" is what the template writes for it; the
        # continuation starts right after its text, so the closing ";" is not part of the prompt)
        full = jinja2.Template(template).render(messages=[user, {"role": "assistant", "content": "Once upon"}],
                                                add_generation_prompt=False)  # fmt: skip
        assert r.usage.input_tokens == len(llm.tokenizer.encode(full[: full.rindex("Once upon") + 9],
                                                                add_special_tokens=False))  # fmt: skip
        done = {**partial, "status": "completed"}
        r = client.responses.create(model=MODEL, input=[user, done, {"role": "user", "content": "more"}],
                                    max_output_tokens=1)  # a finished assistant turn: answered as before
        turns = [user, {"role": "assistant", "content": "Once upon"}, {"role": "user", "content": "more"}]
        assert r.usage.input_tokens == tokens(messages=turns, add_generation_prompt=True)
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "high"})
        want = tokens(reasoning_effort="high", messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert r.usage.input_tokens == want and r.reasoning.effort == "high"
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                           reasoning_effort="high")
        assert c.usage.prompt_tokens == want
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_include_reasoning_false_leaves_the_reasoning_out(server, thinking_engine):
    """vLLM's include_reasoning: false: the answer is the content alone, whole and streamed, the reasoning split off
    and dropped (its tokens still counted); true or unset keeps it."""
    client = openai_client(server.url)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    for seed in SEEDS:
        raw, _ = _raw(thinking_engine, messages, seed)
        thought, content = reference(raw, True)
        ask = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=seed,
                   extra_body={"ignore_eos": True, "include_reasoning": False})  # fmt: skip
        answer = client.chat.completions.create(**ask)
        message = answer.choices[0].message
        assert getattr(message, "reasoning", None) is None and message.content == content, raw
        assert answer.usage.completion_tokens == 40
        assert _streamed(client, **ask) == (None, content)
        kept = client.chat.completions.create(**{**ask, "extra_body": {"ignore_eos": True, "include_reasoning": True}})
        assert getattr(kept.choices[0].message, "reasoning", None) == thought
    wait_idle(server)


def test_chat_usage_counts_the_reasoning_tokens(server, thinking_engine, tags):
    """A chat answer's usage.completion_tokens_details.reasoning_tokens is its reasoning's tokens, the tags left out
    (OpenAI's field; the count the Responses API reports), in the body and the stream's usage chunk;
    was: no completion_tokens_details (the SDK read None). Truth: the engine's own tokens for the same seed."""
    client = openai_client(server.url)
    end = _tag_id(tags, "</think>")
    for text in PROMPTS[:2]:
        for seed in SEEDS:
            messages = [{"role": "user", "content": text}]
            _, ids = _raw(thinking_engine, messages, seed, ignore_eos=False)
            counted = sum(t not in tags for t in ids[: ids.index(end) + 1 if end in ids else len(ids)])
            ask = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=seed)
            body = client.chat.completions.create(**ask)
            assert body.usage.completion_tokens_details.reasoning_tokens == counted
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
            assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == counted
    plain = client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert plain.usage.completion_tokens_details is None  # no chat answer: nothing split
    wait_idle(server)
