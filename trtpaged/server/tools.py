"""OpenAI tool calls: `tools` + `tool_choice` -> an output grammar or a tool-call parser, and the output ->
`tool_calls`.

`tool_choice: {"type": "function", "function": {"name": N}}` constrains the output to N's arguments (its
`parameters` schema); `"required"` to a JSON array of one or more calls `[{"name": ..., "parameters": {...}}]`,
each matching one tool's schema. `"none"` generates text. `"auto"` (OpenAI's default when tools are given) lets
the model write freely and reads its calls with the parser of its chat template's format (`tool_format`); an
engine whose template takes no tools, or writes calls in no format we read, refuses it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Optional

from trtpaged.errors import RequestError, check_unicode
from trtpaged.runtime.sampling_params import MAX_SCHEMA_DEPTH, StructuredOutputsParams, nesting_depth
from trtpaged.runtime.schema_features import subschemas
from trtpaged.server.errors import ApiError
from trtpaged.server.tool_parsers import (FORMATS, HERMES, LLAMA3_JSON, MISTRAL, PARSER_NAMES, PHI4_MINI, PYTHONIC,
                                          REQUIRED, Format)
from trtpaged.server.tool_parsers import Call, CallReader, Content, Event, call_stream, parse_all

OPENAI_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
_FUNCTION_KEYS = ("name", "description", "parameters")  # a function's keys in vLLM's model order (strict after them)


# Chat-template text that shows which format the model writes calls in (the template's own instructions or its
# rendering of past calls), checked in this order; then the architecture's usual format.
_TEMPLATE_MARKERS = (("<tool_call>", HERMES), ("[TOOL_CALLS]", MISTRAL), ("functools", PHI4_MINI),
                     ("[func_name1(", PYTHONIC), ("<|python_tag|>", LLAMA3_JSON))  # fmt: skip
_FAMILY_FORMATS = {"Qwen2ForCausalLM": HERMES, "Qwen3ForCausalLM": HERMES, "SmolLM3ForCausalLM": HERMES,
                   "MistralForCausalLM": MISTRAL, "Phi3ForCausalLM": PHI4_MINI}  # fmt: skip


@dataclass(frozen=True)
class AutoTools:
    """How this engine answers `tool_choice: "auto"`: the format its model writes calls in, or why it cannot."""

    format: Optional[Format]
    reason: str = ""  # when format is None


# a named tool choice, and the tool choices a refusal of 'auto' offers instead, in chat's spelling (the other APIs'
# refusals replace them with their own)
NAMED_CHOICE = "{'type': 'function', 'function': {'name': ...}}"
NOT_AUTO = f"'required', 'none' or {NAMED_CHOICE}"
ALLOWED_CHOICE = "{'type': 'allowed_tools', 'allowed_tools': {'mode': ..., 'tools': [...]}}"


def _rooted(schema: dict[str, Any], root: str) -> dict[str, Any]:
    """A copy of `schema` to be placed at `root` (a JSON pointer) of another schema, its local $refs (`#`,
    `#/$defs/Date`, `#/properties/a`) pointing into it there (`#/$defs/f`, `#/$defs/f/$defs/Date`, ...)."""
    copied = copy.deepcopy(schema)
    for _, node in subschemas(copied):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = root + ref[1:]
    return copied


def _template_takes_tools(template: str) -> bool:
    """Whether the chat template reads the `tools` variable (jinja2's own analysis; a regex when it cannot parse
    a template that uses transformers' extensions)."""
    try:
        import jinja2
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # noqa: BLE001 - jinja2 refuses templates with transformers' extension tags
        return re.search(r"(?<![\w.])tools\b", template) is not None


def tool_format(chat_template: Any, architecture: str, parser: Optional[str] = None) -> AutoTools:
    """The tool-call format of an engine's model: `parser` (a PARSER_NAMES key, vLLM's --tool-call-parser, checked
    by ServerOptions) when given, else read from its chat template (a dict of templates: its "tool_use" one) and,
    when the template shows none, its architecture."""
    if parser is not None:
        return AutoTools(PARSER_NAMES[parser])
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not isinstance(chat_template, str) or not chat_template:
        return AutoTools(None, "the engine has no chat template")
    if not _template_takes_tools(chat_template):
        return AutoTools(None, "this model's chat template does not take tools")
    for marker, fmt in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return AutoTools(fmt)
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:  # Llama 3.2 / 3.3's template
        return AutoTools(LLAMA3_JSON)
    if architecture in _FAMILY_FORMATS:
        return AutoTools(_FAMILY_FORMATS[architecture])
    return AutoTools(None, f"no tool-call parser for this model ({architecture}); the formats read are "
                           f"{', '.join(sorted(FORMATS))}")  # fmt: skip


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tools ask of the output: `named` set for a forced function, `auto` for free text
    read by the model's format, else "required"."""

    tools: dict[str, dict[str, Any]]  # name -> its parameters schema
    definitions: list[dict[str, Any]]  # the tools as the chat template gets them (_definition)
    named: Optional[str] = None
    auto: Optional[Format] = None
    parallel: bool = True  # parallel_tool_calls: false: "required" makes exactly one call, auto keeps the first
    functions: bool = False  # asked for with the legacy `functions` (legacy_functions.py): answered as function_call

    def grammar(self) -> Optional[StructuredOutputsParams]:
        """The output grammar (None for auto: the model writes freely)."""
        if self.auto is not None:
            return None
        for index, (name, parameters) in enumerate(self.tools.items()):  # what the grammar forces is an object
            if (self.named is None or name == self.named) and parameters.get("type", "object") != "object":
                raise ApiError(f"tools[{index}].function.parameters: a forced call's arguments are a JSON object; "
                               f"got type {parameters['type']!r:.40}", "tools")  # fmt: skip
        if self.named is not None:
            return StructuredOutputsParams(json=self.tools[self.named], origin=self.choice_field)
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for name in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "$defs": {name: _rooted(parameters, f"#/$defs/{name}")
                                            for name, parameters in self.tools.items()}}  # fmt: skip
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, origin="tool_choice")

    @property
    def choice_field(self) -> str:
        """The request field that chose the call: tool_choice, or function_call (the legacy form)."""
        return "function_call" if self.functions else "tool_choice"

    @property
    def calls_finish(self) -> str:
        """The finish_reason of an answer that is a complete call (not a named one's: those end with "stop")."""
        return "function_call" if self.functions else "tool_calls"

    def _format(self) -> Optional[Format]:
        return self.auto if self.auto is not None else (None if self.named is not None else REQUIRED)

    def stream(self) -> CallReader:
        """An incremental reader of one choice's output (for a streamed answer)."""
        reader = call_stream(self._format(), self.tools, self.named)
        return reader if self.parallel else _FirstCall(reader)

    def read(self, text: str) -> tuple[Optional[str], Optional[list[dict[str, Any]]], bool]:
        """(content, OpenAI `tool_calls` or None, whether the output read as well-formed calls) of a finished
        output, however it ended: what a stream of it sent, joined (the calls that went out, with the arguments
        written so far), so that the streamed and the whole answer agree. The arguments are the model's JSON text."""
        content, calls, ok = parse_all(self._format(), self.tools, text, self.named)
        calls = calls if self.parallel else calls[:1]
        if not calls:
            return (content if text else ""), None, False  # an empty output's content is "", as without tools
        return content, [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for c in calls], ok  # fmt: skip


