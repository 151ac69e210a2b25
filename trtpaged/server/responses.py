"""OpenAI response bodies and stream chunks (completions and chat) built from `RequestOutput`s."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from pydantic import BaseModel

from trtpaged.runtime.outputs import RequestOutput
from trtpaged.runtime.reasoning import ReasoningFormat
from trtpaged.server.reasoning import split_text
from trtpaged.server.tool_parsers import CallReader, CallStart, Content, Event
from trtpaged.server.stream_state import stop_reason
from trtpaged.server.tools import ToolChoice
from trtpaged.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
    dump,
)

Entry = Optional[Mapping[int, float]]  # one token's log-prob and top-k (None: the first prompt token)


@dataclass(frozen=True)
class TokenStrings:
    """What log-probs show of each token, read on the engine thread: its decoded `text` (text offsets, echo,
    prompt_logprobs' decoded_token), its own bytes (`raw`, chat's `bytes`; see token_bytes) and its name (the
    text, or "token_id:<id>" with vLLM's return_tokens_as_token_ids)."""

    text: Mapping[int, str]
    raw: Mapping[int, bytes] = field(default_factory=dict)
    as_ids: bool = False

    def name(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.text[token]

    def bytes_of(self, token: int) -> list[int]:
        return list(self.raw[token] if token in self.raw else self.text[token].encode("utf-8"))


@dataclass(frozen=True)
class Echo:
    """A completions prompt shown before its completion (`echo: true`): its text, tokens and log-probs."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[Entry]]  # None unless logprobs were asked for


def top_entries(entries: Sequence[Entry], token_ids: Sequence[int], k: int) -> list[Entry]:
    """Each entry cut to its token plus the k most likely (prompt log-probs may hold more than k)."""
    out: list[Entry] = []
    for token, entry in zip(token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:k])
        top[token] = entry[token]
        out.append(top)
    return out


def sse(data: Union[BaseModel, dict, str]) -> bytes:
    """One Server-Sent Event."""
    payload = data if isinstance(data, str) else json.dumps(dump(data) if isinstance(data, BaseModel) else data)
    return f"data: {payload}\n\n".encode()


_TEXT_MARK = "\x01trtpaged-text\x01"  # a text no model name or id holds: where a template's text goes


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def logprob_token_ids(token_ids: Sequence[int], logprobs: Optional[Sequence[Entry]]) -> set[int]:
    """Every token id whose text a logprobs field will show."""
    ids = set(token_ids)
    for entry in logprobs or ():
        ids.update(entry or ())
    return ids


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Entry], strings: TokenStrings, offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions format (tokens, token_logprobs, top_logprobs, text_offset) and the next offset;
    an echoed prompt's first token has no log-prob (null, as OpenAI sends it)."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, logprobs):
        body["tokens"].append(strings.name(token))
        body["token_logprobs"].append(None if entry is None else entry.get(token))
        body["top_logprobs"].append(None if entry is None else _top_by_name(entry, strings))
        body["text_offset"].append(offset)
        offset += len(strings.text[token])
    return CompletionLogprobs(**body), offset


def _top_by_name(entry: Entry, strings: TokenStrings) -> dict[str, float]:
    """A top-k entry keyed by token text, best first; tokens of one text (byte tokens of a cut character are all
    "\ufffd") keep the best's log-prob, where a dict built best first kept the worst's."""
    top: dict[str, float] = {}
    for t, lp in sorted(entry.items(), key=lambda kv: -kv[1]):
        top.setdefault(strings.name(t), lp)
    return top


def vllm_prompt_logprobs(entries: Sequence[Entry], strings: TokenStrings) -> PromptLogprobs:
    """vLLM's prompt_logprobs field: per prompt token, None or {token id: {logprob, rank, decoded_token}}, each
    rank the runtime's (`outputs.Logprob.rank`: the prompt token's in the whole vocabulary, a top-k entry's its
    place there, as vLLM reports them); a plain float's is its place in the entry."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        order = sorted(entry, key=lambda t: -entry[t])
        out.append({str(t): PromptLogprob(logprob=lp, rank=getattr(lp, "rank", None) or order.index(t) + 1,
                                          decoded_token=strings.text[t]) for t, lp in entry.items()})  # fmt: skip
    return out


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]], strings: TokenStrings, top_k: int
) -> ChatLogprobs:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def item(token: int, logprob: Optional[float]) -> dict[str, Any]:
        return {"token": strings.name(token), "logprob": logprob, "bytes": strings.bytes_of(token)}

    content = []
    for token, entry in zip(token_ids, logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
        content.append(TokenLogprob(**item(token, entry.get(token)),
                                    top_logprobs=[TopLogprob(**item(t, lp)) for t, lp in top]))
    return ChatLogprobs(content=content)


@dataclass(frozen=True)
class ResponseBuilder:
    """Shapes bodies for one HTTP request: its id, model name, creation time and endpoint."""

    request_id: str
    model: str
    created: int
    chat: bool
    top_logprobs: Optional[int] = None  # requested top-k, or None when logprobs are off
    tools: Optional[ToolChoice] = None  # chat: outputs are (or, for auto, may hold) tool calls
    token_ids: bool = False  # vLLM's return_token_ids: bodies carry the prompt's and the choices' token ids
    echo: str = ""  # chat's echo: the last message's text, before each answer (whole, or a first content chunk)
    reasoning: Optional[ReasoningFormat] = None  # chat with a reasoning parser: its tags
    in_reasoning: bool = True  # with `reasoning`: whether the answers begin inside the reasoning (the prompt's end)
    show_reasoning: bool = True  # vLLM's include_reasoning: false splits the reasoning off and leaves it out
    # choice index -> the text chunk's event around its text (see event); None: no template
    _templates: dict[int, Optional[tuple[str, str]]] = field(default_factory=dict, compare=False, repr=False)

    def _envelope(self) -> dict[str, Any]:
        return {"id": self.request_id, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: Sequence[int], logprobs: Optional[Sequence[Mapping[int, float]]],
                  strings: TokenStrings, offset: int = 0) -> Union[ChatLogprobs, CompletionLogprobs, None]:
        if self.top_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, logprobs, strings, self.top_logprobs)
        return completion_logprobs(token_ids, logprobs, strings, offset)[0]

    def full(self, finals: Sequence[RequestOutput], n: int, strings: TokenStrings,
             echoes: Optional[Sequence[Echo]] = None, echo_only: bool = False,
             prompt_logprobs: Optional[int] = None) -> Union[ChatCompletionResponse, CompletionResponse]:  # fmt: skip
        """The non-streamed body: one choice per prompt x completion, numbered prompt-major. Completions with
        `echoes`: each prompt's text (and log-probs) before its completion, which `echo_only` leaves out;
        `prompt_logprobs`: the k of vLLM's field (None: not asked for), per choice (completions) or for the request
        (chat), each entry cut to its token and top k (the prompt is scored for the larger of it and an echo's
        `logprobs`). With `token_ids`
        (return_token_ids), each choice its generated token ids (not the echo's), the prompt's per choice
        (completions) or for the request (chat)."""
        choices: list[Any] = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                text, token_ids, logprobs = ("", [], []) if echo_only else (c.text, c.token_ids, c.logprobs)
                if echoes is not None:
                    e = echoes[p]
                    text, token_ids = e.text + text, e.token_ids + list(token_ids)
                    logprobs = None if e.logprobs is None or logprobs is None else e.logprobs + list(logprobs)
                # echo_only: the one token sampled to score the prompt is dropped, whatever ended it (an EOS, a stop
                # string): the answer is its max_tokens 0 tokens long
                finish, why = ("length", None) if echo_only else (c.finish_reason, stop_reason(c))
                common = {"index": p * n + c.index, "logprobs": self._logprobs(token_ids, logprobs, strings),
                          "finish_reason": finish, "stop_reason": why,
                          "token_ids": ([] if echo_only else list(c.token_ids)) if self.token_ids else None}
                if self.chat:
                    thought: Optional[str] = None
                    if self.reasoning is not None:
                        thought, answer, _ = split_text(self.reasoning, self.in_reasoning, text)
                        text = answer or ""
                    content, calls, complete = text, None, False
                    if self.tools is not None:  # read as its stream read it, however it ended (the calls so far)
                        content, calls, complete = self.tools.read(text)
                    if calls and complete and c.finish_reason == "stop" and self.tools.named is None:
                        # a named call ends with "stop" (OpenAI's, vLLM's; a named function_call's too)
                        common["finish_reason"] = self.tools.calls_finish
                    function_call = None
                    if calls and self.tools.functions:  # the legacy form: the one call as function_call
                        function_call, calls = calls[0]["function"], None
                    if self.echo:
                        content = self.echo + (content or "")
                    elif self.reasoning is not None and not content:
                        content = None  # vLLM's: no answer after the reasoning is a null content
                    shown = thought if self.show_reasoning else None
                    choices.append(ChatChoice(message=AssistantMessage(content=content, tool_calls=calls,
                                                                       function_call=function_call,
                                                                       reasoning=shown), **common))  # fmt: skip
                else:
                    scored = self._prompt_logprobs(out, prompt_logprobs, strings)
                    prompt_ids = list(out.prompt_token_ids) if self.token_ids else None
                    choices.append(CompletionChoice(text=text, prompt_logprobs=scored, prompt_token_ids=prompt_ids,
                                                    **common))  # fmt: skip
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = 0 if echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
        body = {**self._envelope(), "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        if self.chat:
            scored = self._prompt_logprobs(finals[0], prompt_logprobs, strings) if finals else None
            if scored is not None:
                body["prompt_logprobs"] = scored
            if self.token_ids and finals:
                body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
            return ChatCompletionResponse(**body)
        return CompletionResponse(**body)

    @staticmethod
    def _prompt_logprobs(out: RequestOutput, k: Optional[int], strings: TokenStrings) -> Optional[PromptLogprobs]:
        """vLLM's prompt_logprobs field of `out` with its top `k` (None when not asked for or not scored)."""
        if k is None or out.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(top_entries(out.prompt_logprobs, out.prompt_token_ids, k), strings)

    def chunk(
        self,
        index: int,
        text: Optional[str],
        finish_reason: Optional[str] = None,
        logprobs: Union[ChatLogprobs, CompletionLogprobs, None] = None,
        role: bool = False,
        stop_reason: Union[int, str, None] = None,
        usage: Optional[Usage] = None,
        token_ids: Optional[list[int]] = None,
        prompt_token_ids: Optional[list[int]] = None,
    ) -> Union[ChatCompletionChunk, CompletionChunk]:
        """One streamed choice delta. Chat: `role` sends the assistant role (the first chunk of a choice), with content
        "" (vLLM's, and OpenAI's before text) or, where the answer can only be calls (tool_choice required or a named
        function), null (OpenAI's first delta of a tool-call answer, so that a client's accumulated message has no
        content, as the whole answer has none; under auto the answer's kind is not known yet). `stop_reason` (with the
        finish reason): the stop string or stop token id that ended the choice. `usage`: the choice's usage so far
        (stream_options.continuous_usage_stats). `token_ids`, `prompt_token_ids` (return_token_ids): the chunk's new
        tokens, the prompt's (with a choice's first chunk)."""
        if self.chat:
            if role:
                only_calls = self.tools is not None and self.tools.auto is None
                delta = Delta(role="assistant", content=None if only_calls else "")
            else:
                delta = Delta(content=text or None)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                     stop_reason=stop_reason, token_ids=token_ids)  # fmt: skip
            return ChatCompletionChunk(**self._envelope(), choices=[choice], usage=usage,
                                       prompt_token_ids=prompt_token_ids)  # fmt: skip
        choice = CompletionChoice(index=index, text=text or "", logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=stop_reason, token_ids=token_ids,
                                  prompt_token_ids=prompt_token_ids)  # fmt: skip
        return CompletionChunk(**self._envelope(), choices=[choice], usage=usage)

    def reasoning_chunk(self, index: int, text: str, logprobs: Optional[ChatLogprobs] = None,
                        usage: Optional[Usage] = None, token_ids: Optional[list[int]] = None,
                        prompt_token_ids: Optional[list[int]] = None) -> ChatCompletionChunk:  # fmt: skip
        """A streamed chat choice's next piece of reasoning (a server with a reasoning parser)."""
        choice = ChatChunkChoice(index=index, delta=Delta(reasoning=text), logprobs=logprobs, token_ids=token_ids)
        return ChatCompletionChunk(**self._envelope(), choices=[choice], usage=usage, prompt_token_ids=prompt_token_ids)

    def tool_stream_chunks(self, index: int, reader: CallReader, text: str, finish_reason: Optional[str],
                           logprobs: Optional[ChatLogprobs] = None, stop_reason: Union[int, str, None] = None,
                           token_ids: Optional[list[int]] = None) -> list[ChatCompletionChunk]:  # fmt: skip
        """The chunks of a streamed tool-call choice's new text (read by its `reader`); once it ends, the last
        chunk with finish_reason "tool_calls" ("function_call" for the legacy form) when the choice's calls all
        completed as JSON objects ("stop" for a named tool_choice's call, as OpenAI and vLLM end it). The delta's
        `logprobs` and `token_ids` go with its first chunk (a chunk with an empty delta when the reader holds its
        text back)."""
        chunks = self.tool_chunks(index, reader.feed(text))
        if finish_reason:
            chunks += self.tool_chunks(index, reader.finish())
            named = self.tools is not None and self.tools.named is not None
            calls = self.tools.calls_finish if self.tools is not None else "tool_calls"
            finish = calls if finish_reason == "stop" and reader.ok and not named else finish_reason
            chunks.append(self.chunk(index, "", finish, stop_reason=stop_reason))
        if (logprobs is not None or token_ids is not None) and (chunks or logprobs and logprobs.content or token_ids):
            if not chunks:
                chunks.append(self.chunk(index, None))
            chunks[0].choices[0].logprobs = logprobs
            chunks[0].choices[0].token_ids = token_ids
        return chunks

    def tool_chunks(self, index: int, events: Sequence[Event]) -> list[ChatCompletionChunk]:
        """A streamed choice's tool-call parser events as chunks: content, a call's start (id, type, name,
        arguments ""), then pieces of its arguments (runs of pieces joined); for the legacy form (`functions`), the
        one call as `function_call`: its name (arguments ""), then pieces."""
        deltas: list[Delta] = []
        legacy = self.tools is not None and self.tools.functions
        for e in events:
            last = deltas[-1] if deltas else None
            if legacy and not isinstance(e, Content):  # one call (parallel off): no index or id to carry
                if isinstance(e, CallStart):
                    deltas.append(Delta(function_call=DeltaFunctionCall(name=e.name, arguments="")))
                elif last is not None and last.function_call is not None and last.function_call.name is None:
                    last.function_call.arguments = (last.function_call.arguments or "") + e.text
                else:
                    deltas.append(Delta(function_call=DeltaFunctionCall(arguments=e.text)))
            elif isinstance(e, Content):
                if last is not None and last.content is not None:
                    last.content += e.text
                else:
                    deltas.append(Delta(content=e.text))
            elif isinstance(e, CallStart):
                start = DeltaToolCall(index=e.index, id=e.id, type="function",
                                      function=DeltaFunctionCall(name=e.name, arguments=""))
                deltas.append(Delta(tool_calls=[start]))
            elif (last is not None and last.tool_calls and last.tool_calls[0].id is None
                  and last.tool_calls[0].index == e.index):  # fmt: skip
                last.tool_calls[0].function.arguments += e.text
            else:
                piece = DeltaFunctionCall(arguments=e.text)
                deltas.append(Delta(tool_calls=[DeltaToolCall(index=e.index, function=piece)]))
        envelope = self._envelope()
        return [ChatCompletionChunk(**envelope, choices=[ChatChunkChoice(index=index, delta=d)]) for d in deltas]

    def event(self, index: int, text: Optional[str], finish_reason: Optional[str] = None,
              logprobs: Union[ChatLogprobs, CompletionLogprobs, None] = None,
              stop_reason: Union[int, str, None] = None, usage: Optional[Usage] = None,
              token_ids: Optional[list[int]] = None,
              prompt_token_ids: Optional[list[int]] = None) -> bytes:  # fmt: skip
        """`sse(self.chunk(...))`. The chunk of almost every token (text, no finish reason, log-probs, usage or
        token ids) comes from a template serialized once per choice, with only its text JSON-encoded: the same
        bytes without building and dumping three pydantic models per token."""
        if text and finish_reason is None and logprobs is None and usage is None and token_ids is None \
                and prompt_token_ids is None:
            template = self._templates.get(index, ())
            if template == ():
                template = self._templates[index] = self._text_template(index)
            if template is not None:
                return f"{template[0]}{json.dumps(text)}{template[1]}".encode()
        return sse(self.chunk(index, text, finish_reason, logprobs, stop_reason=stop_reason, usage=usage,
                              token_ids=token_ids, prompt_token_ids=prompt_token_ids))  # fmt: skip

    def _text_template(self, index: int) -> Optional[tuple[str, str]]:
        """The text chunk's event split around its (JSON-encoded) text, or None if the split is ambiguous."""
        whole = sse(self.chunk(index, _TEXT_MARK)).decode()
        mark = json.dumps(_TEXT_MARK)
        if whole.count(mark) != 1:
            return None
        head, tail = whole.split(mark)
        return head, tail

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> Union[ChatCompletionChunk, CompletionChunk]:
        """The last chunk when stream_options.include_usage is set: no choices, the request's usage."""
        kind = ChatCompletionChunk if self.chat else CompletionChunk
        return kind(**self._envelope(), choices=[], usage=usage(prompt_tokens, completion_tokens))

    def stream_logprobs(self, token_ids: Sequence[int], logprobs: Optional[Sequence[Mapping[int, float]]],
                        strings: TokenStrings, offset: int) -> Union[ChatLogprobs, CompletionLogprobs, None]:
        """Log-probs of the tokens in one streamed delta (completions offsets continue from `offset`)."""
        return self._logprobs(token_ids, logprobs, strings, offset)
