"""`LLM`: the offline Python API over an engine dir."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence as Seq, Union

import jinja2

from trtpaged.deadline import CHAT_TEMPLATE_SECONDS, DeadlineExceeded, run_with_deadline
from trtpaged.engine_files import verify_engine_dir
from trtpaged.errors import RequestError, check_unicode
from trtpaged.manifest import EngineDirError, Manifest, engine_path, read_manifest
from trtpaged.kv_budget import check_host_pool, check_host_tier
from trtpaged.runtime.runners import load_runner, resolve_device, resolve_num_kv_blocks
from trtpaged.runtime.runners.base import pool_block_bytes
from trtpaged.runtime import cpu_share
from trtpaged.runtime.beam_api import BeamSearchOutput, BeamSearchParams, beam_outputs
from trtpaged.runtime.content_format import CONTENT_FORMATS, template_content_format
from trtpaged.runtime.kv_tiers.config import KVTierConfig, manifest_fingerprint
from trtpaged.runtime.llm_engine import LLMEngine, Prompt, prompt_salt, unwrap_prompt
from trtpaged.runtime.outputs import RequestOutput, RequestOutputKind
from trtpaged.runtime.reasoning import ReasoningReader
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampling_params import MAX_SCHEMA_DEPTH, SamplingParams, nesting_depth
from trtpaged.runtime.speculative import SpeculativeConfig
from trtpaged.runtime.verify_cost import default_verify_row_cost
from trtpaged.runtime.vllm_args import apply_vllm_args
from trtpaged.runtime.warmup import warm_up

log = logging.getLogger("trtpaged.runtime")
# apply_chat_template's own arguments, which chat_prompt's template_kwargs may not set
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def _tightened(name: str, value: Optional[int], limit: int) -> int:
    if value is None:
        return limit
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer in [1, {limit}] (the engine's build limit), got {value!r}")
    if not 1 <= value <= limit:
        raise ValueError(f"{name}: must be in [1, {limit}] (the engine's build limit), got {value}")
    return value


def model_sampling_defaults(manifest: Manifest, generation_config: str) -> dict[str, Any]:
    """vLLM's `generation_config`: "auto" takes the model's recommended sampling settings (the manifest's
    sampling_defaults, from its generation_config.json), "vllm" none."""
    if generation_config not in ("auto", "vllm"):
        raise ValueError(f"generation_config: 'auto' (the model's, recorded by the build) or 'vllm' (none), got "
                         f"{generation_config!r:.80}; a folder of its own is not read here (build with it)")
    defaults = dict(manifest.sampling_defaults) if generation_config == "auto" else {}  # checked by read_manifest
    if defaults:
        log.info("sampling defaults from the model's generation config (a request's own values win): %s",
                 ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))  # fmt: skip
    return defaults


def _prompt_list(prompts: Any) -> list[tuple[Prompt, Optional[str]]]:
    """`generate`'s prompts as a list of (prompt, cache_salt): text, or token ids (a list, tuple, numpy array or
    tensor), or vLLM's {"prompt": text} / {"prompt_token_ids": ids} (with an optional "cache_salt"), or a list of
    those. Raises RequestError("prompt") for anything else."""
    if isinstance(prompts, Mapping):
        return [(unwrap_prompt(prompts), prompt_salt(prompts))]  # one prompt, whatever it holds
    prompts = unwrap_prompt(prompts)
    first = prompts[0] if isinstance(prompts, (list, tuple)) and prompts else None
    one_of_ids = hasattr(first, "__index__") and not hasattr(first, "__len__")  # an int or numpy int, not an array
    if isinstance(prompts, str) or one_of_ids:
        return [(prompts, None)]  # one prompt
    if not isinstance(prompts, (list, tuple)):
        raise RequestError("prompt", "must be text, a list of token ids, a prompt dict or a list of those, got "
                           f"{type(prompts).__name__}")
    return [(unwrap_prompt(p), prompt_salt(p)) for p in prompts]


def _progress_bar(use_tqdm: Union[bool, Callable[..., Any]], total: int) -> Any:
    """vLLM's `use_tqdm`: a bar of finished prompts (shown on a terminal only), or a given tqdm-like class's."""
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", disable=None)


def load_tokenizer(engine_dir: Path, manifest: Manifest, chat_template: Optional[str] = None) -> Any:
    """The engine dir's tokenizer; never runs code it ships (trust_remote_code=False). Raises EngineDirError.
    `chat_template`: a template's text that replaces the engine's (vLLM's --chat-template)."""
    from transformers import AutoTokenizer

    path = engine_path(engine_dir, manifest.tokenizer_dir, "tokenizer_dir")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (transformers and tokenizers raise many types for a bad dir)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise EngineDirError(path, "tokenizer_dir",
                             f"transformers cannot load it ({type(e).__name__}: {first})") from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif manifest.chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = manifest.chat_template
    return tokenizer


MAX_CHAT_TEMPLATE_CHARS = 1 << 20


def check_chat_template(tokenizer: Any, template: Any) -> None:
    """Raises ValueError naming `chat_template` unless `template` is a Jinja template that compiles and renders a
    user message in CHAT_TEMPLATE_SECONDS (one that loops without end is refused); an error the template raises
    on purpose, refusing that one message, is not a broken template (the build's own check does the same)."""
    if not isinstance(template, str) or not template.strip() or len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"chat_template: must be a Jinja template's text of 1 to {MAX_CHAT_TEMPLATE_CHARS} "
                         f"characters, got {type(template).__name__} of "
                         f"{len(template) if isinstance(template, str) else 0}")
    try:
        run_with_deadline(lambda: tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                                add_generation_prompt=True, chat_template=template),
                          CHAT_TEMPLATE_SECONDS)  # fmt: skip
    except DeadlineExceeded:
        raise ValueError(f"chat_template: rendering one user message ran past {CHAT_TEMPLATE_SECONDS:g} s") from None
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a Jinja template (line {e.lineno}: {str(e)[:200]})") from None
    except Exception:  # noqa: BLE001 - the template's own refusal of this conversation, or a key it needs
        pass