class _FirstCall:
    """A reader that passes on a choice's first call only: `parallel_tool_calls: false` under auto, where the model
    may write several (vLLM and OpenAI answer one; the grammar of "required" holds one already)."""

    def __init__(self, reader: CallReader) -> None:
        self._reader = reader

    @property
    def calls(self) -> list[Call]:
        return self._reader.calls[:1]

    @property
    def malformed(self) -> bool:
        return self._reader.malformed

    @property
    def ok(self) -> bool:
        return self._reader.ok

    def feed(self, text: str, final: bool = False) -> list[Event]:
        return [e for e in self._reader.feed(text, final) if isinstance(e, Content) or e.index == 0]

    def finish(self) -> list[Event]:
        return [e for e in self._reader.finish() if isinstance(e, Content) or e.index == 0]


def _tool(index: int, value: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function" \
            or not isinstance(value.get("function"), dict):  # fmt: skip
        raise ApiError(f"{where}: must be {{'type': 'function', 'function': {{name, description?, parameters?}}}}",
                       "tools")  # fmt: skip
    fn = value["function"]
    # cache_control: Anthropic's prompt-cache hint, which LiteLLM puts on tools too (the prefix cache is automatic)
    for at, keys, allowed in ((where, value, {"type", "function", "cache_control"}),
                              (f"{where}.function", fn, {*_FUNCTION_KEYS, "strict"})):
        extra = set(keys) - allowed
        if extra:
            raise ApiError(f"{at}: unknown keys {sorted(extra)!r:.120}", "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ApiError(f"{where}.function.strict: must be true or false, got {fn['strict']!r:.40}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not OPENAI_NAME.fullmatch(name):
        raise ApiError(f"{where}.function.name: must match [A-Za-z0-9_-]{{1,64}}, got {name!r:.80}", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):  # the template would render any value
        raise ApiError(f"{where}.function.description: must be a string, got {type(description).__name__}", "tools")
    params = fn.get("parameters")
    if params is None:  # absent or null (as OpenAI and vLLM read it): a function of no arguments
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ApiError(f"{where}.function.parameters: must be a JSON schema object", "tools")
    _check_parameters(f"{where}.function.parameters", params)
    _check_text(f"{where}.function.description", description)
    _check_text(f"{where}.function.parameters", params)
    if "type" not in params and not any(k in params for k in ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")):
        params = {**params, "type": "object"}  # `{}` (no constraint) is an object of any properties here
    return name, params


def _definition(value: dict[str, Any]) -> dict[str, Any]:
    """A checked tool as the template gets it, typed as vLLM's model gives it: {type, function} with the function's
    keys in the model's order (name, description, parameters, then strict), whatever order the client wrote them in
    (the openai SDK's pydantic_function_tool writes name, strict, parameters, description); a template that writes
    a tool as JSON (`tool | tojson`) writes them so. A key given as null is left out, as the template sees it absent."""
    fn = value["function"]
    keys = [*_FUNCTION_KEYS, *(k for k in fn if k not in _FUNCTION_KEYS)]
    rest = {k: v for k, v in value.items() if k not in ("type", "function")}
    return {"type": "function", "function": {k: fn[k] for k in keys if fn.get(k) is not None}, **rest}


def _check_text(where: str, value: Any) -> None:
    """A 400 naming the first string in a tool's definition (a key or a value) that no tokenizer takes (a lone
    surrogate): the template renders the definition, whose refusal would name `messages` and a place in its text.
    `value` nests at most MAX_SCHEMA_DEPTH deep (checked before)."""
    if isinstance(value, str):
        try:
            check_unicode(where, value)
        except RequestError as exc:
            raise ApiError(str(exc), "tools") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            at = f"{where}[{key!r:.40}]"  # repr: the message never carries the surrogate itself
            _check_text(at, key)
            _check_text(at, item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(f"{where}[{i}]", item)


def _check_parameters(where: str, schema: dict[str, Any]) -> None:
    """A 400 on `tools` for parameters that are not a JSON schema (of the draft it names, else of 2020-12, 7 or 4),
    whatever tool_choice is: a tool the model is shown, or may be forced to call, must say what its arguments are."""
    import jsonschema

    if nesting_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # the metaschema check recurses through it
        raise ApiError(f"{where}: nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep", "tools")
    # the draft the schema names ($schema), or without one any of 2020-12, 7 and 4 (tools written for older drafts:
    # tuple `items`, a boolean exclusiveMinimum), checked against its metaschema without format checks: a pattern
    # in ECMA syntax (\p{L}) is not Python's re, and OpenAI and vLLM take it
    drafts = ([jsonschema.validators.validator_for(schema)] if isinstance(schema.get("$schema"), str) else
              [jsonschema.Draft202012Validator, jsonschema.Draft7Validator, jsonschema.Draft4Validator])
    errors = [jsonschema.exceptions.best_match(d(d.META_SCHEMA).iter_errors(schema)) for d in drafts]
    error = None if any(e is None for e in errors) else errors[0]
    if error is not None:
        at = "".join(f"[{p!r}]" for p in error.absolute_path)
        raise ApiError(f"{where}{at}: not a JSON schema: {error.message[:200]}", "tools")


def _named_choice(choice: Any) -> Optional[str]:
    """The function a named tool_choice {"type": "function", "function": {"name": N}} forces, None if it is not one.
    A missing type is "function", as vLLM has it: huggingface_hub's ChatCompletionInputToolChoiceClass (TGI's
    form) sends none."""
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        return None
    function = choice.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _allowed_tools(choice: Any, specs: dict[str, dict[str, Any]]) -> Optional[tuple[str, dict[str, dict[str, Any]]]]:
    """OpenAI's {"type": "allowed_tools", "allowed_tools": {"mode": "auto" or "required", "tools": [{"type":
    "function", "function": {"name": N}}, ...]}}: (its mode, the tools' parameters of the names it allows); None for
    another choice."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    where = "tool_choice.allowed_tools"
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
        raise ApiError(f"{where}: must be {{'mode': 'auto' or 'required', 'tools': [...]}}, got {allowed!r:.80}",
                       "tool_choice")  # fmt: skip
    listed = allowed.get("tools")
    if not isinstance(listed, list) or not listed:
        raise ApiError(f"{where}.tools: must be a non-empty list of {NAMED_CHOICE}", "tool_choice")
    names = []
    for i, tool in enumerate(listed):
        name = _named_choice(tool)
        if not isinstance(name, str):
            raise ApiError(f"{where}.tools[{i}]: must be {NAMED_CHOICE} (function tools only), got {tool!r:.80}",
                           "tool_choice")  # fmt: skip
        if name not in specs:
            raise ApiError(f"{where}.tools[{i}]: no tool named {name!r:.64} in tools", "tool_choice")
        names.append(name)
    return allowed["mode"], {name: params for name, params in specs.items() if name in names}


def shown_tools(tools: Optional[list[Any]], choice: Any = None) -> Optional[list[dict[str, Any]]]:
    """The tool definitions a chat template is shown, whatever tool_choice is ("none" too: OpenAI's meaning, vLLM's
    default), checked as a forced choice checks them; None without tools. `choice`, when given, is checked as chat
    checks it, but for whether this engine reads calls under "auto": the prompt is the same (/tokenize's)."""
    if choice is None and not tools:
        return None
    # one check of the tools and the choice ("required" for none given: every tool checked as a forced call)
    tool_choice(tools, "required" if choice is None else choice, AutoTools(REQUIRED))
    return [_definition(value) for value in tools] if tools else None


def tool_choice(tools: Optional[list[Any]], choice: Any, auto: AutoTools = AutoTools(None, ""),
                parallel: bool = True) -> Optional[ToolChoice]:  # fmt: skip
    """The request's tool handling, None for "none" or no tools; a bad spec is a 400 naming the field. `auto`: the
    engine's tool-call format, for tool_choice "auto"; `parallel`: parallel_tool_calls."""
    if choice is not None and not tools and choice != "none":
        raise ApiError("tool_choice: needs tools", "tool_choice")
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise ApiError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    specs: dict[str, dict[str, Any]] = {}
    for i, value in enumerate(tools):
        name, params = _tool(i, value)
        if name in specs:
            raise ApiError(f"tools[{i}].function.name: {name!r} is defined twice", "tools")
        specs[name] = params
    definitions = [_definition(value) for value in tools]
    choice = "auto" if choice is None else choice
    allowed = _allowed_tools(choice, specs)
    if allowed is not None:  # the template is shown every tool; the calls are read (or forced) among these only
        choice, specs = allowed
    if choice == "none":
        return None
    if choice == "auto":
        if auto.format is None:
            raise ApiError(f"tool_choice: 'auto' (the default when tools are given) is not available: {auto.reason}; "
                           f"send {NOT_AUTO}", "tool_choice")  # fmt: skip
        return ToolChoice(specs, definitions, auto=auto.format, parallel=parallel)
    if choice == "required":
        return ToolChoice(specs, definitions, parallel=parallel)
    name = _named_choice(choice)
    if name is None:
        raise ApiError(f"tool_choice: must be 'none', 'auto', 'required', {NAMED_CHOICE} or "
                       f"{ALLOWED_CHOICE}, got {choice!r:.80}", "tool_choice")  # fmt: skip
    if name not in specs:
        raise ApiError(f"tool_choice: no tool named {name!r:.64} in tools", "tool_choice")
    return ToolChoice(specs, definitions, named=name, parallel=parallel)
