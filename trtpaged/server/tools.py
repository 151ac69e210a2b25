"""OpenAI tool calls on the grammar engine: `tools` + `tool_choice` -> an output grammar, and the constrained
output -> `tool_calls`.

`tool_choice: {"type": "function", "function": {"name": N}}` constrains the output to N's arguments (its
`parameters` schema); `"required"` to a JSON array of one or more calls `[{"name": ..., "parameters": {...}}]`,
each matching one tool's schema. `"none"` generates text. `"auto"` (OpenAI's default when tools are given)
needs a per-model-family parser of free-form tool calls, which this server does not have: it is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from trtpaged.runtime.sampling_params import StructuredOutputsParams
from trtpaged.server.errors import ApiError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request's tools ask of the output: `named` set for a forced function, else "required"."""

    tools: dict[str, dict[str, Any]]  # name -> its parameters schema
    definitions: list[dict[str, Any]]  # the tools as given (for the chat template)
    named: Optional[str] = None

    def grammar(self) -> StructuredOutputsParams:
        if self.named is not None:
            return StructuredOutputsParams(json=self.tools[self.named], origin="tool_choice")
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.tools.items()]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return StructuredOutputsParams(json=schema, origin="tool_choice")

    def calls(self, text: str) -> Optional[list[dict[str, Any]]]:
        """OpenAI `tool_calls` from a finished constrained output; None if it is not complete (e.g. cut by
        max_tokens), in which case the text is returned as content."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            pairs = [(self.named, value)]
        elif isinstance(value, list) and all(isinstance(c, dict) and c.get("name") in self.tools for c in value):
            pairs = [(c["name"], c.get("parameters", {})) for c in value]
        else:
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}} for name, args in pairs]  # fmt: skip


def _tool(index: int, value: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{index}]"
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise ApiError(f"{where}: must be {{'type': 'function', 'function': {{name, description?, parameters?}}}}",
                       "tools")  # fmt: skip
    fn = value["function"]
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ApiError(f"{where}.function: unknown keys {sorted(extra)}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(f"{where}.function.name: must match [A-Za-z0-9_-]{{1,64}}, got {name!r:.80}", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise ApiError(f"{where}.function.parameters: must be a JSON schema object", "tools")
    return name, params


def tool_choice(tools: Optional[list[Any]], choice: Any) -> Optional[ToolChoice]:
    """The request's tool constraint, None for "none" or no tools; a bad spec is a 400 naming the field."""
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
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        raise ApiError("tool_choice: 'auto' (the default when tools are given) needs a model-specific tool-call "
                       "parser, which this server does not have; send 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")  # fmt: skip
    if choice == "required":
        return ToolChoice(specs, list(tools))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None  # fmt: skip
    if name is None:
        raise ApiError(f"tool_choice: must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                       f"{{'name': ...}}}}, got {choice!r:.80}", "tool_choice")  # fmt: skip
    if name not in specs:
        raise ApiError(f"tool_choice: no tool named {name!r:.64} in tools", "tool_choice")
    return ToolChoice(specs, list(tools), named=name)