def chat_prompt_ids(tokenizer: Any, messages: Seq[dict], tools: Optional[Seq[dict]] = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: Optional[dict[str, Any]] = None, add_special_tokens: bool = False,
                    content_format: str = "auto") -> list[int]:  # fmt: skip
    """`LLM.chat_prompt` with a given tokenizer (the server's own copy, off the engine thread)."""
    text = chat_prompt_text(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                            content_format=content_format)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


# keys a text part may carry for a provider's prompt cache, with nothing to do here (the prefix cache is automatic):
# Anthropic's hint, which LiteLLM and Claude-oriented clients put on parts (vLLM ignores it too), and OpenAI's
# breakpoint (checked: cache_breakpoint_error)
_PART_HINTS = ("cache_control", "prompt_cache_breakpoint")


def cache_breakpoint_error(part: Mapping) -> Optional[str]:
    """What is wrong with a content part's prompt_cache_breakpoint (OpenAI's: "marks the exact end of a reusable
    prompt prefix"), checked to the SDK's type {"mode": "explicit", "ttl": "30m" | "12h"}; None when it is absent,
    null or well formed."""
    value = part.get("prompt_cache_breakpoint")
    if value is None:
        return None
    if (not isinstance(value, Mapping) or value.get("mode") != "explicit" or set(value) - {"mode", "ttl"}
            or value.get("ttl") not in (None, "30m", "12h")):  # fmt: skip
        return f"must be {{'mode': 'explicit'}}, with an optional ttl '30m' or '12h', got {value!r:.80}"
    return None


def text_part(part: Any, where: str) -> str:
    """A content part's text: {"type": "text", "text": str}, or an assistant's {"type": "refusal", "refusal": str}
    (text only); RequestError("messages") for anything else."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind not in ("text", "refusal"):
        got = f"type {kind!r:.40}" if isinstance(part, Mapping) else type(part).__name__
        raise RequestError("messages", f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                           f"got {got}")  # fmt: skip
    unknown = set(part) - {"type", kind, *_PART_HINTS}
    if unknown:
        raise RequestError("messages", f"{where}: unknown keys {sorted(unknown)!r:.80}")
    problem = cache_breakpoint_error(part)
    if problem is not None:
        raise RequestError("messages", f"{where}.prompt_cache_breakpoint: {problem}")
    if not isinstance(part.get(kind), str):
        raise RequestError("messages", f"{where}.{kind}: must be a string, got {type(part.get(kind)).__name__}")
    return part[kind]


def _with_text_content(messages: Seq[Mapping], as_parts: bool = False) -> list[dict]:
    """Messages as vLLM gives them to the template: a content that is a list of parts (OpenAI's form) as its text
    parts joined by newlines; with `as_parts` (a template that loops over the parts), every content as a list of
    text parts instead ({"type": "text", "text": ...}; none for an absent content)."""
    out = []
    for m, msg in enumerate(messages):
        if not isinstance(msg.get("role"), str):
            raise RequestError(f"messages[{m}].role", f"required, a string (user, assistant, system, ...), got "
                               f"{msg.get('role')!r:.40}")  # fmt: skip
        content = msg.get("content")
        if content is None:  # an assistant turn that only called tools; vLLM gives the template an empty text
            content = ""
        elif not isinstance(content, (str, list)):
            raise RequestError(f"messages[{m}].content", f"must be a string or a list of parts, got "
                               f"{type(content).__name__}")  # fmt: skip
        texts = [text_part(part, f"messages[{m}].content[{p}]") for p, part in enumerate(content)] \
            if isinstance(content, list) else [] if msg.get("content") is None else [content]  # fmt: skip
        for text in texts:  # named here, where the position is the content's own
            check_unicode(f"messages[{m}].content", text)
        parts = [{"type": "text", "text": t} for t in texts]  # an empty text is a part too, as vLLM gives it
        out.append({**msg, "content": parts if as_parts else "\n".join(texts)})
    return out


def _developer_as_system(messages: list[dict], template: Any) -> list[dict]:
    """OpenAI's developer messages (its SDK's name for the system instructions) as system ones, under a template that
    never names the developer role: such a template renders one as an unknown turn after its own default system
    prompt (SmolLM2's, Llama 3's) or drops it (Qwen2.5's). A template that names the role, as a quoted string
    (gpt-oss's `message.role == "developer"`), gets it as sent; the word in its prose does not count."""
    sources = template.values() if isinstance(template, Mapping) else [template]
    if any(isinstance(source, str) and ("'developer'" in source or '"developer"' in source) for source in sources):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _tool_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """An assistant's tool calls as vLLM gives them to the template: each call's `arguments`, which OpenAI's API
    sends as JSON text, as the value it encodes (`_call_arguments`: what transformers' templates read, Llama 3.1's
    `arguments | tojson`, Qwen2.5's), and an empty list of calls as none; another role's calls are left out (vLLM
    keeps only an assistant's: Llama 3.1's template renders any message with calls as the assistant's). A call that
    is not a function call is refused, naming it."""
    out = []
    for m, msg in enumerate(messages):
        calls = msg.get("tool_calls")
        if "tool_calls" in msg and (msg.get("role") != "assistant" or calls == []):  # another role's, or none
            out.append({k: v for k, v in msg.items() if k != "tool_calls"})
            continue
        if msg.get("role") != "assistant" or not isinstance(calls, list):
            out.append(msg)
            continue
        converted = []
        for c, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or call.get("type", "function") != "function":
                raise RequestError(f"messages[{m}].tool_calls[{c}]", "must be a function call ({'type': "
                                   "'function', 'function': {'name': ..., 'arguments': ...}})")  # fmt: skip
            arguments = _call_arguments(function.get("arguments"), f"messages[{m}].tool_calls[{c}].function.arguments")
            converted.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**msg, "tool_calls": converted})
    return out


