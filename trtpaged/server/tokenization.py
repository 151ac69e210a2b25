"""POST /tokenize and /detokenize (vLLM's): a prompt's token ids as the generation endpoints count them, and back.

A client budgets a context, or checks what a chat template makes of a conversation, without generating: `prompt`
is tokenized as /v1/completions tokenizes it, `messages` as /v1/chat/completions does (the same template, options
and tools), so `count` is the `usage.prompt_tokens` the same body would get there.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

from trtpaged.runtime.llm import LLM, chat_prompt_text
from trtpaged.runtime.llm_engine import Prompt, encode_prompt
from trtpaged.server.constraints import token_ids_in_vocab
from trtpaged.server.engine_loop import Overloaded, ShuttingDown
from trtpaged.server.errors import ApiError, from_runtime_error
from trtpaged.server.legacy_functions import renamed, tool_fields
from trtpaged.server.protocol import (
    chat_form,
    chat_messages,
    chat_options,
    check_model,
    check_request_template,
    validated,
)
from trtpaged.server.schemas import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from trtpaged.server.tokenizer_worker import TokenizerWorker
from trtpaged.server.tools import shown_tools

T = TypeVar("T")


def generation_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: Optional[Sequence[dict]],
                      chat_options: dict[str, Any], full: str) -> Optional[str]:
    """The text the chat template adds to start the answer (its generation prompt: `full`, the conversation
    rendered with it, less the conversation rendered without it); None when the request continues its last message,
    asks for no generation prompt, or the two renderings do not nest."""
    if chat_options.get("continue_final_message") or chat_options.get("add_generation_prompt") is False:
        return None
    bare = chat_prompt_text(tokenizer, messages, tools, **{**chat_options, "add_generation_prompt": False})
    return full[len(bare) :] if full.startswith(bare) else None


def prompt_token_ids(tokenizer: Any, vocab_size: Optional[int], prompt: Optional[Prompt],
                     messages: Optional[list[dict[str, Any]]], tools: Optional[Sequence[dict]],
                     chat_options: dict[str, Any], add_special_tokens: bool,
                     check_text: Optional[Callable[[str], None]] = None,
                     rendered: Optional[list[str]] = None) -> list[int]:  # fmt: skip
    """A prompt's token ids as /v1/completions, /v1/chat/completions and /tokenize all make them (one rule, so that
    /tokenize counts what the generation endpoints count): `messages` under the chat template (with the tools'
    definitions and the chat options), else a text prompt through the tokenizer; a token-id prompt is kept as given
    (checked against the vocabulary). `add_special_tokens` (vLLM's): what the tokenizer adds (a BOS), on top of the
    template's text for messages; the request schemas default it as vLLM does, true for a text prompt and false for
    messages (their template writes its own). `check_text` sees the text before it is tokenized (and may refuse
    it); `rendered`, when given, gets the chat template's text. Runs on the tokenizer worker's prompts lane, with its
    tokenizer."""
    if messages is not None:
        text = chat_prompt_text(tokenizer, messages, tools, **chat_options)
        if rendered is not None:
            rendered.append(text)
        if check_text is not None:
            check_text(text)
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    assert prompt is not None
    if check_text is not None and isinstance(prompt, str):
        check_text(prompt)
    return encode_prompt(tokenizer, vocab_size, prompt, add_special_tokens)[1]


def _count_body(chat: dict[str, Any]) -> dict[str, Any]:
    """The /tokenize body that counts a chat body's prompt as the chat endpoint renders it."""
    keys = ("model", "messages", "tools", "documents", "chat_template_kwargs", "add_generation_prompt",
            "continue_final_message")
    body = {k: chat[k] for k in keys if k in chat}
    effort = chat.get("reasoning_effort")  # a template variable too (protocol.chat_options), under the request's own
    if effort is not None:  # chat_template_kwargs; /tokenize takes no reasoning_effort field
        body["chat_template_kwargs"] = {"reasoning_effort": effort, **body.get("chat_template_kwargs", {})}
    return body


class Tokenization:
    """The two endpoints' work, on the tokenizer worker's prompts lane (never the engine thread): a full lane is
    `Overloaded` (a 503), as a full waiting queue is for generation."""

    def __init__(self, llm: LLM, tokens: TokenizerWorker, model_names: Sequence[str],
                 template_defaults: Optional[dict[str, Any]] = None, trust_template: bool = False) -> None:  # fmt: skip
        self.llm = llm
        self.trust_template = trust_template  # a request's own chat_template is rendered (else refused)
        self.template_defaults = template_defaults  # the server's chat template variables
        self.tokens = tokens
        self.model_names = tuple(model_names)  # a request may name any
        self.max_seq_len = llm.config.max_seq_len
        self.vocab_size = llm.manifest.dims.vocab_size

    async def tokenize(self, body: Any) -> bytes:
        """A `prompt` or `messages` body -> the JSON body of its `TokenizeResponse` (made on the tokenizer's
        thread, see `tokenize_json`); raises ApiError naming the field."""
        def answer(tokenizer: Any, ids: list[int], token_strs: bool) -> bytes:
            strs = tokenizer.convert_ids_to_tokens(ids) if token_strs else None
            return tokenize_json(len(ids), self.max_seq_len, ids, strs)

        return await self._tokenized(body, answer)

    async def chat_prompt_tokens(self, chat: dict[str, Any]) -> int:
        """How many tokens a chat body's prompt renders to, as the chat endpoint renders it (Anthropic's
        count_tokens, OpenAI's responses/input_tokens); raises ApiError naming the chat field. Only the count
        comes back from the tokenizer's thread (the /tokenize body of 2.5M ids took ~0.35 s to make, and its
        json.loads held the event loop ~0.15 s)."""
        return await self._tokenized(_count_body(chat), lambda tokenizer, ids, token_strs: len(ids))

    async def _tokenized(self, body: Any, answer: Callable[[Any, list[int], bool], T]) -> T:
        """`answer(tokenizer, ids, return_token_strs)` of a /tokenize body's token ids, on the texts lane."""
        chat, body = chat_form(body, "/tokenize")
        kind: type[Union[TokenizeChatRequest, TokenizeCompletionRequest]]
        kind = TokenizeChatRequest if chat else TokenizeCompletionRequest
        req = validated(kind, body)
        check_model(req.model, self.model_names)
        if isinstance(req, TokenizeChatRequest):
            messages = chat_messages(req.messages)
            fields = tool_fields(req)  # `functions` as the tools they stand for, as the chat endpoint takes them
            try:
                tools = shown_tools(fields.tools, fields.choice)  # validated and shown as the chat endpoint does
            except ApiError as exc:  # a legacy request's refusal names its own fields
                raise renamed(exc) if fields.functions else exc from None
            check_request_template(req.chat_template, self.trust_template)
            options = chat_options(req, self.template_defaults, self.trust_template)
            options["content_format"] = self.llm.chat_template_content_format

        def run(tokenizer: Any) -> T:
            if tokenizer is None:
                raise ApiError("prompt: this engine has no tokenizer; nothing to tokenize with", "prompt")
            if isinstance(req, TokenizeChatRequest):
                ids = prompt_token_ids(tokenizer, self.vocab_size, None, messages, tools,
                                       options, req.add_special_tokens)  # fmt: skip
            else:
                ids = prompt_token_ids(tokenizer, self.vocab_size, req.prompt, None, None, {}, req.add_special_tokens)
            return answer(tokenizer, ids, bool(req.return_token_strs))

        field_name = "messages" if chat else "prompt"
        try:
            return await self.tokens.text(run)
        except (ApiError, ShuttingDown, Overloaded):  # the app answers the last two with a 503
            raise
        except ValueError as exc:
            own = chat and isinstance(req, TokenizeChatRequest) and req.chat_template is not None
            raise from_runtime_error(exc, {"prompt": field_name, **({} if own else {"chat_template": field_name})}) \
                from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            raise ApiError(f"{field_name}: could not be tokenized ({type(exc).__name__})", field_name) from None

    async def detokenize(self, body: Any) -> bytes:
        """A `tokens` body -> the JSON body of its `DetokenizeResponse`: their text (special tokens included, as
        vLLM's /detokenize). The ids are checked, decoded and the answer written on the tokenizer's thread, none of
        it holding the GIL long (4M ids of SmolLM2: ~0.25 s on the event loop to check them, ~0.8 s of GIL held by
        `Tokenizer.decode`, ~0.1 s on the loop to write the 48 MB answer: /health waited 1.7 s)."""
        req = validated(DetokenizeRequest, body)
        check_model(req.model, self.model_names)

        def run(tokenizer: Any) -> bytes:
            token_ids_in_vocab("tokens", req.tokens, self.vocab_size)
            if tokenizer is None:
                raise ApiError("tokens: this engine has no tokenizer; nothing to detokenize with", "tokens")
            return detokenize_json(decoded(tokenizer, req.tokens))

        return await self.tokens.text(run)


def decoded(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids, skip_special_tokens=False)`: for a fast tokenizer that cleans up no spaces (its decode
    then is the Rust tokenizer's), through `tokenizers`' `decode_batch`, which releases the GIL while it decodes;
    `Tokenizer.decode` holds it throughout, every other thread waiting (the event loop and the engine's steps)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids, skip_special_tokens=False)
    return backend.decode_batch([ids], skip_special_tokens=False)[0]


def detokenize_json(text: str) -> bytes:
    """`DetokenizeResponse` as the bytes `JSONResponse` makes of it, written `_TEXT_SLICE` characters at a time
    (one `json.dumps` of a 48 MB text holds the GIL ~0.1 s)."""
    parts = ['{"prompt":"']
    for i in range(0, len(text), _TEXT_SLICE):
        parts.append(json.dumps(text[i:i + _TEXT_SLICE], ensure_ascii=False)[1:-1])
    parts.append('"}')
    return "".join(parts).encode("utf-8")


_SLICE = 1 << 14  # items per piece of a long list: one short call each, so other threads get the GIL between them
_TEXT_SLICE = 1 << 18  # characters per piece of a long text, likewise


def tokenize_json(count: int, max_model_len: int, tokens: Sequence[int], token_strs: Optional[Sequence[str]]) -> bytes:
    """`TokenizeResponse` as the bytes `JSONResponse` makes of it, written a slice of the lists at a time.

    One `json.dumps` of a million token ids holds the GIL for about 0.25 s (every engine step waits for it);
    slices of `_SLICE` items hold it for a few milliseconds each."""
    parts = ['{"count":', str(int(count)), ',"max_model_len":', str(int(max_model_len)), ',"tokens":[']
    for i in range(0, len(tokens), _SLICE):
        parts.append(("," if i else "") + ",".join(map(str, map(int, tokens[i:i + _SLICE]))))
    parts.append('],"token_strs":')
    if token_strs is None:
        parts.append("null")
    else:
        parts.append("[")
        for i in range(0, len(token_strs), _SLICE):
            piece = json.dumps(list(token_strs[i:i + _SLICE]), ensure_ascii=False, separators=(",", ":"))
            parts.append(("," if i else "") + piece[1:-1])
        parts.append("]")
    parts.append("}")
    return "".join(parts).encode("utf-8")
