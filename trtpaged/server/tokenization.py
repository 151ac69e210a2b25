"""POST /tokenize and /detokenize (vLLM's): a prompt's token ids as the generation endpoints count them, and back.

A client budgets a context, or checks what a chat template makes of a conversation, without generating: `prompt`
is tokenized as /v1/completions tokenizes it, `messages` as /v1/chat/completions does (the same template, options
and tools), so `count` is the `usage.prompt_tokens` the same body would get there.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from trtpaged.runtime.llm import LLM
from trtpaged.runtime.llm_engine import LLMEngine, Prompt
from trtpaged.server.constraints import token_ids_in_vocab
from trtpaged.server.engine_loop import EngineLoop
from trtpaged.server.errors import ApiError, from_runtime_error
from trtpaged.server.protocol import chat_messages, chat_options, check_model, validated
from trtpaged.server.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from trtpaged.server.tools import tool_choice


def encode_prompt(llm: LLM, engine: LLMEngine, prompt: Optional[Prompt], messages: Optional[list[dict[str, Any]]],
                  tools: Optional[Sequence[dict]], chat_options: dict[str, Any], add_special_tokens: bool
                  ) -> list[int]:  # fmt: skip
    """A prompt's token ids as /v1/completions, /v1/chat/completions and /tokenize all make them (one rule, so that
    /tokenize counts what the generation endpoints count): `messages` under the chat template (with the tools'
    definitions and the chat options), else a text prompt through the tokenizer; a token-id prompt is kept as given.
    `add_special_tokens` (vLLM's): what the tokenizer adds (a BOS), on top of the template's text for messages; the
    request schemas default it as vLLM does, true for a text prompt and false for messages (their template writes
    its own). Runs on the engine thread (the tokenizer's)."""
    if messages is not None:
        return llm.chat_prompt(messages, tools, add_special_tokens=add_special_tokens, **chat_options)
    assert prompt is not None
    return engine.encode(prompt, add_special_tokens=add_special_tokens)[1]


class Tokenization:
    """The two endpoints' work; the tokenizer is only touched on the engine thread (`EngineLoop.call_async`)."""

    def __init__(self, llm: LLM, loop: EngineLoop, model_name: str) -> None:
        self.llm = llm
        self.loop = loop
        self.model_name = model_name
        self.max_seq_len = llm.config.max_seq_len
        self.vocab_size = llm.manifest.dims.vocab_size

    async def tokenize(self, body: Any) -> TokenizeResponse:
        """A `prompt` or `messages` body -> its token ids; raises ApiError naming the field."""
        chat = isinstance(body, dict) and "messages" in body
        kind: type[Union[TokenizeChatRequest, TokenizeCompletionRequest]]
        kind = TokenizeChatRequest if chat else TokenizeCompletionRequest
        req = validated(kind, body)
        check_model(req.model, self.model_name)
        if isinstance(req, TokenizeChatRequest):
            messages = chat_messages(req.messages)
            tools = tool_choice(req.tools, "required") if req.tools else None  # validated as the chat endpoint does
            options = chat_options(req)

        def run(engine: LLMEngine) -> tuple[list[int], Optional[list[str]]]:
            tokenizer = engine.tokenizer
            if tokenizer is None:
                raise ApiError("prompt: this engine has no tokenizer; nothing to tokenize with", "prompt")
            if isinstance(req, TokenizeChatRequest):
                ids = encode_prompt(self.llm, engine, None, messages, tools.definitions if tools else None, options,
                                    req.add_special_tokens)  # fmt: skip
            else:
                ids = encode_prompt(self.llm, engine, req.prompt, None, None, {}, req.add_special_tokens)
            strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return list(ids), strs

        field_name = "messages" if chat else "prompt"
        try:
            ids, strs = await self.loop.call_async(run)
        except ApiError:
            raise
        except ValueError as exc:
            raise from_runtime_error(exc, {"prompt": field_name}) from None
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            raise ApiError(f"{field_name}: could not be tokenized ({type(exc).__name__})", field_name) from None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_seq_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: Any) -> DetokenizeResponse:
        """A `tokens` body -> their text (special tokens included, as vLLM's /detokenize)."""
        req = validated(DetokenizeRequest, body)
        check_model(req.model, self.model_name)
        token_ids_in_vocab("tokens", req.tokens, self.vocab_size)

        def run(engine: LLMEngine) -> str:
            if engine.tokenizer is None:
                raise ApiError("tokens: this engine has no tokenizer; nothing to detokenize with", "tokens")
            return engine.tokenizer.decode(list(req.tokens), skip_special_tokens=False)

        return DetokenizeResponse(prompt=await self.loop.call_async(run))