def _call_arguments(arguments: Any, where: str) -> Any:
    """A call's arguments as vLLM gives them to the template: JSON text as the value it encodes (an object, and a
    list or a number as they are), an object or a list as given; empty or malformed text (a call cut by max_tokens,
    sent back in the history: it must not make every later turn fail) and anything else as {}. Text nested past
    Python's recursion limit is refused, naming `where`."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            log.warning("%s: not JSON (%d characters); the template is given {}", where, len(arguments))
            return {}
        except RecursionError:
            raise RequestError(where, f"JSON nested too deeply to read (past Python's recursion limit, "
                               f"{sys.getrecursionlimit()})") from None  # fmt: skip
    return arguments if isinstance(arguments, (Mapping, list)) else {}


def chat_prompt_text(tokenizer: Any, messages: Seq[dict], tools: Optional[Seq[dict]] = None, *,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     template_kwargs: Optional[dict[str, Any]] = None, chat_template: Optional[str] = None,
                     content_format: str = "auto",
                     documents: Optional[Seq[Mapping[str, str]]] = None) -> str:  # fmt: skip
    """The conversation under the chat template (the tokenizer's, or `chat_template`), as text; `chat_prompt_ids`'
    checks and options. `documents` (vLLM's, for retrieval-augmented templates such as Command R's): string
    mappings the template gets as `documents`. `content_format` (vLLM's --chat-template-content-format): how the
    template gets each message's content, "string" or "openai" (a list of text parts), or "auto": "openai" for a
    template that loops over a message's content (`content_format.template_content_format`), else "string"."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise RequestError("messages", "must be a list of messages ({'role': ..., 'content': ...}), got "
                           f"{type(messages).__name__} {messages!r:.80}")  # fmt: skip
    if not messages:
        raise RequestError("messages", "must hold at least one message", 1)
    if content_format not in CONTENT_FORMATS:
        raise RequestError("chat_template_content_format", f"must be one of {list(CONTENT_FORMATS)}, got "
                           f"{content_format!r:.40}")  # fmt: skip
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if content_format == "auto":
        content_format = template_content_format(template, tools=bool(tools))
    messages = _with_text_content(messages, as_parts=content_format == "openai")
    messages = _developer_as_system(messages, template)
    messages = _tool_arguments_as_objects(messages)
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        raise RequestError("chat_template_kwargs", f"must be a mapping, got {type(template_kwargs).__name__}")
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message", "cannot be combined with add_generation_prompt: set "
                           "add_generation_prompt to false to continue the last message")  # fmt: skip
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise RequestError("continue_final_message", "needs the last message to be the assistant's")
    extra = dict(template_kwargs or {})
    reserved = sorted(set(extra) & TEMPLATE_ARGUMENTS)
    if reserved:
        raise RequestError("chat_template_kwargs", f"may not set {reserved} (the request's own fields)")
    if nesting_depth(extra, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # rendering recursed through it, failing on messages
        raise RequestError("chat_template_kwargs", f"nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep")
    if tools:
        extra["tools"] = list(tools)
    if documents is not None:
        extra["documents"] = _checked_documents(documents)
    if chat_template is not None:
        extra["chat_template"] = chat_template
    elif not getattr(tokenizer, "chat_template", None):
        raise RequestError("chat_template", "this engine has no chat template (its model's tokenizer had none at "
                           "build): send a plain prompt (/v1/completions, LLM.generate), or offline pass "
                           "LLM.chat(..., chat_template=...)")  # fmt: skip

    def render(conversation: list[dict]) -> str:
        return run_with_deadline(lambda: tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **extra), CHAT_TEMPLATE_SECONDS)  # fmt: skip

    try:
        text = render(list(messages))
    except DeadlineExceeded:
        raise RequestError("messages", f"the chat template ran past {CHAT_TEMPLATE_SECONDS:g} s rendering this "
                           "conversation and was stopped (a template that loops without end)") from None
    except jinja2.TemplateSyntaxError as exc:  # the template itself is broken: the caller's only if it gave it
        if chat_template is None:
            raise
        raise RequestError("chat_template", f"not a valid template: {str(exc)[:200]}") from None
    except jinja2.TemplateError as exc:  # the template's own raise_exception, or a key it needs and lacks
        raise RequestError("messages", f"the chat template refused the conversation: {str(exc)[:200]}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, RecursionError) as exc:  # its code failed on it
        raise RequestError("messages", f"the chat template failed on this conversation ({type(exc).__name__}: "
                           f"{str(exc)[:200]})") from None
    _check_roles_rendered(messages, text, render)
    return check_unicode("messages", text)


def _checked_documents(documents: object) -> list[dict[str, str]]:
    """`documents` as the template gets them: a list of mappings of strings (vLLM's list[dict[str, str]])."""
    if not isinstance(documents, (list, tuple)):
        raise RequestError("documents", f"must be a list of documents (mappings of strings, e.g. {{'title': ..., "
                           f"'text': ...}}), got {type(documents).__name__}")  # fmt: skip
    out = []
    for d, document in enumerate(documents):
        if not isinstance(document, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in document.items()):  # fmt: skip
            raise RequestError(f"documents[{d}]", f"must be a mapping of strings to strings, got {document!r:.60}")
        out.append({k: check_unicode(f"documents[{d}].{k[:40]}", v) for k, v in document.items()})
    return out


# the roles OpenAI's chat completions take (function: the deprecated function calls' results); a template may know
# others (Llama 3.1's ipython, GLM's observation), which are rendered as vLLM renders them: as given
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# roles outside OpenAI's checked one rendering each; those past them are checked together in one more rendering, so
# that a conversation of many roles costs a bounded number of renderings, not one per role (quadratic)
ROLES_CHECKED_APART = 8


def _check_roles_rendered(messages: list[dict], text: str, render: Callable[[list[dict]], str]) -> None:
    """A role outside OpenAI's that the template drops (the conversation renders the same whatever its messages say,
    as templates that pick known roles do: Qwen2.5's, Phi-3's) is a RequestError naming messages[i].role: the
    message would vanish from the prompt unseen. The messages stay where they are (their contents replaced by a
    probe text), so a template that checks the conversation's shape renders them as it would; a rendering that
    fails tells nothing: the role stands. The first ROLES_CHECKED_APART such roles are checked one by one, the rest
    together (dropped when all of them are)."""
    others = list(dict.fromkeys(m["role"] for m in messages if m["role"] not in OPENAI_ROLES))
    groups = [{role} for role in others[:ROLES_CHECKED_APART]]
    if others[ROLES_CHECKED_APART:]:
        groups.append(set(others[ROLES_CHECKED_APART:]))
    for group in groups:
        probed = [{**m, "content": _ROLE_PROBE if isinstance(m["content"], str) else [_ROLE_PROBE_PART]}
                  if m["role"] in group else m for m in messages]  # fmt: skip
        try:
            dropped = render(probed) == text
        except Exception:  # noqa: BLE001 - a template that fails on the probe text: nothing tells
            continue
        if dropped:
            first = next(i for i, m in enumerate(messages) if m["role"] in group)
            role = messages[first]["role"]
            raise RequestError(f"messages[{first}].role", f"{role[:40]!r}: this model's chat template renders no "
                               f"message of this role (the prompt reads the same whatever it says); OpenAI's roles: "
                               f"{', '.join(OPENAI_ROLES)}", code="invalid_value")  # fmt: skip


_ROLE_PROBE = "\u2063trtpaged role probe\u2063"  # no real message's text: a template that renders it shows it
_ROLE_PROBE_PART = {"type": "text", "text": _ROLE_PROBE}


class LLM:
    """Loads an engine dir and generates with continuous batching and KV sharing.

    >>> llm = LLM("engines/smollm2")
    >>> (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
    ...                SamplingParams(max_tokens=16, temperature=0))
    >>> out.outputs[0].text

    The engine dir comes first (`model=`, vLLM's name for it, or `engine=`). vLLM's engine arguments
    (`max_model_len`, `max_num_seqs`, `seed`, `dtype`, ...) are taken as `trtpaged/runtime/vllm_args.py` says,
    or refused naming them. Limits default to the engine's
    build limits (manifest) and may be
    tightened: `max_num_tokens`, `max_batch_size`, `max_seq_len`; the KV pool
    size defaults to the manifest's budget (`num_kv_blocks` overrides it). For a model whose every layer
    has a sliding window (Mistral-style), blocks wholly before a sequence's window go back to the pool as
    it advances; `reclaim_windowed_blocks=False` keeps them (docs/families.md). A request may ask for at most
    `max_logprobs` top log-probs per token (`logprobs`, `prompt_logprobs`; vLLM's default 20, -1: the whole
    vocabulary). `scheduling_policy="priority"` (vLLM's) serves requests by their priority (lower first, then
    arrival: `generate(..., priority=[...])`, the server's `priority` field) and preempts the largest value first;
    the default "fcfs" serves them in arrival order and accepts only priority 0. `generation_config="auto"` (vLLM's
    default) samples with the model's recommended settings (its generation_config.json's temperature, top_p,
    top_k, min_p, repetition_penalty and max_new_tokens, recorded by the build as `sampling_defaults`) when
    `generate` is given no SamplingParams (`get_default_sampling_params()`); "vllm" ignores them.
    `chat_template` (a Jinja template's text; vLLM's --chat-template) replaces the engine's for every chat.
    `chat_template_content_format` (vLLM's --chat-template-content-format): how the template gets a message's
    content, "string" (text parts joined by newlines) or "openai" (a list of text parts); "auto" reads the template
    and gives the parts to one that loops over them.
    `reasoning_parser` (vLLM's: "deepseek_r1", "qwen3") names the model's reasoning tags (`trtpaged.runtime.reasoning`):
    it makes `SamplingParams.thinking_token_budget` available, and the server splits answers' thinking with it.

    `tensor_parallel=N` (default: the engine's) runs an engine built with
    `tensor_parallel: N` on N ranks: the other N-1 start here as processes (CPU: gloo over loopback;
    CUDA: one GPU each), or, when torchrun's variables (MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, RANK=0) are set, join from other machines.
    `close()` (or leaving a `with` block) stops them.

    `speculative_config` (a `SpeculativeConfig`, a dict or its JSON text, e.g.
    `{"method": "ngram", "num_speculative_tokens": 4}`, or a draft engine:
    `{"method": "draft_model", "model": "engines/smollm2-int4", "num_speculative_tokens": 4}`) turns on
    speculative decoding (docs/speculative.md); greedy outputs are the same as without it. `stats()` then
    carries the spec_decode_* counters.

    Before returning, the runner runs one warm-up step of the engine's largest shape (max_num_tokens
    tokens, max_batch_size sequences) and one decode step of those sequences (`warmup=False` skips
    both), so the first batch runs at the speed of the next ones (trtpaged/runtime/warmup.py).

    `kv_tiers` puts tiers below the KV pool (docs/kv_tiers.md): cached prefix blocks the pool evicts
    are written back to host memory, a local disk directory and/or a Redis server, and a later
    prompt with that prefix loads them instead of recomputing, e.g.
    `kv_tiers={"host_memory": "1GiB", "disk": {"path": "/tmp/kv", "size": "10GiB"}}`.
    `close()` writes the pool's cached prefixes to the tiers, so that a restart finds them on disk.

    The engine dir is untrusted input: its manifest, paths, file hashes (in full at the first load,
    `trtpaged.engine_files`), weights and tokenizer are checked before use. A dir that fails raises
    `EngineDirError` (`.path`, `.field`); a KV pool beyond the device's memory raises `KVBudgetError`.
    """

    def __init__(
        self,
        model: Union[str, Path, None] = None,
        *,
        engine: Union[str, Path, None] = None,
        backend: str = "auto",
        device: Optional[str] = None,
        num_kv_blocks: Optional[int] = None,
        max_num_tokens: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        max_seq_len: Optional[int] = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        scheduling_policy: str = "fcfs",
        num_host_blocks: int = 0,
        tensor_parallel: Optional[int] = None,
        speculative_config: Union[None, str, dict, SpeculativeConfig] = None,
        warmup: bool = True,
        kv_tiers: Union[None, KVTierConfig, dict] = None,
        reclaim_windowed_blocks: bool = True,
        max_logprobs: int = 20,
        generation_config: str = "auto",
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        reasoning_parser: Optional[str] = None,
        **vllm_args: Any,
    ) -> None:
        if (model is None) == (engine is None):
            raise TypeError("LLM: give the engine dir once, as model (vLLM's name for it) or as engine")
        engine = model if engine is None else engine
        device = resolve_device(device)
        tier_config = KVTierConfig.parse(kv_tiers)
        if tier_config.enabled and not enable_prefix_caching:
            raise ValueError("kv_tiers: needs enable_prefix_caching (the tiers hold prefix-cache blocks)")
        path = Path(engine)
        self.engine_dir = path.parent if path.is_file() else path
        self.manifest = read_manifest(self.engine_dir)
        verify_engine_dir(self.engine_dir, self.manifest)  # before anything of the dir is loaded
        ours = {"max_seq_len": max_seq_len, "max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens,
                "tensor_parallel": tensor_parallel, "num_host_blocks": num_host_blocks}  # fmt: skip
        apply_vllm_args(vllm_args, ours, self.manifest, engine, device)
        max_seq_len, max_batch_size = ours["max_seq_len"], ours["max_batch_size"]
        max_num_tokens = ours["max_num_tokens"]
        tensor_parallel, num_host_blocks = ours["tensor_parallel"], ours["num_host_blocks"]
        limits = self.manifest.limits
        num_kv_blocks = resolve_num_kv_blocks(self.manifest, device, num_kv_blocks)
        check_host_pool(num_host_blocks, self.manifest.kv_bytes_per_block_per_rank, device, num_kv_blocks)
        if tier_config.enabled:  # an entry holds one block of every rank: refused here, not after the weights load
            tier_config.check_room(limits.block_size,
                                   self.manifest.tensor_parallel * self.manifest.kv_bytes_per_block_per_rank)
        if tier_config.host_memory:
            check_host_tier(tier_config.host_memory, self.manifest.kv_bytes_per_block_per_rank, device, num_kv_blocks,
                            num_host_blocks)  # fmt: skip
        self.config = RuntimeConfig(
            block_size=limits.block_size,
            num_kv_blocks=num_kv_blocks,
            max_batch_size=_tightened("max_batch_size", max_batch_size, limits.max_batch_size),
            max_num_tokens=_tightened("max_num_tokens", max_num_tokens, limits.max_num_tokens),
            max_seq_len=_tightened("max_seq_len", max_seq_len, limits.max_seq_len),
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            scheduling_policy=scheduling_policy,
            num_host_blocks=num_host_blocks,
            speculative=SpeculativeConfig.parse(speculative_config),
            # a model whose every layer is windowed returns the blocks before each sequence's window
            reclaim_window=self.manifest.dims.max_window if reclaim_windowed_blocks else 0,
            max_logprobs=max_logprobs,
        )
        self.sampling_defaults = model_sampling_defaults(self.manifest, generation_config)
        self.chat_template = chat_template  # the override (None: the engine's), which every new_tokenizer() applies
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format: must be one of {list(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r:.40}")  # fmt: skip
        self.chat_template_content_format = chat_template_content_format
        self.tokenizer = self.new_tokenizer()
        if chat_template is not None:  # checked with the engine's tokenizer, before any weight loads
            check_chat_template(self.tokenizer, chat_template)
        # the tags as this tokenizer spells them; ValueError naming reasoning_parser before any weight loads
        self.reasoning = ReasoningReader.for_tokenizer(reasoning_parser, self.tokenizer) if reasoning_parser else None
        spec = self.config.speculative
        draft_manifest = None
        if spec is not None and spec.method == "draft_model":  # from manifests and tokenizers: before any weight loads
            from trtpaged.runtime.draft import check_draft

            draft_manifest = check_draft(spec.model, self.manifest, self.tokenizer, self.config.max_seq_len)
        runner = load_runner(self.engine_dir, self.manifest, num_kv_blocks, backend, device, num_host_blocks,
                             self.manifest.tensor_parallel if tensor_parallel is None else tensor_parallel)
        # Ready means ready: the first batch's one-off costs (scratch growth, first-touched pages, the
        # LM head's packing, thread start) are paid here, in one step of the largest shape (runtime/warmup.py).
        self.warmup_tokens = warm_up(runner, self.config) if warmup else 0
        cpu_share.give_back_here()  # the warm-up stepped on the caller's thread
        spec = self.config.speculative
        if spec is not None and spec.verify_row_cost is None:  # the cost rule's row cost for this engine's arithmetic
            cost = default_verify_row_cost(self.manifest.quantization)
            self.config = dataclasses.replace(self.config, speculative=dataclasses.replace(spec, verify_row_cost=cost))
        eos = list(self.manifest.eos_token_ids) or (
            [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])
        tiers = None
        if tier_config.enabled:  # an entry holds one block of every tensor-parallel rank, rank 0's first
            pool = runner.kv_cache  # type: ignore[attr-defined]
            ranks = self.manifest.tensor_parallel
            fingerprint = manifest_fingerprint(self.manifest, tuple(pool.shape[1:]), str(pool.dtype))
            try:
                tiers = tier_config.build(fingerprint, ranks * pool_block_bytes(pool))
            except BaseException:  # e.g. a disk path that cannot be written: stop the ranks started above
                getattr(runner, "close", lambda: None)()
                raise
        draft = None
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            from trtpaged.runtime.draft import load_draft

            try:
                draft = load_draft(spec.model, self.engine_dir, self.manifest, self.tokenizer, backend, device,
                                   self.config.max_seq_len, spec.draft_token_cost, checked=draft_manifest)
            except BaseException:
                getattr(runner, "close", lambda: None)()
                raise
        self.engine = LLMEngine(runner, self.config, self.tokenizer, eos, self.manifest.dims.vocab_size, tiers, draft)
        self.engine.reasoning = self.reasoning
        # calls from several threads run one at a time: each `generate` steps the engine until everything in
        # it is finished, so two at once stepped one engine from two threads (KeyError, IndexError)
        self._calls = threading.Lock()
        self._caller: Optional[int] = None  # the thread inside a call (one from inside it is refused, not deadlocked)
        self._closed = False
        pool_tokens = self.config.num_kv_blocks * self.config.block_size
        # vLLM refuses to start; here such a request ends early (a windowed engine's sequences hold only their window)
        if pool_tokens < self.config.max_seq_len and not self.config.reclaim_window:
            log.warning("the KV pool holds %d tokens (%d blocks), fewer than max_seq_len %d: a request that "
                        "outgrows it ends there (finish_reason length)", pool_tokens, self.config.num_kv_blocks,
                        self.config.max_seq_len)
        # Everything loaded so far lives as long as the engine: moved out of the cyclic collector's
        # sight, so that the collections a serving loop triggers stop walking it (they were 3% of a
        # decode-bound benchmark's CPU time; vLLM's engine does the same).
        gc.collect()
        gc.freeze()

    def generate(
        self,
        prompts: Union[Prompt, Seq[Prompt]],
        sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: None = None,
        priority: Optional[Seq[int]] = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.

        A prompt is text or a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids} (with an
        optional "cache_salt"); one SamplingParams applies to all, or pass one per prompt. As in vLLM's offline
        API, a `max_tokens` past the room the prompt leaves in max_seq_len is cut to that room (the output then
        ends "length" there); a prompt that leaves no room is refused.
        `use_tqdm` (vLLM's): a progress bar of finished prompts on a terminal (a callable: the tqdm-like class to
        use); `lora_request` must be None (no adapters here). `priority` (vLLM's): one per prompt, under
        `scheduling_policy="priority"`; lower values are served first.
        Calls from several threads run one at a time (vLLM's LLM leaves that to the caller); one from inside a
        running call (its progress bar's callback) or after `close()` raises RuntimeError.
        A prompt that fails inside a step on its own (e.g. NaN logits in its rows) comes back finished,
        with finish_reason "error" and `error` set, and the others complete; a failure of the step
        itself (the model raising) raises here, and this call's requests are aborted.
        """
        if lora_request is not None:
            raise ValueError("lora_request: trtpaged serves no LoRA adapters (merge one into the model, then build)")
        pairs = _prompt_list(prompts)
        prompts, salts = [p for p, _ in pairs], [salt for _, salt in pairs]
        params = sampling_params or self.get_default_sampling_params()
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"sampling_params: {len(per_prompt)} given for {len(prompts)} prompts")
        wrong = next((sp for sp in per_prompt if not isinstance(sp, SamplingParams)), None)
        if wrong is not None:
            raise TypeError(f"sampling_params: a SamplingParams or a list of them, got {type(wrong).__name__}")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority: {len(priorities)} given for {len(prompts)} prompts")
        final_only = RequestOutputKind.FINAL_ONLY  # only the finished outputs are kept: build no others
        per_prompt = [dataclasses.replace(sp, output_kind=final_only,
                                          **({"cache_salt": salt} if salt is not None else {}))
                      for sp, salt in zip(per_prompt, salts)]  # fmt: skip
        with self._one_call("generate"):
            return self._run(prompts, per_prompt, use_tqdm, priorities)

    @contextlib.contextmanager
    def _one_call(self, name: str) -> Iterator[None]:
        """Holds this LLM for one call: other threads wait their turn; the same thread (a progress bar's callback
        calling generate) is refused, as is any call after close()."""
        if self._caller == threading.get_ident():
            raise RuntimeError(f"LLM.{name} called from inside a running call of this LLM (e.g. its progress bar)")
        with self._calls:
            if self._closed:
                raise RuntimeError(f"LLM.{name}: this LLM is closed")
            self._caller = threading.get_ident()
            try:
                yield
            finally:
                self._caller = None
                cpu_share.give_back_here()

    def _run(self, prompts: list, per_prompt: list[SamplingParams], use_tqdm: Any,
             priorities: Optional[list[int]] = None) -> list[RequestOutput]:  # fmt: skip
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = None
        try:
            for p, sp, priority in zip(prompts, per_prompt, priorities or [0] * len(prompts)):
                ids.append(self.engine.add_request(p, sp, fit_max_tokens=True, priority=priority))
            bar = _progress_bar(use_tqdm, len(ids))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # All or nothing: a refused prompt, a failed step or Ctrl-C must not leave this
            # call's requests queued or holding KV blocks.
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: Union[Seq[dict], Seq[Seq[dict]]],
        sampling_params: Union[None, SamplingParams, Seq[SamplingParams]] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: None = None,
        chat_template: Optional[str] = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[Seq[dict]] = None,
        chat_template_content_format: Optional[str] = None,
    ) -> list[RequestOutput]:
        """Applies the chat template (the engine's, or `chat_template`) and generates the assistant's reply.

        As vLLM's `LLM.chat`: one conversation (a list of messages) or a list of conversations, generated
        together; returns one RequestOutput per conversation, in order, whose `prompt` is the templated text.
        The keyword options are `chat_prompt`'s (vLLM's names); `use_tqdm` and `lora_request` are `generate`'s;
        `chat_template_content_format` (None: this LLM's) as the constructor's.
        """
        if not isinstance(messages, (list, tuple)):
            raise RequestError("messages", "must be a list of messages ({'role': ..., 'content': ...}) or a list of "
                               f"such lists, got {type(messages).__name__}")  # fmt: skip
        batch = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if batch else [messages]
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise RequestError("chat_template", "must be a Jinja template's text")
        texts = [chat_prompt_text(self.tokenizer, c, tools, add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs,
                                  chat_template=chat_template,
                                  content_format=chat_template_content_format or self.chat_template_content_format)
                 for c in conversations]  # type: ignore[arg-type]  # fmt: skip
        prompts = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def chat_prompt(self, messages: Seq[dict], tools: Optional[Seq[dict]] = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: Optional[dict[str, Any]] = None, add_special_tokens: bool = False
                    ) -> list[int]:  # fmt: skip
        """Token ids of a conversation under the chat template, ready for the assistant's turn (`tools`: OpenAI
        tool definitions, for templates that show them to the model). As vLLM's chat options:
        `continue_final_message` leaves the last (assistant) message open for the model to continue, instead of
        starting a new turn; `template_kwargs` are more variables for the template (e.g. `enable_thinking`);
        `add_special_tokens`: what the tokenizer adds (a BOS) on top of the template's own text."""
        return chat_prompt_ids(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                               add_special_tokens=add_special_tokens,
                               content_format=self.chat_template_content_format)  # fmt: skip

    def get_tokenizer(self) -> Any:
        """The engine dir's tokenizer (vLLM's accessor; the same object as `tokenizer`)."""
        return self.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name of `engine` (add_request / step / abort / has_unfinished)."""
        return self.engine

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's call: forgets the KV pool's cached prefixes (the next requests compute theirs again; KV tiers
        keep theirs). True once done; between `generate` calls nothing is running, so it always succeeds then."""
        with self._one_call("reset_prefix_cache"):
            return self.engine.reset_prefix_cache(reset_running_requests)

    def new_tokenizer(self) -> Any:
        """A tokenizer of its own, as this LLM's (for another thread: a fast tokenizer is not shared)."""
        return load_tokenizer(self.engine_dir, self.manifest, self.chat_template)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's accessor: what `generate` uses when given no SamplingParams: the model's recommended settings
        (`sampling_defaults`, from its generation config) over SamplingParams' own defaults."""
        return SamplingParams(**self.sampling_defaults)

    def beam_search(self, prompts: Any, params: BeamSearchParams, lora_request: None = None,
                    use_tqdm: Union[bool, Callable[..., Any]] = False,
                    concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:  # fmt: skip
        """vLLM's beam-search call: `params.beam_width` beams per prompt (prompts as `generate` takes them), each
        returned with the prompt's tokens and text in front (trtpaged/runtime/beam_api.py). `concurrency_limit`
        is taken for vLLM's signature; the scheduler bounds concurrency here."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params: a BeamSearchParams, got {type(params).__name__}")
        outs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return beam_outputs(outs, params, self.tokenizer)

    def close(self) -> None:
        """Writes the cached prefixes to the KV tiers (if any), stops the other tensor-parallel ranks; idempotent."""
        if self._closed:
            return
        with self._one_call("close"):  # after a generate running in another thread; none runs after it
            self.engine.close()
            close = getattr(self.engine.runner, "close", None)
            if close is not None:
                close()
            self._closed = True
        gc.unfreeze()  # what __init__ froze: the runner's cycles would hold its pool and the ranks' sockets for good

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def execution_plan(self) -> str:
        """How the runner runs a step here: the backend and, for torch, the layers' form and why
        (models/execution_plan.py: c_layers, fused or torch)."""
        runner = self.engine.runner
        plan = getattr(runner, "execution_plan", None)
        return f"{runner.backend}: {plan}" if plan else runner.backend

    def stats(self) -> dict[str, float]:
        """KV blocks total/used/free/cached, utilisation, blocks saved by sharing, prefix hits, preemptions, steps.
        Read between two calls of other threads (never a step half applied); a running call's own thread (its
        progress bar) reads it between that call's steps."""
        if self._caller == threading.get_ident():
            return self.engine.stats()
        with self._calls:
            return self.engine.stats()
